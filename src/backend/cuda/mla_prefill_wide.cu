// MLA prefill attention, wide form (mla_prefill.cu picks it; kernels.h: mla_prefill_attention): one block per query
// token and 64 heads, so each gathered key tile is staged once for all of a token's heads (the 16-head forms of
// mla_prefill.cu stage it 2-4 times), 8 warps: warp w takes heads 16 (w % 4) .. + 15 and half w / 4 of the dims.
// Scores: each warp multiplies its half of q's dims (q x scale as fp16 value + remainder, both from shared memory:
// ~fp32 scores of the bf16 keys) with the tile's 32 keys; the two halves' partial scores meet through shared memory
// (a barrier per warp pair) and both warps of a pair sum them alike (a + b == b + a), so they run the same online
// softmax and hold the same probabilities, as fp16 A fragments in registers (no shared memory), for O += P . V over
// their half of the value dims (B fragments by ldmatrix.trans). The next tile's bf16 rows arrive by cp.async while
// this one is multiplied and are converted to fp16 in place. ~213 KB of shared memory at q_dim 512: H100 / H200 only,
// q_dim <= 512 (GLM-5.3-Flash's NoPE latent), v_dim / 16 in {2, 4, 8, 16, 32}.
#include <cmath>
#include <stdexcept>

#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/mla_tile.cuh"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kHeads = 64, kKeys = 32, kWarps = 8, kThreads = kWarps * 32, kMaxDim = 512;
constexpr int kExRow = kKeys + 4;  // partial score rows (floats): conflict-free float2 stores

using mla_tile::padded_dim, mla_tile::row_halves;

size_t wide_smem_bytes(int q_dim) {
  return size_t(2 * kHeads + 2 * kKeys) * row_halves(q_dim) * 2 + size_t(kWarps) * 16 * kExRow * 4;
}

