// MLA prefill attention on Hopper's warpgroup MMA (sm_90a; mla_prefill.cu picks it where mla_prefill_wgmma_supported,
// unless MOESRV_MLA_WGMMA=0): one block per query token and 64 heads, two warpgroups. Each gathered key tile (NK keys
// of the 512-dim latent, fp16, 128-byte swizzled rows in 8 blocks of 64 dims) is both operands' B: the scores S[64
// heads][NK keys] = (q x scale) . K^T take it K-major with q from shared memory (both operands by descriptor),
// warpgroup g over dims [256 g, 256 g + 256), the two partial scores summed through shared memory (both warpgroups
// add the same two numbers, so they run the same online softmax); then O[64 heads][256 value dims of g] += P . V
// takes the same tile N-major (value dims contiguous per key), P as fp16 A fragments in registers. q is fp16 value
// + remainder (two score MMAs per step: ~fp32 scores) with 32-key tiles, or with MOESRV_MLA_Q_SPLIT=0 one fp16 value
// with 64-key tiles. The next tile's rows arrive by cp.async while this one is multiplied. FlashMLA's sm90 sparse
// prefill is the public example of the structure (read, not copied).
#include <stdexcept>

#include "backend/cuda/exl3_ops.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/mla_tile.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/wgmma.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kHeads = 64, kThreads = 256, kDim = 512, kBlocks = kDim / 64;

