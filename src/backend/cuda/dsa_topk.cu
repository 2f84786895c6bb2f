// DSA lightning-indexer selection: per query, ReLU-head scores over every cached key, then the exact top-k of
// radix_topk.cuh, emitted in ascending position order. Ties at the k-th score go to the lower positions (the CPU
// reference instead follows PyTorch's topk order).
#include <cmath>

#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/radix_topk.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kThreads = kTopkThreads;

__global__ void __launch_bounds__(kThreads) dsa_topk_kernel(const float* q, const float* hw, const DeviceLayerCache* lcp,
                                                             int s_begin, int nh, int d, int K, const int32_t* pos0,
                                                             int64_t max_ctx, float* scratch, int32_t* sel) {
  pdl_enter();
  extern __shared__ float q_s[];  // nh * d, then nh head weights
  const int s = s_begin + blockIdx.x, tid = threadIdx.x;
  const int n_valid = *pos0 + s + 1;
  int32_t* out = sel + int64_t(s) * K;
  if (n_valid <= K) {
    for (int i = tid; i < K; i += kThreads) out[i] = i < n_valid ? i : -1;
    return;
  }
  const uint16_t* keys = lcp->index_k;
  float* w_s = q_s + nh * d;
  for (int i = tid; i < nh * d; i += kThreads) q_s[i] = q[int64_t(s) * nh * d + i];
  const float head_scale = 1.0f / sqrtf(float(nh)), qk_scale = 1.0f / sqrtf(float(d));
  for (int i = tid; i < nh; i += kThreads) w_s[i] = hw[int64_t(s) * nh + i] * head_scale;
  __syncthreads();
  float* sc = scratch + int64_t(blockIdx.x) * max_ctx;
  for (int t = tid; t < n_valid; t += kThreads) {
    const uint16_t* kr = keys + int64_t(t) * d;
    float acc = 0.0f;
    for (int h = 0; h < nh; ++h) {
      float dot = 0.0f;
      for (int j = 0; j < d; ++j) dot += q_s[h * d + j] * bf16_to_f32(kr[j]);
      acc += fmaxf(dot * qk_scale, 0.0f) * w_s[h];
    }
    sc[t] = acc;
  }
  block_radix_topk(sc, n_valid, K, [&](int t, int slot) { out[slot] = t; });  // exactly K: no padding
}

}  // namespace

void dsa_topk(const float* q, const float* hw, const DeviceLayerCache* lc, int s_begin, int n, int nh, int d, int K,
              const int32_t* pos0, int64_t max_ctx, float* scratch, int32_t* sel, cudaStream_t st) {
  if (n == 0) return;
  const size_t smem = size_t(nh * d + nh) * sizeof(float);
  if (smem > 48 * 1024) throw std::runtime_error("dsa_topk: indexer query of " + std::to_string(nh * d + nh) + " floats exceeds shared memory");
  launch(dsa_topk_kernel, n, kThreads, smem, st, q, hw, lc, s_begin, nh, d, K, pos0, max_ctx, scratch, sel);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
