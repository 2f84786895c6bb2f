// MLA attention of a prefill pass on tensor cores: each block takes one query token and 16 heads, stages a tile of
// 64 of the token's keys (latent rows, bf16 cache) once as fp16 in shared memory, and runs both products as
// m16n8k16 MMAs with fp32 accumulation. Scores = q · K^T with the key width split over the 8 warps (warp w holds its
// dims of the 16 heads' q as A fragments in registers for the whole pass and multiplies them with all 64 keys; the
// 8 partial sums meet in shared memory, warps 4-7 adding into 0-3); then, after an online softmax per head, O += P · V,
// the values being the first v_dim columns of the same latent rows (each warp owns v_dim / 8 value columns of the 16
// heads, its B fragments by ldmatrix.trans). attention() reads every key row again per head on CUDA cores. q (times the
// softmax scale) enters as two fp16 parts (value and remainder), so the scores are fp32-accurate products of the
// bf16 keys; the probabilities enter the value MMA rounded to fp16 (2^-11 relative).
// (The first form kept q in shared memory and gave each warp 8 keys over the whole width: every warp re-read all
// of q per tile, and shared-memory traffic bound it; issue 20, docs/perf-cuda.md.)
// Widths: q_dim and v_dim multiples of 8 (q_dim zero padded to 16), v_dim <= 512 and <= q_dim, q_dim <= 640.
// With `part` (decode, mla_split_attention's tensor-core path) block z takes key range z of kMlaSplits and leaves
// its unnormalised values, max and sum per head there (mla_split.cu merges the ranges).
// Prefill on a device with room for it (~187 KB per block: H100 / H200, not a 99 KB RTX 3090 / 4090) runs the
// two-group form: 16 warps, two groups of 16 heads sharing each staged key tile (half the gathers and conversions per
// head), and the next tile's bf16 rows gathered by cp.async into a second buffer while this tile is multiplied; a
// q_dim <= 512 with more than 32 heads runs the wide form (mla_prefill_wide.cu: 64 heads per staged tile), and
// q_dim == v_dim == 512 on an sm_90a build the warpgroup-MMA form (mla_prefill_wgmma.cu; MOESRV_MLA_WGMMA=0: not).
// MOESRV_MLA_PREFILL_GROUPS=1 / 2 caps prefill at one / two groups (decode's ranges run the one-group form).
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/mla_tile.cuh"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kHeads = 16, kKeys = 64, kWarps = 8, kThreads = kWarps * 32, kMaxQDim = 640;
constexpr int kKeyTiles = kKeys / 8;  // n8 tiles of keys in the score MMAs
constexpr int kStageLoads = 4;        // 16-byte key loads a thread has in flight while staging a tile
constexpr int kMaxWarpSteps = (kMaxQDim / 16 + kWarps - 1) / kWarps;  // 16-dim steps of q per warp (5)
static_assert(kKeys == kWarps * 8, "softmax: each warp updates 2 of the 16 heads over 64 keys (2 per lane)");

using mla_tile::padded_dim, mla_tile::row_halves;
constexpr int kProbHalves = kKeys + 8;  // p rows
constexpr int kPartRow = kKeys + 8;     // partial score rows (floats): conflict-free float2 stores
constexpr int kParts = kWarps / 2;      // partial score slots: warps w and w + 4 share slot w

constexpr size_t kStaticSmemBytes = 1024;  // the kernel's __shared__ arrays (448 B; two groups, prefetch: 896 B)
// G: head groups of 16 per block (8 warps each); PF: the next tile's raw bf16 rows prefetched into a second buffer.
size_t prefill_smem_bytes(int q_dim, int G = 1, bool PF = false) {
  return size_t(kKeys) * row_halves(q_dim) * 2 + (PF ? size_t(kKeys) * q_dim * 2 : 0) +
         size_t(G) * (size_t(kHeads) * kProbHalves * 2 + size_t(kParts) * kHeads * kPartRow * 4);
}

