// Attention kernels: absorbed MLA query/output projections and one causal attention kernel (online softmax
// over key tiles) serving MLA latent caches, GQA caches and DSA-selected keys, bf16 or int8 caches.
#include <cmath>

#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32, kTile = 64, kMaxValuesPerThread = 4;

// Block (token * H + head, block of 2 * kQueryPairs columns): thread (group g, pair) sums columns j, j + 1 over the
// g-th quarter of the nope dims (one 4-byte load carries both), the quarters then added in order; the rope part copied
// by the first column block. Four groups keep ~32 KB of loads in flight per SM (one group per column: ~4 KB).
constexpr int kQueryPairs = 128, kQueryGroups = 4;
__global__ void __launch_bounds__(kQueryPairs* kQueryGroups)
    mla_query_kernel(const float* q, const uint16_t* w_uk, int H, int dn, int dr, int r, float* qcat) {
  pdl_enter();
  extern __shared__ float qn[];  // dn
  __shared__ float part[kQueryGroups - 1][2 * kQueryPairs];
  const int s = blockIdx.x / H, h = blockIdx.x % H, qk = dn + dr, tid = threadIdx.x;
  const int pair = tid % kQueryPairs, g = tid / kQueryPairs, j = 2 * (blockIdx.y * kQueryPairs + pair);
  const float* qh = q + (int64_t(s) * H + h) * qk;
  float* out = qcat + (int64_t(s) * H + h) * (r + dr);
  for (int d = tid; d < dn; d += blockDim.x) qn[d] = qh[d];
  if (blockIdx.y == 0)
    for (int i = tid; i < dr; i += blockDim.x) out[r + i] = qh[dn + i];
  __syncthreads();
  const int d0 = g * dn / kQueryGroups, d1 = (g + 1) * dn / kQueryGroups;
  float a0 = 0.0f, a1 = 0.0f;
  const uint16_t* w = w_uk + int64_t(h) * dn * r + j;
  if (j + 1 < r && r % 2 == 0) {
#pragma unroll 16
    for (int d = d0; d < d1; ++d) {
      const uint32_t v = __ldg(reinterpret_cast<const unsigned int*>(w + int64_t(d) * r));
      a0 += qn[d] * bf16_to_f32(uint16_t(v & 0xffffu));
      a1 += qn[d] * bf16_to_f32(uint16_t(v >> 16));
    }
  } else if (j < r) {
    for (int d = d0; d < d1; ++d) {
      a0 += qn[d] * bf16_to_f32(w[int64_t(d) * r]);
      if (j + 1 < r) a1 += qn[d] * bf16_to_f32(w[int64_t(d) * r + 1]);
    }
  }
  if (g > 0) part[g - 1][2 * pair] = a0, part[g - 1][2 * pair + 1] = a1;
  __syncthreads();
  if (g > 0 || j >= r) return;
  for (int i = 0; i < kQueryGroups - 1; ++i) a0 += part[i][2 * pair], a1 += part[i][2 * pair + 1];
  out[j] = a0;
  if (j + 1 < r) out[j + 1] = a1;
}

