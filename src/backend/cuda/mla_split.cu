// MLA attention for a few query tokens (decode), split over the keys: each block takes one token, 8 heads and one
// of kSplits key ranges. A key tile (latent rows, shared by every head) is staged once in shared memory for the 8
// heads (attention() re-reads it for every head); each warp owns one head's online softmax; each thread owns two
// value columns of the 8 heads. The blocks leave their partial softmax state (max, sum, unnormalised values) in
// `part`, and a second kernel merges the ranges. Same inputs and result as attention() for a.mla.
#include <cmath>
#include <cstdlib>

#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kSplits = kMlaSplits, kHeads = 8, kKeyTile = 32, kThreads = 256, kCols = 2;  // kThreads = kHeads warps
static_assert(kThreads == kHeads * 32 && kKeyTile == 32, "one warp per head, one lane per key of a tile");

// Key rows are D + 4 floats apart: 16-byte aligned for float4 reads, and 8 lanes of a float4 read hit 32 banks.
int key_stride(int D) { return (D + 3) / 4 * 4 + 4; }
size_t split_smem_bytes(int D) {
  return size_t(kHeads * key_stride(D) + kKeyTile * key_stride(D) + kHeads * kKeyTile + kHeads) * 4;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) mla_split_kernel(AttentionArgs a, float* part) {
  pdl_enter();
  extern __shared__ float smem[];
  __shared__ int key_s[kKeyTile];
  __shared__ float kscale_s[kKeyTile];
  const int s = blockIdx.x, h0 = blockIdx.y * kHeads, split = blockIdx.z, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, D = a.q_dim, R = a.v_dim, KS = (D + 3) / 4 * 4 + 4;  // key_stride
  const int nh = min(kHeads, a.H - h0);
  float* q_s = smem;                        // [kHeads][KS] (zero padded)
  float* k_s = q_s + kHeads * KS;           // [kKeyTile][KS], fp32 (zero padded)
  float* p_s = k_s + kKeyTile * KS;         // [kHeads][kKeyTile] probabilities (times the value scale)
  float* corr_s = p_s + kHeads * kKeyTile;  // [kHeads] rescale of the running values
  const DeviceLayerCache lc = *a.lc;
  const T* kv = static_cast<const T*>(lc.kv);
  const float* scale_t = a.q8 ? lc.kv_scale : nullptr;
  const int pos = *a.pos0 + s;
  const int n_keys = a.selection ? a.sel_k : pos + 1;
  const int per = (n_keys + kSplits - 1) / kSplits, k0 = split * per, k1 = min(n_keys, k0 + per);
  const int32_t* sel = a.selection ? a.selection + int64_t(s) * a.sel_k : nullptr;

  for (int i = tid; i < kHeads * KS; i += kThreads) {
    const int h = i / KS, d = i % KS;
    q_s[i] = h < nh && d < D ? a.q[(int64_t(s) * a.H + h0 + h) * D + d] : 0.0f;
  }
  for (int i = tid; i < kKeyTile * (KS - D); i += kThreads) k_s[(i / (KS - D)) * KS + D + i % (KS - D)] = 0.0f;
  float m = -INFINITY, l = 0.0f;  // warp `warp`'s head: running max and sum (the same in every lane)
  float acc[kHeads][kCols];
#pragma unroll
  for (int h = 0; h < kHeads; ++h)
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[h][c] = 0.0f;

  for (int base = k0; base < k1; base += kKeyTile) {
    __syncthreads();  // the previous tile's k_s / p_s are consumed
    if (tid < kKeyTile) {
      const int idx = base + tid;
      int t = idx < k1 ? (sel ? sel[idx] : idx) : -1;
      if (t > pos) t = -1;
      key_s[tid] = t;
      kscale_s[tid] = t >= 0 && scale_t ? scale_t[t] : 1.0f;
    }
    __syncthreads();
    if (sizeof(T) == 2 && D % 8 == 0) {  // bf16 rows: 16-byte loads of 8 values
      const int per_row = D / 8;
#pragma unroll 4
      for (int i = tid; i < kKeyTile * per_row; i += kThreads) {
        const int row = i / per_row, d = (i % per_row) * 8, t = key_s[row];
        uint4 u = make_uint4(0, 0, 0, 0);
        if (t >= 0) u = *reinterpret_cast<const uint4*>(kv + int64_t(t) * D + d);
        float* o = k_s + row * KS + d;
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          o[2 * j] = __uint_as_float(w[j] << 16);
          o[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
        }
      }
    } else {
      for (int i = tid; i < kKeyTile * D; i += kThreads) {
        const int row = i / D, d = i % D, t = key_s[row];
        k_s[row * KS + d] = t >= 0 ? cache_elem<T>(kv, int64_t(t) * D + d) : 0.0f;
      }
    }
    __syncthreads();
    // Scores: warp = head, lane = key of the tile.
    const int t = key_s[lane];
    float score = -INFINITY;
    if (t >= 0 && warp < nh) {
      const float dot = dot_float4(reinterpret_cast<const float4*>(q_s + warp * KS),
                                   reinterpret_cast<const float4*>(k_s + lane * KS), KS / 4);  // padding is zero
      score = dot * kscale_s[lane] * a.scale;
    }
    const float m_new = fmaxf(m, warp_max(score));
    const float p = score == -INFINITY ? 0.0f : expf(score - m_new);
    const float corr = m == -INFINITY ? 0.0f : expf(m - m_new);
    if (m_new != -INFINITY) {
      l = l * corr + warp_sum(p);
      m = m_new;
    }
    p_s[warp * kKeyTile + lane] = p * (t >= 0 ? kscale_s[lane] : 0.0f);  // MLA values share the key's scale
    if (lane == 0) corr_s[warp] = m_new == -INFINITY ? 1.0f : corr;
    __syncthreads();
    // Values: the first R entries of each key row; thread = columns tid + kThreads * c of every head.
#pragma unroll
    for (int h = 0; h < kHeads; ++h)
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[h][c] *= corr_s[h];
    for (int k = 0; k < kKeyTile; k += 4) {  // each value row read once for the 8 heads
      float v[4][kCols];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          const int j = tid + c * kThreads;
          v[u][c] = j < R ? k_s[(k + u) * KS + j] : 0.0f;
        }
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        const float4 p = *reinterpret_cast<const float4*>(p_s + h * kKeyTile + k);
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[h][c] += p.x * v[0][c] + p.y * v[1][c] + p.z * v[2][c] + p.w * v[3][c];
      }
    }
  }
  // Partial state of each head: [S][H][kSplits][R + 2] = unnormalised values | max | sum.
  for (int h = 0; h < nh; ++h) {
    float* out = part + ((int64_t(s) * a.H + h0 + h) * kSplits + split) * (R + 2);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int j = tid + c * kThreads;
      if (j < R) out[j] = acc[h][c];
    }
  }
  if (lane == 0 && warp < nh) {
    float* out = part + ((int64_t(s) * a.H + h0 + warp) * kSplits + split) * (R + 2);
    out[R] = m;
    out[R + 1] = l;
  }
}