// VT: value n8-tiles per warp (v_dim / 16). QLO: the scores also multiply q's fp16 remainder (~fp32 scores; the
// default). Without it (MOESRV_MLA_Q_SPLIT=0, opt-in) q is one fp16 value, as precise as the fp16 probabilities.
template <int VT, bool QLO>
__global__ void __launch_bounds__(kThreads, 1) mla_prefill_wide_kernel(AttentionArgs a) {
  pdl_enter();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int D = a.q_dim, D16 = padded_dim(D), RH = row_halves(D), chunks = D / 8;
  half* qs = reinterpret_cast<half*>(smem_raw);               // [2][kHeads][RH]: q x scale, fp16 value | remainder
  half* kv = qs + 2 * kHeads * RH;                            // [2][kKeys][RH]: key tiles (bf16 landing, fp16 in use)
  float* ex = reinterpret_cast<float*>(kv + 2 * kKeys * RH);  // [kWarps][16][kExRow]: partial scores
  __shared__ int key_buf[2][kKeys];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, hg = warp & 3, hv = warp >> 2;
  const int g = lane >> 2, t4 = lane & 3;
  const mla_tile::QueryKeys qk = mla_tile::QueryKeys::of<kHeads>(a);
  const int s = qk.s, h0 = qk.h0, pos = qk.pos, n_keys = qk.n_keys;
  const int32_t* sel = qk.sel;
  const uint16_t* cache = qk.cache;

  // keys [base, base + kKeys) and their rows into buffer buf (bf16, converted in place once they land)
  auto prefetch = [&](int base, int buf) {
    mla_tile::gather_keys<kKeys, kThreads>(key_buf[buf], kv + buf * kKeys * RH, RH, cache, D, sel, base, n_keys, pos);
  };
  if (n_keys > 0) prefetch(0, 0);

  // q x scale (zero for heads past H and the padding dims), and the key tiles' padding dims (never copied)
  for (int i = tid; i < kHeads * (D16 / 2); i += kThreads) {
    const int h = i / (D16 / 2), d = 2 * (i - h * (D16 / 2));
    float2 v = make_float2(0.0f, 0.0f);
    if (h0 + h < a.H && d < D) {  // d even, D a multiple of 8: d + 1 < D too
      v = *reinterpret_cast<const float2*>(a.q + (int64_t(s) * a.H + h0 + h) * D + d);
      v.x *= a.scale, v.y *= a.scale;
    }
    uint32_t hi, lo;
    split_half2(v.x, v.y, hi, lo);
    *reinterpret_cast<uint32_t*>(qs + h * RH + d) = hi;
    *reinterpret_cast<uint32_t*>(qs + (kHeads + h) * RH + d) = lo;
  }
  for (int i = tid; i < 2 * kKeys * (D16 - D); i += kThreads)
    kv[(i / (D16 - D)) * RH + D + i % (D16 - D)] = __float2half_rn(0.0f);

  // this warp's k-steps (16 dims) of the scores: [kb, ke)
  const int steps = D16 / 16, half_steps = (steps + 1) / 2, kb = hv * half_steps, ke = min(steps, kb + half_steps);
  const half* q_hi = qs + (16 * hg + (lane & 15)) * RH + (lane >> 4) * 8;  // A fragments (ldmatrix_x4)
  const half* q_lo = q_hi + kHeads * RH;
  const int krow = (lane & 7) + 8 * (lane >> 4), kcol = 8 * ((lane >> 3) & 1);                // B of two key n-tiles
  const int vrow = (lane & 7) + 8 * ((lane >> 3) & 1), vcol = hv * VT * 8 + 8 * (lane >> 4);  // B of two value tiles
  float* ex_mine = ex + warp * 16 * kExRow;
  const float* ex_pair = ex + (warp ^ 4) * 16 * kExRow;

  float o[VT][4];
#pragma unroll
  for (int n = 0; n < VT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};  // rows g, g + 8; l: this thread's keys only

  for (int base = 0, it = 0; base < n_keys; base += kKeys, ++it) {
    const int buf = it & 1;
    half* tile = kv + buf * kKeys * RH;
    asm volatile("cp.async.wait_all;\n" ::);
    for (int i = tid; i < kKeys * chunks; i += kThreads) {  // the chunks this thread copied: bf16 -> fp16 in place
      const int r = i / chunks, c = i - r * chunks;
      uint4* p = reinterpret_cast<uint4*>(tile + r * RH + c * 8);
      *p = bf16x8_to_half(*p);
    }
    // (a barrier: the tile is fp16 for every warp; every warp is done with the previous tile and its buffer)
    const bool any = __syncthreads_or(tid < kKeys && key_buf[buf][tid] >= 0);
    if (base + kKeys < n_keys) prefetch(base + kKeys, buf ^ 1);
    if (!any) continue;  // a tile of padding only

    // partial scores of the warp's 16 heads x 32 keys over its dims
    float sc[4][4] = {};
    const half* kr = tile + krow * RH + kcol;
#pragma unroll 2
    for (int ks = kb; ks < ke; ++ks) {
      uint32_t ah[4], al[4], b[2][4];
      ldmatrix_x4(q_hi + 16 * ks, ah[0], ah[1], ah[2], ah[3]);
      if constexpr (QLO) ldmatrix_x4(q_lo + 16 * ks, al[0], al[1], al[2], al[3]);
      ldmatrix_x4(kr + 16 * ks, b[0][0], b[0][1], b[0][2], b[0][3]);
      ldmatrix_x4(kr + 16 * RH + 16 * ks, b[1][0], b[1][1], b[1][2], b[1][3]);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        mma_m16n8k16_f16(sc[2 * np], ah[0], ah[1], ah[2], ah[3], b[np][0], b[np][1]);
        mma_m16n8k16_f16(sc[2 * np + 1], ah[0], ah[1], ah[2], ah[3], b[np][2], b[np][3]);
      }
      if constexpr (QLO) {
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          mma_m16n8k16_f16(sc[2 * np], al[0], al[1], al[2], al[3], b[np][0], b[np][1]);
          mma_m16n8k16_f16(sc[2 * np + 1], al[0], al[1], al[2], al[3], b[np][2], b[np][3]);
        }
      }
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      *reinterpret_cast<float2*>(ex_mine + g * kExRow + 8 * n + 2 * t4) = make_float2(sc[n][0], sc[n][1]);
      *reinterpret_cast<float2*>(ex_mine + (g + 8) * kExRow + 8 * n + 2 * t4) = make_float2(sc[n][2], sc[n][3]);
    }
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + hg), "r"(64) : "memory");  // the pair's partial scores are stored
    const int* keys = key_buf[buf];
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const float2 lo = *reinterpret_cast<const float2*>(ex_pair + g * kExRow + 8 * n + 2 * t4);
      const float2 hi = *reinterpret_cast<const float2*>(ex_pair + (g + 8) * kExRow + 8 * n + 2 * t4);
      sc[n][0] += lo.x, sc[n][1] += lo.y, sc[n][2] += hi.x, sc[n][3] += hi.y;
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (keys[8 * n + 2 * t4 + j] < 0) sc[n][j] = sc[n][2 + j] = -INFINITY;
      mx[0] = fmaxf(mx[0], fmaxf(sc[n][0], sc[n][1]));
      mx[1] = fmaxf(mx[1], fmaxf(sc[n][2], sc[n][3]));
    }
    float corr[2];
    mla_tile::online_max(mx, m_r, corr);  // (mx: the max the probabilities use)
    uint32_t pa[2][4];  // P as A fragments of the two 16-key steps
    float ps[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      float p[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float m = mx[j >> 1];
        p[j] = sc[n][j] == -INFINITY ? 0.0f : expf(sc[n][j] - m);
      }
      ps[0] += p[0] + p[1], ps[1] += p[2] + p[3];
      // n-tile n = keys 8n..: step n / 2, a0/a1 (n even) or a2/a3 (n odd)
      pa[n >> 1][2 * (n & 1)] = pack_half2(__float2half_rn(p[0]), __float2half_rn(p[1]));
      pa[n >> 1][2 * (n & 1) + 1] = pack_half2(__float2half_rn(p[2]), __float2half_rn(p[3]));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_r[r] = l_r[r] * corr[r] + ps[r];
#pragma unroll
    for (int n = 0; n < VT; ++n) o[n][0] *= corr[0], o[n][1] *= corr[0], o[n][2] *= corr[1], o[n][3] *= corr[1];

    // O[16 heads][this half's value dims] += P . V
    const half* vb = tile + vrow * RH + vcol;
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
      for (int np = 0; np < VT / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4_trans(vb + 16 * kk * RH + 16 * np, b[0], b[1], b[2], b[3]);
        mma_m16n8k16_f16(o[2 * np], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[0], b[1]);
        mma_m16n8k16_f16(o[2 * np + 1], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[2], b[3]);
      }
    }
  }

  float inv[2];
  mla_tile::row_inverses(l_r, inv);
  const float inv_lo = inv[0], inv_hi = inv[1];
  const int h_lo = h0 + 16 * hg + g, h_hi = h_lo + 8;
  float* out_lo = a.out + (int64_t(s) * a.H + h_lo) * a.v_dim + vcol - 8 * (lane >> 4) + 2 * t4;
  float* out_hi = out_lo + int64_t(8) * a.v_dim;
