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

// Exclusive prefix count of `flag` over the block in thread order; `total` gets the block's count.
__device__ __forceinline__ int block_exclusive_count(bool flag, int& total) {
  __shared__ int warp_counts[kTopkWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  __syncthreads();
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int before = 0;
  total = 0;
  for (int w = 0; w < kTopkWarps; ++w) {
    if (w < warp) before += warp_counts[w];
    total += warp_counts[w];
  }
  return before + __popc(ballot & ((1u << lane) - 1u));
}

// The top k (0 < k < n) of sc[0, n): calls emit(index, slot) for each chosen index, slots 0..k-1 in ascending
// index order. Every thread of the block must call it.
template <typename Emit>
__device__ void block_radix_topk(const float* sc, int n, int k, Emit emit) {
  __shared__ int hist[256];
  __shared__ uint32_t prefix_s;
  __shared__ int want_s;
  const int tid = threadIdx.x;
  if (tid == 0) {
    prefix_s = 0;
    want_s = k;
  }
  __syncthreads();
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    const uint32_t hi_mask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
    for (int i = tid; i < 256; i += kTopkThreads) hist[i] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s;
    for (int t = tid; t < n; t += kTopkThreads) {
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
  for (int base = 0; base < n; base += kTopkThreads) {
    const int t = base + tid;
    const uint32_t u = t < n ? ordered_bits(sc[t]) : 0u;
    const bool greater = t < n && u > thr, equal = t < n && u == thr;
    int eq_total = 0, take_total = 0;
    const int eq_rank = block_exclusive_count(equal, eq_total) + equal_seen;
    const bool take = greater || (equal && eq_rank < want_equal);
    const int slot = block_exclusive_count(take, take_total) + written;
    if (take) emit(t, slot);
    equal_seen += eq_total;
    written += take_total;
  }
}

}  // namespace moesrv::cuda
