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

}  // namespace moesrv::cuda