// Shared memory (bytes from a 1,024-aligned base): q parts [part][block][head][128 B], key tiles [2][block][NK][128 B],
// partial scores [warpgroup][NK / 8][128 threads] float4, key indices [2][NK].
template <int NK, bool QLO>
struct WgSmem {
  static constexpr int q_part = kBlocks * kHeads * 128, tile = kBlocks * NK * 128;
  static constexpr int q = 0, kv = q + (QLO ? 2 : 1) * q_part, ex = kv + 2 * tile, keys = ex + 2 * NK * kHeads * 4;
  static constexpr int bytes = keys + 2 * NK * 4 + 1024;  // + the base's alignment
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Byte offset of 16-byte chunk c (8 dims) of row r in a [block][rows][128 B] swizzled array.
__device__ __forceinline__ int swz(int rows, int r, int c) {
  return (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}
#endif

// V2 (the default; MOESRV_MLA_WGMMA_V2=0 gives the first form): a tile's selection indices are loaded a tile ahead
// (their latency off the gather's path), and O is rescaled only where a warp's running maxima moved (x 1 is exact).
// 512 queries x 2048 keys on an H100: 986 vs 1,108 us (q split), 778 vs 847 us (q one fp16 value); same errors.
template <int NK, bool QLO, bool V2>
__global__ void __launch_bounds__(kThreads, 1) mla_prefill_wgmma_kernel(AttentionArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using M = WgSmem<NK, QLO>;
  constexpr int NA = NK / 2, KSTEPS = NK / 16;  // score accumulators per thread; P's k-steps
  pdl_enter();
  extern __shared__ unsigned char smem_raw[];
  unsigned char* sm =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t sm_addr = static_cast<uint32_t>(__cvta_generic_to_shared(sm));
  int* key_buf = reinterpret_cast<int*>(sm + M::keys);
  float4* ex = reinterpret_cast<float4*>(sm + M::ex);

  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, w = wt >> 5, lane = tid & 31, g = lane >> 2,
            t4 = lane & 3;
  const mla_tile::QueryKeys qk = mla_tile::QueryKeys::of<kHeads>(a);
  const int s = qk.s, h0 = qk.h0, pos = qk.pos, n_keys = qk.n_keys;
  const int32_t* sel = qk.sel;
  const uint16_t* cache = qk.cache;

  // keys [base, base + NK) and their rows into tile buf (bf16; each thread converts the chunks it copied)
  auto prefetch = [&](int base, int buf) {
    unsigned char* dst = sm + M::kv + buf * M::tile;
    mla_tile::gather_keys_to<NK, kThreads>(
        key_buf + buf * NK, [dst](int r, int c) { return dst + swz(NK, r, c); }, cache, kDim, sel, base, n_keys, pos);
  };
  // V2: the same in two steps. Thread tid copies chunk tid % 64 of rows tid / 64 + 4 m; load_idx reads its raw
  // selection entries for a tile (idx[m], and idx[kRows] for key_buf when tid < NK) one tile ahead, issue checks
  // them against the position and starts the copies.
  constexpr int kRows = NK * (kDim / 8) / kThreads;
  const int r0 = tid / (kDim / 8), c0 = tid % (kDim / 8);
  auto load_idx = [&](int base, int(&idx)[kRows + 1]) {
#pragma unroll
    for (int m = 0; m < kRows; ++m) idx[m] = mla_tile::key_entry(sel, base + r0 + 4 * m, n_keys);
    idx[kRows] = tid < NK ? mla_tile::key_entry(sel, base + tid, n_keys) : -1;
  };
  auto issue = [&](int buf, const int(&idx)[kRows + 1]) {
    unsigned char* dst = sm + M::kv + buf * M::tile;
    if (tid < NK) key_buf[buf * NK + tid] = mla_tile::visible(idx[kRows], pos);
#pragma unroll
    for (int m = 0; m < kRows; ++m) {
      const int kt = mla_tile::visible(idx[m], pos);
      cp_async16(dst + swz(NK, r0 + 4 * m, c0), cache + int64_t(max(kt, 0)) * kDim + c0 * 8, kt >= 0);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  [[maybe_unused]] int idx_next[kRows + 1];
  if (n_keys > 0) {
    if constexpr (V2) {
      load_idx(0, idx_next);
      issue(0, idx_next);
      load_idx(NK, idx_next);
    } else {
      prefetch(0, 0);
    }
  }

  // q x scale as fp16 value (and remainder), zero for heads past H
  for (int i = tid; i < kHeads * (kDim / 8); i += kThreads) {
    const int h = i / (kDim / 8), c = i % (kDim / 8);
    float v[8] = {};
    if (h0 + h < a.H) {
      const float4* src = reinterpret_cast<const float4*>(a.q + (int64_t(s) * a.H + h0 + h) * kDim + c * 8);
      const float4 x0 = src[0], x1 = src[1];
      v[0] = x0.x, v[1] = x0.y, v[2] = x0.z, v[3] = x0.w, v[4] = x1.x, v[5] = x1.y, v[6] = x1.z, v[7] = x1.w;
    }
    uint4 hi, lo;
    uint32_t* hp = &hi.x;
    uint32_t* lp = &lo.x;
#pragma unroll
    for (int j = 0; j < 4; ++j) split_half2(v[2 * j] * a.scale, v[2 * j + 1] * a.scale, hp[j], lp[j]);
    *reinterpret_cast<uint4*>(sm + M::q + swz(kHeads, h, c)) = hi;
    if constexpr (QLO) *reinterpret_cast<uint4*>(sm + M::q + M::q_part + swz(kHeads, h, c)) = lo;
  }

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};  // rows g, g + 8; l: this thread's keys only

  for (int base = 0, it = 0; base < n_keys; base += NK, ++it) {
    const int buf = it & 1;
    unsigned char* tile = sm + M::kv + buf * M::tile;
    asm volatile("cp.async.wait_all;\n" ::);
    for (int i = tid; i < NK * (kDim / 8); i += kThreads) {  // the chunks this thread copied: bf16 -> fp16 in place
      uint4* p = reinterpret_cast<uint4*>(tile + swz(NK, i / (kDim / 8), i % (kDim / 8)));
      *p = bf16x8_to_half(*p);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // (q, and this tile, visible to the wgmma)
    // the tile is fp16 for both warpgroups; both are done with the previous tile (its MMAs were waited for) and
    // with the previous partial scores
    const bool any = __syncthreads_or(tid < NK && key_buf[buf * NK + tid] >= 0);
    if (base + NK < n_keys) {
      if constexpr (V2) {
        issue(buf ^ 1, idx_next);
        load_idx(base + 2 * NK, idx_next);  // (used at the next tile: its loads stay in flight)
      } else {
        prefetch(base + NK, buf ^ 1);
      }
    }
    if (!any) continue;  // a tile of padding only

    // this warpgroup's partial scores over dims [256 wg, 256 wg + 256)
    float sc[NA];
#pragma unroll
    for (int i = 0; i < NA; ++i) sc[i] = 0.0f;
    const uint32_t tile_addr = sm_addr + M::kv + buf * M::tile;
    wgmma::fence();
    wgmma::fence_acc(sc);
#pragma unroll
    for (int ks = 16 * wg; ks < 16 * wg + 16; ++ks) {
      const uint32_t koff = (ks >> 2) * M::tile / kBlocks + (ks & 3) * 32;
      const uint32_t qoff = (ks >> 2) * kHeads * 128 + (ks & 3) * 32;
      const uint64_t kd = wgmma::sw128_desc(tile_addr + koff);
      wgmma::MmaSS<NK>::mma(sc, wgmma::sw128_desc(sm_addr + M::q + qoff), kd);
      if constexpr (QLO) wgmma::MmaSS<NK>::mma(sc, wgmma::sw128_desc(sm_addr + M::q + M::q_part + qoff), kd);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_acc(sc);
#pragma unroll
    for (int j = 0; j < NK / 8; ++j)
      ex[(wg * (NK / 8) + j) * 128 + wt] = make_float4(sc[4 * j], sc[4 * j + 1], sc[4 * j + 2], sc[4 * j + 3]);
    __syncthreads();  // both partial scores stored
    const int* keys = key_buf + buf * NK;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NK / 8; ++j) {
      const float4 p = ex[((wg ^ 1) * (NK / 8) + j) * 128 + wt];
      sc[4 * j] += p.x, sc[4 * j + 1] += p.y, sc[4 * j + 2] += p.z, sc[4 * j + 3] += p.w;
#pragma unroll
      for (int i = 0; i < 2; ++i)
        if (keys[8 * j + 2 * t4 + i] < 0) sc[4 * j + i] = sc[4 * j + 2 + i] = -INFINITY;
      mx[0] = fmaxf(mx[0], fmaxf(sc[4 * j], sc[4 * j + 1]));
      mx[1] = fmaxf(mx[1], fmaxf(sc[4 * j + 2], sc[4 * j + 3]));
    }
    float corr[2];
    mla_tile::online_max(mx, m_r, corr);  // (mx: the max the probabilities use)
    uint32_t pa[KSTEPS][4];               // P as A fragments of the 16-key steps
    float ps[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < NK / 8; ++j) {
      float p[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) p[i] = sc[4 * j + i] == -INFINITY ? 0.0f : expf(sc[4 * j + i] - mx[i >> 1]);
      ps[0] += p[0] + p[1], ps[1] += p[2] + p[3];
      // n-tile j = keys 8 j ..: step j / 2, registers 0 / 1 (j even) or 2 / 3 (j odd)
      pa[j >> 1][2 * (j & 1)] = pack_half2(__float2half_rn(p[0]), __float2half_rn(p[1]));
      pa[j >> 1][2 * (j & 1) + 1] = pack_half2(__float2half_rn(p[2]), __float2half_rn(p[3]));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_r[r] = l_r[r] * corr[r] + ps[r];
    if (!V2 || __any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
      for (int j = 0; j < 32; ++j)
        o[4 * j] *= corr[0], o[4 * j + 1] *= corr[0], o[4 * j + 2] *= corr[1], o[4 * j + 3] *= corr[1];
    }

    // O[64 heads][value dims 256 wg ..] += P . V: the tile's dim blocks 4 wg .. 4 wg + 3, N-major
    const uint32_t v_addr = tile_addr + 4 * wg * (M::tile / kBlocks);
    wgmma::fence();
    wgmma::fence_acc(o);
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
      wgmma::Mma<256, 1>::mma(o, pa[kk], wgmma::sw128_mn_desc(v_addr + kk * 2048, M::tile / kBlocks));
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_acc(o);
  }

  float inv[2];
  mla_tile::row_inverses(l_r, inv);
  const float inv_lo = inv[0], inv_hi = inv[1];
  const int h_lo = h0 + 16 * w + g, h_hi = h_lo + 8;
  float* out_lo = a.out + (int64_t(s) * a.H + h_lo) * kDim + 256 * wg + 2 * t4;
  float* out_hi = out_lo + int64_t(8) * kDim;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    if (h_lo < a.H) *reinterpret_cast<float2*>(out_lo + 8 * j) = make_float2(o[4 * j] * inv_lo, o[4 * j + 1] * inv_lo);
    if (h_hi < a.H)
      *reinterpret_cast<float2*>(out_hi + 8 * j) = make_float2(o[4 * j + 2] * inv_hi, o[4 * j + 3] * inv_hi);
  }
#else
  __trap();  // (never launched: mla_prefill_wgmma_supported needs an sm_90a build)
#endif
}

template <int NK, bool QLO, bool V2>
void launch_wgmma(const AttentionArgs& a, cudaStream_t st) {
  constexpr size_t smem = WgSmem<NK, QLO>::bytes;
  reserve_dynamic_smem(mla_prefill_wgmma_kernel<NK, QLO, V2>, smem, "mla_prefill_wgmma");
  launch(mla_prefill_wgmma_kernel<NK, QLO, V2>, dim3(unsigned(a.S * ((a.H + kHeads - 1) / kHeads))), kThreads, smem, st,
         a);
}

}  // namespace

bool mla_prefill_wgmma_supported(const AttentionArgs& a) {
  return a.mla && !a.q8 && a.q_dim == kDim && a.v_dim == kDim && exl3_gemm_wgmma_built() &&
         size_t(WgSmem<64, false>::bytes) <= device_block_smem_limit() &&
         size_t(WgSmem<32, true>::bytes) <= device_block_smem_limit();
}

void mla_prefill_wgmma(const AttentionArgs& a, cudaStream_t st, int q_split, int v2) {
  if (!mla_prefill_wgmma_supported(a)) throw std::runtime_error("mla_prefill_wgmma: unsupported shape or device");
  if (a.S <= 0) return;
  if (q_split < 0) q_split = env_choice("MOESRV_MLA_Q_SPLIT", 0, 1, 1);
  static const int v2_env = env_choice("MOESRV_MLA_WGMMA_V2", 0, 1, 1);
  if (v2 < 0) v2 = v2_env;
  if (q_split && v2) launch_wgmma<32, true, true>(a, st);
  else if (q_split) launch_wgmma<32, true, false>(a, st);
  else if (v2) launch_wgmma<64, false, true>(a, st);
  else launch_wgmma<64, false, false>(a, st);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
