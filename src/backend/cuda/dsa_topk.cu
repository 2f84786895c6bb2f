// DSA lightning-indexer selection: per query, ReLU-head scores over every cached key, then an exact
// top-k by 4-pass radix select on order-preserving float bits, emitted in ascending position order.
// Ties at the k-th score go to the lower positions (the CPU reference instead mimics PyTorch's topk order).
#include <cmath>

#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"

namespace moesrv::cuda {

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;

__device__ __forceinline__ uint32_t ordered_bits(float f) {
  const uint32_t b = __float_as_uint(f + 0.0f);  // -0 -> +0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Exclusive prefix count of `flag` over the block in thread order; `total` gets the block's count.
__device__ int block_exclusive_count(bool flag, int& total) {
  __shared__ int warp_counts[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  __syncthreads();
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int before = 0;
  total = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += warp_counts[w];
    total += warp_counts[w];
  }
  return before + __popc(ballot & ((1u << lane) - 1u));
}

__global__ void __launch_bounds__(kThreads) dsa_topk_kernel(const float* q, const float* hw, const DeviceLayerCache* lcp,
                                                             int s_begin, int nh, int d, int K, const int32_t* pos0,
                                                             int64_t max_ctx, float* scratch, int32_t* sel) {
  extern __shared__ float q_s[];  // nh * d, then nh head weights
  __shared__ int hist[256];
  __shared__ uint32_t prefix_s;
  __shared__ int want_s;
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
  if (tid == 0) {
    prefix_s = 0;
    want_s = K;
  }
  __syncthreads();
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    const uint32_t hi_mask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
    for (int i = tid; i < 256; i += kThreads) hist[i] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s;
    for (int t = tid; t < n_valid; t += kThreads) {
      const uint32_t u = ordered_bits(sc[t]);
      if ((u & hi_mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1);
    }
    __syncthreads();
    if (tid == 0) {
      int cum = 0, want = want_s;
      for (int b = 255; b >= 0; --b) {
        if (cum + hist[b] >= want) {
          prefix_s = prefix | (uint32_t(b) << shift);
          want_s = want - cum;
          break;
        }
        cum += hist[b];
      }
    }
    __syncthreads();
  }
  const uint32_t thr = prefix_s;
  const int want_equal = want_s;
  int written = 0, equal_seen = 0;
  for (int base = 0; base < n_valid; base += kThreads) {
    const int t = base + tid;
    const uint32_t u = t < n_valid ? ordered_bits(sc[t]) : 0u;
    const bool greater = t < n_valid && u > thr, equal = t < n_valid && u == thr;
    int eq_total = 0, take_total = 0;
    const int eq_rank = block_exclusive_count(equal, eq_total) + equal_seen;
    const bool take = greater || (equal && eq_rank < want_equal);
    const int slot = block_exclusive_count(take, take_total) + written;
    if (take) out[slot] = t;
    equal_seen += eq_total;
    written += take_total;
  }
  for (int i = written + tid; i < K; i += kThreads) out[i] = -1;
}

}  // namespace

void dsa_topk(const float* q, const float* hw, const DeviceLayerCache* lc, int s_begin, int n, int nh, int d, int K,
              const int32_t* pos0, int64_t max_ctx, float* scratch, int32_t* sel, cudaStream_t st) {
  if (n == 0) return;
  const size_t smem = size_t(nh * d + nh) * sizeof(float);
  if (smem > 48 * 1024) throw std::runtime_error("dsa_topk: indexer query of " + std::to_string(nh * d + nh) + " floats exceeds shared memory");
  dsa_topk_kernel<<<n, kThreads, smem, st>>>(q, hw, lc, s_begin, nh, d, K, pos0, max_ctx, scratch, sel);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
