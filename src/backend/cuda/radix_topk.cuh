// Exact block-wide top-k of n scores by a 4-pass radix select on order-preserving float bits (one block of
// kTopkThreads threads per row), shared by the DSA and k-pool indexers. Ties at the k-th score go to the lower
// index; the chosen indices are emitted in ascending order.
#pragma once
#include <cstdint>

#include "backend/cuda/kernel_util.cuh"

namespace moesrv::cuda {

constexpr int kTopkThreads = 256, kTopkWarps = kTopkThreads / 32;

__device__ __forceinline__ uint32_t ordered_bits(float f) {
  const uint32_t b = __float_as_uint(f + 0.0f);  // -0 -> +0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Exclusive prefix sums of two counts over the block (kThreads threads) in thread order; totals in *t0, *t1. Every
// thread calls it.
template <int kThreads = kTopkThreads>
__device__ __forceinline__ int2 block_exclusive_sum2(int a, int b, int* t0, int* t1) {
  constexpr int kWarps = kThreads / 32;
  __shared__ int2 warp_tot[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int ia = a, ib = b;  // inclusive scans within the warp
  for (int o = 1; o < 32; o <<= 1) {
    const int ua = __shfl_up_sync(0xffffffffu, ia, o), ub = __shfl_up_sync(0xffffffffu, ib, o);
    if (lane >= o) ia += ua, ib += ub;
  }
  __syncthreads();
  if (lane == 31) warp_tot[warp] = make_int2(ia, ib);
  __syncthreads();
  int2 before = make_int2(0, 0), tot = make_int2(0, 0);
  for (int w = 0; w < kWarps; ++w) {
    const int2 v = warp_tot[w];
    if (w < warp) before.x += v.x, before.y += v.y;
    tot.x += v.x, tot.y += v.y;
  }
  *t0 = tot.x, *t1 = tot.y;
  return make_int2(before.x + ia - a, before.y + ib - b);
}

// The top k (0 < k < n) of sc[0, n): calls emit(index, slot) for each chosen index, slots 0..k-1 in ascending
// index order. Every thread of the block must call it. Radix passes count with warp-aggregated shared atomics
// (scores of one row share their high bits); the bin holding the k-th score is found by a suffix scan over the
// 256 bins; the emission gives each thread one contiguous range of indices (one block scan). kThreads: the block's
// threads, a multiple of 256 (more threads: shorter passes over long score rows).
template <int kThreads = kTopkThreads, typename Emit>
__device__ void block_radix_topk(const float* sc, int n, int k, Emit emit) {
  static_assert(kThreads % 256 == 0, "at least one thread per radix bin");
  __shared__ int hist[256];
  __shared__ uint32_t prefix_s;
  __shared__ int want_s;
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid == 0) {
    prefix_s = 0;
    want_s = k;
  }
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    const uint32_t hi_mask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
    if (tid < 256) hist[tid] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s;
    for (int base = 0; base < n; base += kThreads) {  // warp-uniform trip count (__match_any_sync)
      const int t = base + tid;
      const uint32_t u = t < n ? ordered_bits(sc[t]) : 0u;
      const bool in = t < n && (u & hi_mask) == prefix;
      const unsigned active = __ballot_sync(0xffffffffu, in);
      if (in) {
        const uint32_t bin = (u >> shift) & 255u;
        const unsigned same = __match_any_sync(active, bin);
        if (lane == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
      }
    }
    __syncthreads();
    // Suffix count from bin 255 down: cnt_ge(b) = sum of hist[b..255]; the k-th largest is in the bin b where
    // cnt_ge(b) >= want > cnt_ge(b + 1). Thread tid holds bin 255 - tid, so an inclusive scan gives cnt_ge.
    const int want = want_s;
    const int h = tid < 256 ? hist[255 - tid] : 0;
    int t0 = 0, t1 = 0;
    const int ge = block_exclusive_sum2<kThreads>(h, 0, &t0, &t1).x + h;
    if (ge >= want && ge - h < want) {
      prefix_s = prefix | (uint32_t(255 - tid) << shift);
      want_s = want - (ge - h);
    }
    __syncthreads();
  }
  const uint32_t thr = prefix_s;
  const int want_equal = want_s;
  const int per = (n + kThreads - 1) / kThreads, i0 = min(n, tid * per), i1 = min(n, i0 + per);
  int greater = 0, equal = 0;
  for (int t = i0; t < i1; ++t) {
    const uint32_t u = ordered_bits(sc[t]);
    greater += u > thr;
    equal += u == thr;
  }
  int tg = 0, te = 0;
  const int2 before = block_exclusive_sum2<kThreads>(greater, equal, &tg, &te);
  int eq_rank = before.y, slot = before.x + min(before.y, want_equal);  // slots taken by lower ranges
  for (int t = i0; t < i1; ++t) {
    const uint32_t u = ordered_bits(sc[t]);
    if (u > thr || (u == thr && eq_rank < want_equal)) emit(t, slot++);
    eq_rank += u == thr;
  }
}

// The same selection (top k of sc[0, n), 0 < k < n, emit(index, slot) in ascending index order, ties to the lower
// index), usually in fewer block-wide passes: the scores' range is cut into kTopkBins equal-width bins (a
// non-decreasing map, so a higher bin holds strictly higher scores), one histogram finds the bin B holding the k-th
// score, and only B's scores are ranked against each other (by score, then index). Falls back to block_radix_topk
// when B holds more than kTopkBinList scores (e.g. many equal ones) or n > kTopkMaskBits. kThreads: a multiple of
// 32 that divides kTopkBins / 2 ... kTopkBins (two bins per thread at 1024).
constexpr int kTopkBins = 2048, kTopkBinList = 1024, kTopkMaskBits = 48 * 1024;

template <int kThreads, typename Emit>
__device__ void block_binned_topk(const float* sc, int n, int k, Emit emit) {
  static_assert(kThreads * 2 == kTopkBins, "two bins per thread");
  constexpr int kWarps = kThreads / 32;
  __shared__ int hist[kTopkBins];
  __shared__ uint32_t chosen[kTopkMaskBits / 32];  // bin B's selected scores, a bit per index
  __shared__ int list[kTopkBinList];
  __shared__ float range_lo[kWarps], range_hi[kWarps];
  __shared__ int bin_s, want_s, listed_s;
  if (n > kTopkMaskBits) return block_radix_topk<kThreads>(sc, n, k, emit);  // block-uniform
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float lo = INFINITY, hi = -INFINITY;
  for (int t = tid; t < n; t += kThreads) {
    const float v = sc[t];
    lo = fminf(lo, v), hi = fmaxf(hi, v);
  }
  for (int o = 16; o > 0; o >>= 1)
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o)), hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  if (lane == 0) range_lo[warp] = lo, range_hi[warp] = hi;
  for (int i = tid; i < kTopkBins; i += kThreads) hist[i] = 0;
  for (int i = tid; i < (n + 31) / 32; i += kThreads) chosen[i] = 0;
  if (tid == 0) listed_s = 0;
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) lo = fminf(lo, range_lo[w]), hi = fmaxf(hi, range_hi[w]);
  const float scale = hi > lo ? float(kTopkBins) / (hi - lo) : 0.0f;  // (inf range: scale 0, one bin, the fallback)
  const auto bin = [&](float v) {
    const float f = (v - lo) * scale;
    return f >= 0.0f ? min(kTopkBins - 1, int(f)) : 0;  // (NaN: bin 0)
  };
  for (int t = tid; t < n; t += kThreads) atomicAdd(&hist[bin(sc[t])], 1);
  __syncthreads();
  // Thread tid holds bins b1 = kTopkBins - 1 - 2 tid and b1 - 1; the exclusive sum counts the scores above b1.
  const int b1 = kTopkBins - 1 - 2 * tid, h1 = hist[b1], h0 = hist[b1 - 1];
  int t0 = 0, t1 = 0;
  const int above = block_exclusive_sum2<kThreads>(h1 + h0, 0, &t0, &t1).x;
  if (above < k && above + h1 >= k) bin_s = b1, want_s = k - above;
  if (above + h1 < k && above + h1 + h0 >= k) bin_s = b1 - 1, want_s = k - above - h1;
  __syncthreads();
  const int B = bin_s, want = want_s;
  if (hist[B] > kTopkBinList) return block_radix_topk<kThreads>(sc, n, k, emit);  // block-uniform
  for (int t = tid; t < n; t += kThreads)
    if (bin(sc[t]) == B) list[atomicAdd(&listed_s, 1)] = t;
  __syncthreads();
  const int m = listed_s;
  for (int i = tid; i < m; i += kThreads) {
    const int t = list[i];
    const float v = sc[t];
    int rank = 0;
    for (int j = 0; j < m; ++j) {
      const int u = list[j];
      const float w = sc[u];
      rank += w > v || (w == v && u < t);
    }
    if (rank < want) atomicOr(&chosen[t >> 5], 1u << (t & 31));
  }
  __syncthreads();
  const auto picked = [&](int t) {
    const int b = bin(sc[t]);
    return b > B || (b == B && (chosen[t >> 5] >> (t & 31) & 1u));
  };
  const int per = (n + kThreads - 1) / kThreads, i0 = min(n, tid * per), i1 = min(n, i0 + per);
  int count = 0;
  for (int t = i0; t < i1; ++t) count += picked(t);
  int c0 = 0, c1 = 0;
  int slot = block_exclusive_sum2<kThreads>(count, 0, &c0, &c1).x;
  for (int t = i0; t < i1; ++t)
    if (picked(t)) emit(t, slot++);
}

}  // namespace moesrv::cuda