#pragma unroll
  for (int n = 0; n < VT; ++n) {
    if (h_lo < a.H) *reinterpret_cast<float2*>(out_lo + 8 * n) = make_float2(o[n][0] * inv_lo, o[n][1] * inv_lo);
    if (h_hi < a.H) *reinterpret_cast<float2*>(out_hi + 8 * n) = make_float2(o[n][2] * inv_hi, o[n][3] * inv_hi);
  }
}

template <int VT, bool QLO>
void launch_wide_q(const AttentionArgs& a, cudaStream_t st) {
  const size_t smem = wide_smem_bytes(a.q_dim);
  reserve_dynamic_smem(mla_prefill_wide_kernel<VT, QLO>, smem, "mla_prefill_wide");
  launch(mla_prefill_wide_kernel<VT, QLO>, dim3(unsigned(a.S * ((a.H + kHeads - 1) / kHeads))), kThreads, smem, st, a);
}

template <int VT>
void launch_wide(const AttentionArgs& a, cudaStream_t st) {
  static const bool q_split = env_choice("MOESRV_MLA_Q_SPLIT", 0, 1, 1) != 0;
  if (q_split) launch_wide_q<VT, true>(a, st);
  else launch_wide_q<VT, false>(a, st);
}

}  // namespace

bool mla_prefill_wide_supported(const AttentionArgs& a) {
  const int vt = a.v_dim / 16;
  return a.mla && !a.q8 && a.q_dim % 8 == 0 && a.q_dim <= kMaxDim && a.v_dim % 16 == 0 && a.v_dim <= a.q_dim &&
         (vt == 2 || vt == 4 || vt == 8 || vt == 16 || vt == 32) &&
         wide_smem_bytes(a.q_dim) + 256 <= device_block_smem_limit();
}

void mla_prefill_wide(const AttentionArgs& a, cudaStream_t st) {
  if (!mla_prefill_wide_supported(a)) throw std::runtime_error("mla_prefill_wide: unsupported shape or device");
  if (a.S <= 0) return;
  switch (a.v_dim / 16) {
    case 2: launch_wide<2>(a, st); break;
    case 4: launch_wide<4>(a, st); break;
    case 8: launch_wide<8>(a, st); break;
    case 16: launch_wide<16>(a, st); break;
    default: launch_wide<32>(a, st); break;
  }
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