__global__ void mla_split_combine(const float* part, int H, int R, float* out) {
  pdl_enter();
  const int sh = blockIdx.x;  // s * H + h
  const float* p = part + int64_t(sh) * kSplits * (R + 2);
  float M = -INFINITY;
  for (int i = 0; i < kSplits; ++i) M = fmaxf(M, p[i * (R + 2) + R]);
  float L = 0.0f, w[kSplits];
#pragma unroll
  for (int i = 0; i < kSplits; ++i) {
    const float mi = p[i * (R + 2) + R];
    w[i] = mi == -INFINITY ? 0.0f : expf(mi - M);
    L += w[i] * p[i * (R + 2) + R + 1];
  }
  const float inv = L > 0.0f ? 1.0f / L : 0.0f;
  for (int j = threadIdx.x; j < R; j += blockDim.x) {
    float v = 0.0f;
#pragma unroll
    for (int i = 0; i < kSplits; ++i) v += w[i] * p[i * (R + 2) + j];
    out[int64_t(sh) * R + j] = v * inv;
  }
}

template <typename T>
void launch_split(const AttentionArgs& a, float* part, cudaStream_t st) {
  const size_t smem = split_smem_bytes(a.q_dim);
  reserve_dynamic_smem(mla_split_kernel<T>, smem, "mla_split_attention");
  launch(mla_split_kernel<T>, dim3(a.S, (a.H + kHeads - 1) / kHeads, kSplits), kThreads, smem, st, a, part);
}

}  // namespace

bool mla_split_supported(const AttentionArgs& a) {
  return a.mla && a.S >= 1 && a.S <= kMlaSplitMaxTokens && a.v_dim <= kThreads * kCols &&
         a.q_dim <= kMlaSplitMaxKeyWidth && a.v_dim <= a.q_dim;
}

size_t mla_split_floats(int S, int H, int v_dim) { return size_t(S) * size_t(H) * kSplits * size_t(v_dim + 2); }

void mla_split_attention(const AttentionArgs& a, float* part, cudaStream_t st, MlaSplitPath path) {
  if (!mla_split_supported(a)) throw std::runtime_error("mla_split_attention: unsupported shape");
  static const bool tc_off = [] {
    const char* v = std::getenv("MOESRV_MLA_SPLIT_TC");
    return v && std::atoi(v) == 0;
  }();
  if (path == MlaSplitPath::Auto) path = tc_off ? MlaSplitPath::CudaCores : MlaSplitPath::TensorCores;
  if (path == MlaSplitPath::TensorCores && mla_prefill_supported(a)) mla_prefill_split_ranges(a, part, st);
  else if (a.q8) launch_split<int8_t>(a, part, st);
  else launch_split<uint16_t>(a, part, st);
  MOESRV_CUDA_LAUNCH_CHECK();
  launch(mla_split_combine, a.S * a.H, kThreads, 0, st, part, a.H, a.v_dim, a.out);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
