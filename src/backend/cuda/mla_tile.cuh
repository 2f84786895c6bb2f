// Key tiles of the tensor-core MLA prefill kernels (mla_prefill.cu, mla_prefill_wide.cu): row geometry and the
// cp.async gather of a query's next keys.
#pragma once
#include <cstdint>

#include "backend/cuda/kernel_util.cuh"

namespace moesrv::cuda::mla_tile {

// fp16 key rows: q_dim rounded up to 16 (zero padded) + 8 halves apart, so 8 rows x 16 bytes hit 32 banks.
__host__ __device__ constexpr int padded_dim(int q_dim) { return (q_dim + 15) / 16 * 16; }
__host__ __device__ constexpr int row_halves(int q_dim) { return padded_dim(q_dim) + 8; }

// Key idx of a query at position pos: sel[idx] with a DSA selection, else idx itself; -1 for padding, past `end` or
// after the token.
__device__ __forceinline__ int key_at(const int32_t* sel, int idx, int end, int pos) {
  const int t = idx < end ? (sel ? __ldg(sel + idx) : idx) : -1;
  return t > pos ? -1 : t;
}

// Keys [base, base + kKeys) into keys[] and their bf16 cache rows (D values) into dst rows dst_ld halves apart, by
// cp.async (zeros for -1), as one commit group. kThreads: the block's threads, all of which call it.
template <int kKeys, int kThreads>
__device__ __forceinline__ void gather_keys(int* keys, void* dst, int dst_ld, const uint16_t* cache, int D,
                                            const int32_t* sel, int base, int end, int pos) {
  const int tid = threadIdx.x, chunks = D / 8;
  if (tid < kKeys) keys[tid] = key_at(sel, base + tid, end, pos);
  uint16_t* d = static_cast<uint16_t*>(dst);
  for (int i = tid; i < kKeys * chunks; i += kThreads) {
    const int r = i / chunks, c = i - r * chunks, kt = key_at(sel, base + r, end, pos);
    cp_async16(d + r * dst_ld + c * 8, cache + int64_t(max(kt, 0)) * D + c * 8, kt >= 0);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

}  // namespace moesrv::cuda::mla_tile
