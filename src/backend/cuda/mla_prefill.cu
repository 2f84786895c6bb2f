// MLA attention of a prefill pass on tensor cores: each block takes one query token and 16 heads, stages a tile of
// 64 of the token's keys (latent rows, bf16 cache) once as fp16 in shared memory, and runs both products as
// m16n8k16 MMAs with fp32 accumulation: scores = q · K^T (8 warps, 8 keys each), then, after an online softmax per
// head, O += P · V, the values being the first v_dim columns of the same latent rows (each warp owns v_dim / 8
// value columns of the 16 heads). attention() reads every key row again per head on CUDA cores. q (times the
// softmax scale) enters as two fp16 parts (value and remainder), so the scores are fp32-accurate products of the
// bf16 keys; the probabilities enter the value MMA rounded to fp16 (2^-11 relative).
// Widths: q_dim and v_dim multiples of 8 (q_dim zero padded to 16), v_dim <= 512 and <= q_dim, q_dim <= 640.
// With `part` (decode, mla_split_attention's tensor-core path) block z takes key range z of kMlaSplits and leaves
// its unnormalised values, max and sum per head there (mla_split.cu merges the ranges).
#include <cmath>
#include <stdexcept>
#include <string>

#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kHeads = 16, kKeys = 64, kWarps = 8, kThreads = kWarps * 32, kMaxQDim = 640;
static_assert(kKeys == kWarps * 8, "QK: one n8 tile of keys per warp");

// fp16 rows of the staged q and keys: q_dim rounded up to 16 (zero padded) + 8 halves apart, so the 8 rows x 4 words
// of a fragment load hit 32 banks.
__host__ __device__ constexpr int padded_dim(int q_dim) { return (q_dim + 15) / 16 * 16; }
__host__ __device__ constexpr int row_halves(int q_dim) { return padded_dim(q_dim) + 8; }
constexpr int kProbHalves = kKeys + 8;  // p rows

size_t prefill_smem_bytes(int q_dim) {
  return size_t(2 * kHeads + kKeys) * row_halves(q_dim) * 2 + size_t(kHeads) * kProbHalves * 2 +
         size_t(kHeads) * (kKeys + 1) * 4;
}