// VN: value n8-tiles per warp (warp w owns tiles w, w + 8, ... of the v_dim / 8); WS: the most 16-dim steps of q a
// warp holds (4: q_dim <= 512, registers for 2 blocks per SM without spills; 5: q_dim <= 640). G, PF: as
// prefill_smem_bytes (G * 8 warps; warp w serves head group w / 8 as warp w % 8 of the one-group form).
template <int VN, int WS, int G, bool PF>
__global__ void __launch_bounds__(G* kThreads, 2 / G) mla_prefill_kernel(AttentionArgs a, float* part) {
  pdl_enter();
  static_assert(G == 1 || G == 2, "one or two head groups per block");
  constexpr int NTH = G * kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int D = a.q_dim, D16 = padded_dim(D), RH = row_halves(D), RW = RH / 2;  // RW: 32-bit words per row
  const int NT = a.v_dim / 8;
  const int tid = threadIdx.x, group = tid / kThreads, warp = (tid >> 5) % kWarps, lane = tid & 31;
  half* kv_h = reinterpret_cast<half*>(smem_raw);                     // [kKeys][RH]
  uint16_t* raw = reinterpret_cast<uint16_t*>(kv_h + kKeys * RH);     // PF: [kKeys][D] the next tile, bf16
  half* p_h = reinterpret_cast<half*>(raw + (PF ? kKeys * D : 0)) + group * kHeads * kProbHalves;  // [kHeads][...]
  float* red =
      reinterpret_cast<float*>(reinterpret_cast<half*>(raw + (PF ? kKeys * D : 0)) + G * kHeads * kProbHalves) +
      group * kParts * kHeads * kPartRow;  // [kParts][kHeads][kPartRow]
  __shared__ int key_buf[PF ? 2 : 1][kKeys];
  __shared__ float corr_g[G * kHeads], l_g[G * kHeads], m_g[G * kHeads];
  float *corr_s = corr_g + group * kHeads, *l_s = l_g + group * kHeads, *m_s = m_g + group * kHeads;

  // Block x = (query s, head block): a query's head blocks are neighbours in launch order, so they run at about the
  // same time and share the gathered key rows through L2 (with the query fastest, each block gathered them from HBM).
  const int blocks = (a.H + G * kHeads - 1) / (G * kHeads), split = int(blockIdx.y);
  const int s = int(blockIdx.x) / blocks, h0 = (int(blockIdx.x) % blocks) * G * kHeads + group * kHeads;
  const int g = lane >> 2, t4 = lane & 3;
  const int pos = *a.pos0 + s;
  const uint16_t* kv = static_cast<const uint16_t*>(a.lc->kv);
  const int n_keys = a.selection ? a.sel_k : pos + 1;
  const int32_t* sel = a.selection ? a.selection + int64_t(s) * a.sel_k : nullptr;
  const int per = part ? (n_keys + kMlaSplits - 1) / kMlaSplits : n_keys;  // this block's keys [k0, k1)
  const int k0 = part ? split * per : 0, k1 = min(n_keys, k0 + per);

  // this warp's 16-dim steps [ks0, ks0 + nks) of q (x scale) as A fragments, fp16 value [0] and remainder [1]
  const int steps = D16 / 16, wsteps = (steps + kWarps - 1) / kWarps, ks0 = min(steps, warp * wsteps);
  const int nks = min(steps, ks0 + wsteps) - ks0;
  uint32_t qa[WS][2][4];
#pragma unroll
  for (int i = 0; i < WS; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // a0..a3: rows g, g + 8, g, g + 8; columns 2t, 2t, 2t + 8, 2t + 8 of the step
      const int h = h0 + g + 8 * (r & 1), d = 16 * (ks0 + i) + 2 * t4 + 8 * (r >> 1);
      float2 v = make_float2(0.0f, 0.0f);
      if (i < nks && h < a.H && d < D) {  // d even, D a multiple of 8: d + 1 < D too
        v = *reinterpret_cast<const float2*>(a.q + (int64_t(s) * a.H + h) * D + d);
        v.x *= a.scale, v.y *= a.scale;
      }
      split_half2(v.x, v.y, qa[i][0][r], qa[i][1][r]);
    }
  for (int i = tid; i < kKeys * (D16 - D); i += NTH)  // the keys' padding columns, never gathered
    kv_h[(i / (D16 - D)) * RH + D + i % (D16 - D)] = __float2half_rn(0.0f);
  if (tid < G * kHeads) l_g[tid] = 0.0f, m_g[tid] = -INFINITY;  // read at the end even when every tile is padding
  float m2[2] = {-INFINITY, -INFINITY}, l2[2] = {0.0f, 0.0f};  // softmax state of heads 2 * warp + j (lane-uniform)
  float o[VN][4];
#pragma unroll
  for (int n = 0; n < VN; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  const uint32_t* kw = reinterpret_cast<const uint32_t*>(kv_h);
  const uint32_t* pw = reinterpret_cast<const uint32_t*>(p_h);
  const int chunks = D / 8;  // 16-byte pieces of a cache row

  // key t of the tile at `base` (-1: padding, past the range or after the token)
  auto key_at = [&](int base, int r) { return mla_tile::key_at(sel, base + r, k1, pos); };
  auto prefetch = [&](int base, int buf) {
    mla_tile::gather_keys<kKeys, NTH>(key_buf[buf], raw, D, kv, D, sel, base, k1, pos);
  };
  if constexpr (PF)
    if (k0 < k1) prefetch(k0, 0);

  for (int base = k0, it = 0; base < k1; base += kKeys, ++it) {
    const int* key_s = key_buf[PF ? it & 1 : 0];
    if constexpr (PF) {
      asm volatile("cp.async.wait_all;\n" ::);
      // (a barrier: this tile's rows landed; the previous tile's kv_h / p_h / red are consumed)
      const bool any = __syncthreads_or(tid < kKeys && key_s[tid] >= 0);
      if (any)
        for (int i = tid; i < kKeys * chunks; i += NTH) {
          const int r = i / chunks, c = i - r * chunks;
          *reinterpret_cast<uint4*>(kv_h + r * RH + c * 8) =
              bf16x8_to_half(*reinterpret_cast<const uint4*>(raw + r * D + c * 8));
        }
      __syncthreads();  // kv_h holds the tile; raw is free for the next one
      if (base + kKeys < k1) prefetch(base + kKeys, (it + 1) & 1);
      if (!any) continue;  // a tile of padding only
    } else {
      __syncthreads();  // the previous tile's kv_h / p_h / red are consumed
      const int t = tid < kKeys ? key_at(base, tid) : -1;
      if (tid < kKeys) key_buf[0][tid] = t;
      if (!__syncthreads_or(t >= 0)) continue;                            // a tile of padding only
      for (int i0 = tid; i0 < kKeys * chunks; i0 += kStageLoads * NTH) {  // kStageLoads loads in flight
        uint4 raw_u[kStageLoads];
#pragma unroll
        for (int u = 0; u < kStageLoads; ++u) {
          const int i = i0 + u * NTH, r = i / chunks, c = i - r * chunks, kt = i < kKeys * chunks ? key_s[r] : -1;
          raw_u[u] = kt >= 0 ? __ldg(reinterpret_cast<const uint4*>(kv + int64_t(kt) * D) + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kStageLoads; ++u) {
          const int i = i0 + u * NTH, r = i / chunks, c = i - r * chunks;
          if (i >= kKeys * chunks) break;
          *reinterpret_cast<uint4*>(kv_h + r * RH + c * 8) = bf16x8_to_half(raw_u[u]);
        }
      }
      __syncthreads();
    }

    // this warp's part of the scores of all 64 keys for the 16 heads; warps 4-7 leave theirs in red[warp - 4], then
    // warps 0-3 add theirs (red[w] = part w + part w + 4)
    {
      float sc[kKeyTiles][4] = {};
#pragma unroll
      for (int i = 0; i < WS; ++i) {
        if (i >= nks) break;
        const int kq = 8 * (ks0 + i) + t4;  // word of dims 16 (ks0 + i) + 2t
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          const uint32_t* krow = kw + (8 * n + g) * RW + kq;
          const uint32_t b0 = krow[0], b1 = krow[4];
#pragma unroll
          for (int hl = 0; hl < 2; ++hl)  // q's fp16 value, then its remainder: ~fp32 scores
            mma_m16n8k16_f16(sc[n], qa[i][hl][0], qa[i][hl][1], qa[i][hl][2], qa[i][hl][3], b0, b1);
        }
      }
      float* rw = red + (warp % kParts) * kHeads * kPartRow;
      if (warp >= kParts) {
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          *reinterpret_cast<float2*>(rw + g * kPartRow + 8 * n + 2 * t4) = make_float2(sc[n][0], sc[n][1]);
          *reinterpret_cast<float2*>(rw + (g + 8) * kPartRow + 8 * n + 2 * t4) = make_float2(sc[n][2], sc[n][3]);
        }
      }
      __syncthreads();
      if (warp < kParts) {
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          float2* lo = reinterpret_cast<float2*>(rw + g * kPartRow + 8 * n + 2 * t4);
          float2* hi = reinterpret_cast<float2*>(rw + (g + 8) * kPartRow + 8 * n + 2 * t4);
          const float2 l = *lo, h = *hi;
          *lo = make_float2(sc[n][0] + l.x, sc[n][1] + l.y);
          *hi = make_float2(sc[n][2] + h.x, sc[n][3] + h.y);
        }
      }
    }
    __syncthreads();

    // online softmax: warp w updates heads 2w and 2w + 1 (lanes over keys lane, lane + 32), their scores the 4
    // slots summed in slot order
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int hh = 2 * warp + j;
      float x0 = 0.0f, x1 = 0.0f;
#pragma unroll
      for (int w = 0; w < kParts; ++w) {
        x0 += red[(w * kHeads + hh) * kPartRow + lane];
        x1 += red[(w * kHeads + hh) * kPartRow + lane + 32];
      }
      if (key_s[lane] < 0) x0 = -INFINITY;
      if (key_s[lane + 32] < 0) x1 = -INFINITY;
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

    // O[16 heads][warp's columns] = O * corr + P . V; B fragments of two value tiles per ldmatrix (keys k0 + l % 8
    // + 8 ((l / 8) % 2), columns of tile n + (l / 16))
    const float c_lo = corr_s[g], c_hi = corr_s[g + 8];
#pragma unroll
    for (int n = 0; n < VN; ++n) o[n][0] *= c_lo, o[n][1] *= c_lo, o[n][2] *= c_hi, o[n][3] *= c_hi;
    const int lrow = (lane & 7) + 8 * ((lane >> 3) & 1), lhalf = lane >> 4;
#pragma unroll
    for (int kk = 0; kk < kKeys; kk += 16) {
      const int kp = kk / 2 + t4;
      const uint32_t a0 = pw[g * (kProbHalves / 2) + kp], a1 = pw[(g + 8) * (kProbHalves / 2) + kp];
      const uint32_t a2 = pw[g * (kProbHalves / 2) + kp + 4], a3 = pw[(g + 8) * (kProbHalves / 2) + kp + 4];
      const half* vrow = kv_h + (kk + lrow) * RH;
#pragma unroll
      for (int n = 0; n < VN; n += 2) {
        if (warp + 8 * n >= NT) break;
        uint32_t b[4];
        if (n + 1 < VN && warp + 8 * (n + 1) < NT) {
          ldmatrix_x4_trans(vrow + (warp + 8 * (n + lhalf)) * 8, b[0], b[1], b[2], b[3]);
          mma_m16n8k16_f16(o[n], a0, a1, a2, a3, b[0], b[1]);
          mma_m16n8k16_f16(o[n + 1], a0, a1, a2, a3, b[2], b[3]);
        } else {
          ldmatrix_x2_trans(vrow + (warp + 8 * n) * 8, b[0], b[1]);
          mma_m16n8k16_f16(o[n], a0, a1, a2, a3, b[0], b[1]);
        }
      }
    }
  }
  __syncthreads();
  const bool lo_ok = h0 + g < a.H, hi_ok = h0 + g + 8 < a.H;
  if (part) {  // [S][H][kMlaSplits][v_dim + 2]: unnormalised values | max | sum
    const int R = a.v_dim;
    auto at = [&](int h) { return part + ((int64_t(s) * a.H + h0 + h) * kMlaSplits + split) * (R + 2); };
#pragma unroll
    for (int n = 0; n < VN; ++n) {
      if (warp + 8 * n >= NT) break;
      const int col = (warp + 8 * n) * 8 + 2 * t4;
      if (lo_ok) *reinterpret_cast<float2*>(at(g) + col) = make_float2(o[n][0], o[n][1]);
      if (hi_ok) *reinterpret_cast<float2*>(at(g + 8) + col) = make_float2(o[n][2], o[n][3]);
    }
    const int ht = tid - group * kThreads;  // this group's head ht
    if (ht < kHeads && h0 + ht < a.H) at(ht)[R] = m_s[ht], at(ht)[R + 1] = l_s[ht];
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

template <int VN, int WS, int G, bool PF>
void launch_prefill(const AttentionArgs& a, float* part, cudaStream_t st) {
  const size_t smem = prefill_smem_bytes(a.q_dim, G, PF);
  reserve_dynamic_smem(mla_prefill_kernel<VN, WS, G, PF>, smem, "mla_prefill_attention");
  launch(mla_prefill_kernel<VN, WS, G, PF>, dim3(unsigned(a.S * ceil_div(a.H, G * kHeads)), part ? kMlaSplits : 1),
         G * kThreads, smem, st, a, part);
}

template <int WS, int G, bool PF>
void launch_ws(const AttentionArgs& a, float* part, cudaStream_t st) {
  switch ((a.v_dim / 8 + 7) / 8) {
    case 1: launch_prefill<1, WS, G, PF>(a, part, st); break;
    case 2: launch_prefill<2, WS, G, PF>(a, part, st); break;
    case 3: launch_prefill<3, WS, G, PF>(a, part, st); break;
    case 4: launch_prefill<4, WS, G, PF>(a, part, st); break;
    case 5: launch_prefill<5, WS, G, PF>(a, part, st); break;
    case 6: launch_prefill<6, WS, G, PF>(a, part, st); break;
    case 7: launch_prefill<7, WS, G, PF>(a, part, st); break;
    default: launch_prefill<8, WS, G, PF>(a, part, st); break;
  }
}

// Groups of 16 heads sharing each staged key tile, for a prefill (no key ranges): 5 (mla_prefill_wgmma.cu: 64 heads on
// warpgroup MMAs, unless MOESRV_MLA_WGMMA=0), 4 (mla_prefill_wide.cu) or 2 (the prefetching two-group form, ~187 KB
// per block) where the shape and the device allow and the heads fill them, else 1; `asked` (or
// MOESRV_MLA_PREFILL_GROUPS when 0) caps it.
int head_groups(const AttentionArgs& a, const float* part, int asked) {
  static const int env = env_choice("MOESRV_MLA_PREFILL_GROUPS", 1, 4, 4);
  static const bool wgmma = env_choice("MOESRV_MLA_WGMMA", 0, 1, 1) != 0;
  const int cap = asked > 0 ? asked : wgmma && env == 4 ? 5 : env;
  if (part || a.H <= kHeads) return 1;
  if (cap >= 5 && a.H > 2 * kHeads && mla_prefill_wgmma_supported(a)) return 5;
  if (cap >= 4 && a.H > 2 * kHeads && mla_prefill_wide_supported(a)) return 4;
  if (cap >= 2 && prefill_smem_bytes(a.q_dim, 2, true) + kStaticSmemBytes <= device_block_smem_limit()) return 2;
  return 1;
}

void launch_any(const AttentionArgs& a, float* part, cudaStream_t st, int asked = 0) {
  static_assert(kMaxWarpSteps == 5, "launch_any picks 4 or 5 steps per warp");
  const bool ws4 = padded_dim(a.q_dim) / 16 <= 4 * kWarps;
  switch (head_groups(a, part, asked)) {
    case 5: return mla_prefill_wgmma(a, st);
    case 4: return mla_prefill_wide(a, st);
    case 2:
      if (ws4) launch_ws<4, 2, true>(a, part, st);
      else launch_ws<5, 2, true>(a, part, st);
      break;
    default:
      if (ws4) launch_ws<4, 1, false>(a, part, st);
      else launch_ws<5, 1, false>(a, part, st);
  }
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool mla_prefill_supported(const AttentionArgs& a) {
  if (!(a.mla && !a.q8 && a.q_dim % 8 == 0 && a.q_dim <= kMaxQDim && a.v_dim % 8 == 0 && a.v_dim <= 512 &&
        a.v_dim <= a.q_dim))
    return false;
  // the block's shared memory within the device's (99 KB per block on an RTX 3090 / 4090: q_dim <= 576 fits)
  return mla_prefill_block_smem(a.q_dim) <= device_block_smem_limit();
}

size_t mla_prefill_block_smem(int q_dim) { return prefill_smem_bytes(q_dim) + kStaticSmemBytes; }

void mla_prefill_attention(const AttentionArgs& a, cudaStream_t st, int max_groups) {
  if (!mla_prefill_supported(a))
    throw std::runtime_error("mla_prefill_attention: unsupported shape, or its shared memory exceeds the device's");
  if (a.S <= 0) return;
  launch_any(a, nullptr, st, max_groups);
}

void mla_prefill_split_ranges(const AttentionArgs& a, float* part, cudaStream_t st) {
  if (!mla_prefill_supported(a))
    throw std::runtime_error("mla_prefill_split_ranges: unsupported shape, or its shared memory exceeds the device's");
  if (a.S > 0) launch_any(a, part, st);
}

}  // namespace moesrv::cuda