// Block (token * H + head, group of 32 output rows): warp per row.
constexpr int kOutputRows = 32;
__global__ void mla_output_kernel(const float* o_lat, const uint16_t* w_uv, int H, int dv, int r, float* out) {
  pdl_enter();
  const int s = blockIdx.x / H, h = blockIdx.x % H, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* x = o_lat + (int64_t(s) * H + h) * r;
  const int i1 = min(dv, int(blockIdx.y + 1) * kOutputRows);
  for (int i = blockIdx.y * kOutputRows + warp; i < i1; i += blockDim.x >> 5) {
    float v = warp_dot_bf16(w_uv + (int64_t(h) * dv + i) * r, x, r);
    if (lane == 0) out[(int64_t(s) * H + h) * dv + i] = v;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) attention_kernel(AttentionArgs a) {
  pdl_enter();
  extern __shared__ float q_s[];  // q_dim
  __shared__ float p_s[kTile];
  __shared__ int key_s[kTile];
  const int s = blockIdx.x / a.H, h = blockIdx.x % a.H, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int pos = *a.pos0 + s;
  const DeviceLayerCache lc = *a.lc;
  const float* qrow = a.q + (int64_t(s) * a.H + h) * a.q_dim;
  for (int i = tid; i < a.q_dim; i += kThreads) q_s[i] = qrow[i];

  const int group = a.mla ? a.H : a.H / a.kv_heads, kvh = h / group;
  const int64_t k_stride = a.mla ? a.q_dim : int64_t(a.kv_heads) * a.q_dim;
  const int64_t v_stride = a.mla ? a.q_dim : int64_t(a.kv_heads) * a.v_dim;
  const T* kbase = static_cast<const T*>(lc.kv) + (a.mla ? 0 : int64_t(kvh) * a.q_dim);
  const T* vbase = a.mla ? static_cast<const T*>(lc.kv) : static_cast<const T*>(lc.v) + int64_t(kvh) * a.v_dim;
  const float* kscale = a.q8 ? lc.kv_scale : nullptr;
  const float* vscale = a.q8 ? (a.mla ? lc.kv_scale : lc.v_scale) : nullptr;

  float acc[kMaxValuesPerThread] = {0.0f, 0.0f, 0.0f, 0.0f};
  float m = -INFINITY, l = 0.0f;
  const int n_keys = a.selection ? a.sel_k : pos + 1;
  const int32_t* sel = a.selection ? a.selection + int64_t(s) * a.sel_k : nullptr;
  __syncthreads();
  for (int base = 0; base < n_keys; base += kTile) {
    for (int i = warp; i < kTile; i += kWarps) {
      const int idx = base + i;
      int t = -1;
      if (idx < n_keys) t = sel ? sel[idx] : idx;
      if (t > pos) t = -1;
      float score = -INFINITY;
      if (t >= 0) {
        const T* kr = kbase + int64_t(t) * k_stride;
        float d = 0.0f;
        for (int j = lane; j < a.q_dim; j += 32) d += q_s[j] * cache_elem<T>(kr, j);
        d = warp_sum(d);
        score = d * (kscale ? kscale[t] : 1.0f) * a.scale;
      }
      if (lane == 0) {
        p_s[i] = score;
        key_s[i] = t;
      }
    }
    __syncthreads();
    float tmax = -INFINITY;
    for (int i = 0; i < kTile; ++i) tmax = fmaxf(tmax, p_s[i]);
    const float m_new = fmaxf(m, tmax);
    __syncthreads();
    if (m_new == -INFINITY) continue;  // uniform across the block
    if (tid < kTile) p_s[tid] = p_s[tid] == -INFINITY ? 0.0f : expf(p_s[tid] - m_new);
    __syncthreads();
    const float corr = m == -INFINITY ? 0.0f : expf(m - m_new);
    float psum = 0.0f;
    for (int i = 0; i < kTile; ++i) psum += p_s[i];
    l = l * corr + psum;
    m = m_new;
#pragma unroll
    for (int c = 0; c < kMaxValuesPerThread; ++c) {
      const int j = tid + c * kThreads;
      if (j >= a.v_dim) break;
      float v = acc[c] * corr;
      for (int i = 0; i < kTile; ++i) {
        const int t = key_s[i];
        if (t < 0) continue;
        const float p = p_s[i] * (vscale ? vscale[t] : 1.0f);
        v += p * cache_elem<T>(vbase + int64_t(t) * v_stride, j);
      }
      acc[c] = v;
    }
    __syncthreads();
  }
  float* out = a.out + (int64_t(s) * a.H + h) * a.v_dim;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
  for (int c = 0; c < kMaxValuesPerThread; ++c) {
    const int j = tid + c * kThreads;
    if (j < a.v_dim) out[j] = acc[c] * inv;
  }
}

}  // namespace

void mla_query(const float* q, const uint16_t* w_uk, int S, int H, int dn, int dr, int r, float* qcat, cudaStream_t st) {
  if (S <= 0) return;
  launch(mla_query_kernel, dim3(unsigned(S * H), unsigned(ceil_div(r, 2 * kQueryPairs))), kQueryPairs * kQueryGroups,
         size_t(dn) * sizeof(float), st, q, w_uk, H, dn, dr, r, qcat);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void mla_output(const float* o_lat, const uint16_t* w_uv, int S, int H, int dv, int r, float* out, cudaStream_t st) {
  if (S <= 0) return;
  launch(mla_output_kernel, dim3(unsigned(S * H), unsigned(ceil_div(dv, kOutputRows))), 256, 0, st, o_lat, w_uv, H, dv,
         r, out);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void attention(const AttentionArgs& a, cudaStream_t st) {
  if (a.v_dim > kThreads * kMaxValuesPerThread) throw std::runtime_error("attention: value width " + std::to_string(a.v_dim) + " is too large");
  const size_t smem = size_t(a.q_dim) * sizeof(float);
  if (a.q8) launch(attention_kernel<int8_t>, a.S * a.H, kThreads, smem, st, a);
  else launch(attention_kernel<uint16_t>, a.S * a.H, kThreads, smem, st, a);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