// VN: value n8-tiles per warp (warp w owns tiles w, w + 8, ... of the v_dim / 8).
template <int VN>
__global__ void __launch_bounds__(kThreads) mla_prefill_kernel(AttentionArgs a, float* part) {
  pdl_enter();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int D = a.q_dim, D16 = padded_dim(D), RH = row_halves(D), RW = RH / 2;  // RW: 32-bit words per row
  const int NT = a.v_dim / 8;
  half* q_h = reinterpret_cast<half*>(smem_raw);                      // [2][kHeads][RH]: fp16(q), fp16(q - fp16(q))
  half* kv_h = q_h + 2 * kHeads * RH;                                 // [kKeys][RH]
  half* p_h = kv_h + kKeys * RH;                                      // [kHeads][kProbHalves]
  float* s_f = reinterpret_cast<float*>(p_h + kHeads * kProbHalves);  // [kHeads][kKeys + 1]
  __shared__ int key_s[kKeys];
  __shared__ float corr_s[kHeads], l_s[kHeads], m_s[kHeads];

  const int s = blockIdx.x, h0 = blockIdx.y * kHeads, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int pos = *a.pos0 + s;
  const uint16_t* kv = static_cast<const uint16_t*>(a.lc->kv);
  const int n_keys = a.selection ? a.sel_k : pos + 1;
  const int32_t* sel = a.selection ? a.selection + int64_t(s) * a.sel_k : nullptr;
  const int per = part ? (n_keys + kMlaSplits - 1) / kMlaSplits : n_keys;  // this block's keys [k0, k1)
  const int k0 = part ? int(blockIdx.z) * per : 0, k1 = min(n_keys, k0 + per);

  for (int i = tid; i < kHeads * D16; i += kThreads) {
    const int h = i / D16, d = i % D16;
    const float v = h0 + h < a.H && d < D ? a.q[(int64_t(s) * a.H + h0 + h) * D + d] * a.scale : 0.0f;
    const half hi = __float2half_rn(v);
    q_h[h * RH + d] = hi;
    q_h[(kHeads + h) * RH + d] = __float2half_rn(v - __half2float(hi));
  }
  for (int i = tid; i < kKeys * (D16 - D); i += kThreads)  // the keys' padding columns, never gathered
    kv_h[(i / (D16 - D)) * RH + D + i % (D16 - D)] = __float2half_rn(0.0f);
  if (tid < kHeads) l_s[tid] = 0.0f, m_s[tid] = -INFINITY;     // read at the end even when every tile is padding
  float m2[2] = {-INFINITY, -INFINITY}, l2[2] = {0.0f, 0.0f};  // softmax state of heads 2 * warp + j (lane-uniform)
  float o[VN][4];
#pragma unroll
  for (int n = 0; n < VN; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  const uint32_t* qw = reinterpret_cast<const uint32_t*>(q_h);
  const uint32_t* kw = reinterpret_cast<const uint32_t*>(kv_h);
  const uint32_t* pw = reinterpret_cast<const uint32_t*>(p_h);
  const int chunks = D / 8;  // 16-byte pieces of a cache row

  for (int base = k0; base < k1; base += kKeys) {
    __syncthreads();  // the previous tile's kv_h / p_h are consumed (and q_h is written, first time)
    int t = -1;
    if (tid < kKeys) {
      const int idx = base + tid;
      if (idx < k1) t = sel ? sel[idx] : idx;
      if (t > pos) t = -1;
      key_s[tid] = t;
    }
    if (!__syncthreads_or(t >= 0)) continue;  // a tile of padding only
    for (int i = tid; i < kKeys * chunks; i += kThreads) {
      const int r = i / chunks, c = i % chunks, kt = key_s[r];
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (kt >= 0) raw = __ldg(reinterpret_cast<const uint4*>(kv + int64_t(kt) * D) + c);
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      uint32_t hw[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)  // two bf16 -> two fp16
        hw[j] = pack_half2(__float2half_rn(__uint_as_float(w[j] << 16)),
                           __float2half_rn(__uint_as_float(w[j] & 0xFFFF0000u)));
      *reinterpret_cast<uint4*>(kv_h + r * RH + c * 8) = make_uint4(hw[0], hw[1], hw[2], hw[3]);
    }
    __syncthreads();

    // scores of keys 8 * warp .. + 7 for the 16 heads
    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const uint32_t* krow = kw + (8 * warp + g) * RW + t4;
    for (int k0 = 0; k0 < D16; k0 += 16) {
      const int kq = k0 / 2 + t4;
      const uint32_t b0 = krow[k0 / 2], b1 = krow[k0 / 2 + 4];
#pragma unroll
      for (int part = 0; part < 2; ++part) {  // q's fp16 value, then its remainder: ~fp32 scores
        const uint32_t* qp = qw + part * kHeads * RW;
        mma_m16n8k16_f16(sc, qp[g * RW + kq], qp[(g + 8) * RW + kq], qp[g * RW + kq + 4], qp[(g + 8) * RW + kq + 4], b0,
                         b1);
      }
    }
    {
      const int key = 8 * warp + 2 * t4;
      const bool v0 = key_s[key] >= 0, v1 = key_s[key + 1] >= 0;
      s_f[g * (kKeys + 1) + key] = v0 ? sc[0] : -INFINITY;
      s_f[g * (kKeys + 1) + key + 1] = v1 ? sc[1] : -INFINITY;
      s_f[(g + 8) * (kKeys + 1) + key] = v0 ? sc[2] : -INFINITY;
      s_f[(g + 8) * (kKeys + 1) + key + 1] = v1 ? sc[3] : -INFINITY;
    }
    __syncthreads();

    // online softmax: warp w updates heads 2w and 2w + 1 (lanes over keys lane, lane + 32)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int hh = 2 * warp + j;
      const float x0 = s_f[hh * (kKeys + 1) + lane], x1 = s_f[hh * (kKeys + 1) + lane + 32];
      const float m_new = fmaxf(m2[j], warp_max(fmaxf(x0, x1)));
      float p0 = 0.0f, p1 = 0.0f, corr = 1.0f;
      if (m_new != -INFINITY) {
        p0 = x0 == -INFINITY ? 0.0f : expf(x0 - m_new);
        p1 = x1 == -INFINITY ? 0.0f : expf(x1 - m_new);
        corr = m2[j] == -INFINITY ? 0.0f : expf(m2[j] - m_new);
        m2[j] = m_new;
      }
      l2[j] = l2[j] * corr + warp_sum(p0 + p1);
      p_h[hh * kProbHalves + lane] = __float2half_rn(p0);
      p_h[hh * kProbHalves + lane + 32] = __float2half_rn(p1);
      if (lane == 0) corr_s[hh] = corr, l_s[hh] = l2[j], m_s[hh] = m2[j];
    }
    __syncthreads();

    // O[16 heads][warp's columns] = O * corr + P . V
    const float c_lo = corr_s[g], c_hi = corr_s[g + 8];
#pragma unroll
    for (int n = 0; n < VN; ++n) o[n][0] *= c_lo, o[n][1] *= c_lo, o[n][2] *= c_hi, o[n][3] *= c_hi;
    const unsigned short* kvs = reinterpret_cast<const unsigned short*>(kv_h);
#pragma unroll
    for (int k0 = 0; k0 < kKeys; k0 += 16) {
      const int kp = k0 / 2 + t4;
      const uint32_t a0 = pw[g * (kProbHalves / 2) + kp], a1 = pw[(g + 8) * (kProbHalves / 2) + kp];
      const uint32_t a2 = pw[g * (kProbHalves / 2) + kp + 4], a3 = pw[(g + 8) * (kProbHalves / 2) + kp + 4];
      const unsigned short* r0 = kvs + (k0 + 2 * t4) * RH;  // key rows k0 + 2t, +1, +8, +9
#pragma unroll
      for (int n = 0; n < VN; ++n) {
        if (warp + 8 * n >= NT) break;
        const int col = (warp + 8 * n) * 8 + g;
        const uint32_t b0 = uint32_t(r0[col]) | (uint32_t(r0[RH + col]) << 16);
        const uint32_t b1 = uint32_t(r0[8 * RH + col]) | (uint32_t(r0[9 * RH + col]) << 16);
        mma_m16n8k16_f16(o[n], a0, a1, a2, a3, b0, b1);
      }
    }
  }
  __syncthreads();
  const bool lo_ok = h0 + g < a.H, hi_ok = h0 + g + 8 < a.H;
  if (part) {  // [S][H][kMlaSplits][v_dim + 2]: unnormalised values | max | sum
    const int R = a.v_dim;
    auto at = [&](int h) { return part + ((int64_t(s) * a.H + h0 + h) * kMlaSplits + blockIdx.z) * (R + 2); };
#pragma unroll
    for (int n = 0; n < VN; ++n) {
      if (warp + 8 * n >= NT) break;
      const int col = (warp + 8 * n) * 8 + 2 * t4;
      if (lo_ok) *reinterpret_cast<float2*>(at(g) + col) = make_float2(o[n][0], o[n][1]);
      if (hi_ok) *reinterpret_cast<float2*>(at(g + 8) + col) = make_float2(o[n][2], o[n][3]);
    }
    if (tid < kHeads && h0 + tid < a.H) at(tid)[R] = m_s[tid], at(tid)[R + 1] = l_s[tid];
    return;
  }
  const float inv_lo = l_s[g] > 0.0f ? 1.0f / l_s[g] : 0.0f, inv_hi = l_s[g + 8] > 0.0f ? 1.0f / l_s[g + 8] : 0.0f;
  float* out_lo = a.out + (int64_t(s) * a.H + h0 + g) * a.v_dim;
  float* out_hi = out_lo + int64_t(8) * a.v_dim;
#pragma unroll
  for (int n = 0; n < VN; ++n) {
    if (warp + 8 * n >= NT) break;
    const int col = (warp + 8 * n) * 8 + 2 * t4;
    if (lo_ok) *reinterpret_cast<float2*>(out_lo + col) = make_float2(o[n][0] * inv_lo, o[n][1] * inv_lo);
    if (hi_ok) *reinterpret_cast<float2*>(out_hi + col) = make_float2(o[n][2] * inv_hi, o[n][3] * inv_hi);
  }
}

