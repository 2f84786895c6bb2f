// KDA decode (one token) in one kernel: per head, the short conv + SiLU of its q, k and v channels (and their conv
// state update), the l2 norms of q and k, the decay gates and beta, the gated delta rule on the head's state (staged
// through shared memory so every global access is coalesced) and the sigmoid-gated output RMSNorm. One block per
// head; the same arithmetic, in the same order, as the separate kernels of linear_attention.cu.
#include <cmath>
#include <string>

#include "backend/cuda/glm5_next_kernels.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kThreads = 512, kWarps = kThreads / 32;

__device__ __forceinline__ float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

size_t smem_floats(int dk, int dv) { return size_t(dk) * (dv + 1) + 3 * size_t(dk) + 2 * size_t(dv); }

// The head's state [dk][dv] between global memory (S) and the padded shared copy st_s [dk][dv + 1], kBatch float4
// per thread in flight at once (a plain loop waits for each load: ~10 us of a 14 us kernel). dv % 4 == 0.
constexpr int kBatch = 8;
template <bool kLoad>
__device__ __forceinline__ void move_state(float* S, float* st_s, int dk, int dv) {
  const int n4 = dk * dv / 4, ST = dv + 1;
  float4* S4 = reinterpret_cast<float4*>(S);
  for (int base = 0; base < n4; base += kThreads * kBatch) {
    float4 v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * kThreads + int(threadIdx.x);
      if (i >= n4) continue;
      float* row = st_s + (4 * i / dv) * ST + 4 * i % dv;
      if constexpr (kLoad) v[u] = S4[i];
      else S4[i] = make_float4(row[0], row[1], row[2], row[3]);
    }
    if constexpr (kLoad)
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * kThreads + int(threadIdx.x);
        if (i >= n4) continue;
        float* row = st_s + (4 * i / dv) * ST + 4 * i % dv;
        row[0] = v[u].x, row[1] = v[u].y, row[2] = v[u].z, row[3] = v[u].w;
      }
  }
}

template <int R>
__global__ void __launch_bounds__(kThreads) kda_decode_kernel(KdaDecodeArgs a) {
  pdl_enter();
  constexpr int dk = 32 * R;
  extern __shared__ float sm[];
  __shared__ float inv_o;
  const int dv = a.dv, ST = dv + 1;  // padded state rows: a column walk is conflict-free
  float* st_s = sm;                  // [dk][ST]
  float* q_s = st_s + dk * ST;       // [dk]
  float* k_s = q_s + dk;             // [dk]
  float* e_s = k_s + dk;             // [dk] exp(decay)
  float* v_s = e_s + dk;             // [dv]
  float* o_s = v_s + dv;             // [dv]
  const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int Hd = a.heads * dk, C = 2 * Hd + a.heads * dv, K = a.conv_k, P = K - 1;

  float* S = a.state + int64_t(h) * dk * dv;
  move_state<true>(S, st_s, dk, dv);
  // Conv + SiLU of the head's q | k | v channels; each thread then shifts its own channels' conv state.
  for (int i = tid; i < 2 * dk + dv; i += kThreads) {
    const int c = i < dk ? h * dk + i : i < 2 * dk ? Hd + h * dk + (i - dk) : 2 * Hd + h * dv + (i - 2 * dk);
    float acc = 0.0f;
#pragma unroll 4
    for (int j = 0; j < K; ++j) {
      const float xv = j < P ? a.conv_state[int64_t(j) * C + c] : a.qkv[c];
      acc += a.conv_w[int64_t(c) * K + j] * xv;
    }
    const float y = acc / (1.0f + expf(-acc));
    if (i < dk) q_s[i] = y;
    else if (i < 2 * dk) k_s[i - dk] = y;
    else v_s[i - 2 * dk] = y;
    for (int r = 0; r < P; ++r)
      a.conv_state[int64_t(r) * C + c] = r + 1 < P ? a.conv_state[int64_t(r + 1) * C + c] : a.qkv[c];
  }
  const float rate = expf(a.a_log[h]);
  for (int c = tid; c < dk; c += kThreads) {  // kda_gates
    const float f = a.g[int64_t(h) * dk + c] + a.dt_bias[int64_t(h) * dk + c];
    const float softplus = f > 20.0f ? f : log1pf(expf(f));
    e_s[c] = expf(a.lower_bound_set ? a.lower_bound * sigmoidf(rate * f) : -rate * softplus);
  }
  __syncthreads();
  if (warp < 2) {  // l2norm of q (then the query scale) and k, one warp each
    float* p = warp == 0 ? q_s : k_s;
    float ss = 0.0f;
    for (int i = lane; i < dk; i += 32) ss += p[i] * p[i];
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss + a.l2_eps), scale = warp == 0 ? a.q_scale : 1.0f;
    for (int i = lane; i < dk; i += 32) p[i] = p[i] * inv * scale;
  }
  __syncthreads();
  const float beta = sigmoidf(a.beta[h]);
  for (int j = warp; j < dv; j += kWarps) {  // column j of the state: lane holds rows lane + 32 i
    float s[R];
    float u = 0.0f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      s[i] = st_s[(lane + 32 * i) * ST + j] * e_s[lane + 32 * i];
      u += s[i] * k_s[lane + 32 * i];
    }
    u = warp_sum(u);
    const float delta = beta * (v_s[j] - u);
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      s[i] += k_s[lane + 32 * i] * delta;
      o += s[i] * q_s[lane + 32 * i];
      st_s[(lane + 32 * i) * ST + j] = s[i];
    }
    o = warp_sum(o);
    if (lane == 0) o_s[j] = o;
  }
  __syncthreads();
  move_state<false>(S, st_s, dk, dv);
  if (warp == 0) {  // gated output RMSNorm over the head's dv values
    float ss = 0.0f;
    for (int i = lane; i < dv; i += 32) ss += o_s[i] * o_s[i];
    ss = warp_sum(ss);
    if (lane == 0) inv_o = 1.0f / sqrtf(ss / float(dv) + a.norm_eps);
  }
  __syncthreads();
  for (int j = tid; j < dv; j += kThreads)
    a.out[int64_t(h) * dv + j] = (o_s[j] * inv_o) * a.norm_w[j] * sigmoidf(a.gate[int64_t(h) * dv + j]);
}

template <int R>
void launch_decode(const KdaDecodeArgs& a, cudaStream_t st) {
  const size_t smem = smem_floats(32 * R, a.dv) * sizeof(float);
  reserve_dynamic_smem(kda_decode_kernel<R>, smem, "kda_decode");
  launch(kda_decode_kernel<R>, a.heads, kThreads, smem, st, a);
}

}  // namespace

bool kda_decode_supported(int dk, int dv, int conv_k) {
  return (dk == 32 || dk == 64 || dk == 128) && dv >= 4 && dv % 4 == 0 && conv_k >= 1 &&
         smem_floats(dk, dv) * sizeof(float) <= device_block_smem_limit();  // dk = dv = 128: 69 KB
}

void kda_decode(const KdaDecodeArgs& a, cudaStream_t st) {
  if (!kda_decode_supported(a.dk, a.dv, a.conv_k) || a.heads <= 0)
    throw std::runtime_error("kda_decode: unsupported head dims " + std::to_string(a.dk) + " x " +
                             std::to_string(a.dv));
  switch (a.dk) {
    case 32: launch_decode<1>(a, st); break;
    case 64: launch_decode<2>(a, st); break;
    default: launch_decode<4>(a, st); break;
  }
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