template <int VN>
void launch_prefill(const AttentionArgs& a, float* part, cudaStream_t st) {
  const size_t smem = prefill_smem_bytes(a.q_dim);
  reserve_dynamic_smem(mla_prefill_kernel<VN>, smem, "mla_prefill_attention");
  launch(mla_prefill_kernel<VN>, dim3(unsigned(a.S), unsigned(ceil_div(a.H, kHeads)), part ? kMlaSplits : 1), kThreads,
         smem, st, a, part);
}

void launch_any(const AttentionArgs& a, float* part, cudaStream_t st) {
  switch ((a.v_dim / 8 + 7) / 8) {
    case 1: launch_prefill<1>(a, part, st); break;
    case 2: launch_prefill<2>(a, part, st); break;
    case 3: launch_prefill<3>(a, part, st); break;
    case 4: launch_prefill<4>(a, part, st); break;
    case 5: launch_prefill<5>(a, part, st); break;
    case 6: launch_prefill<6>(a, part, st); break;
    case 7: launch_prefill<7>(a, part, st); break;
    default: launch_prefill<8>(a, part, st); break;
  }
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool mla_prefill_supported(const AttentionArgs& a) {
  return a.mla && !a.q8 && a.q_dim % 8 == 0 && a.q_dim <= kMaxQDim && a.v_dim % 8 == 0 && a.v_dim <= 512 &&
         a.v_dim <= a.q_dim;
}

void mla_prefill_attention(const AttentionArgs& a, cudaStream_t st) {
  if (!mla_prefill_supported(a)) throw std::runtime_error("mla_prefill_attention: unsupported shape");
  if (a.S <= 0) return;
  launch_any(a, nullptr, st);
}

void mla_prefill_split_ranges(const AttentionArgs& a, float* part, cudaStream_t st) {
  if (!mla_prefill_supported(a)) throw std::runtime_error("mla_prefill_split_ranges: unsupported shape");
  if (a.S > 0) launch_any(a, part, st);
}

}  // namespace moesrv::cuda
