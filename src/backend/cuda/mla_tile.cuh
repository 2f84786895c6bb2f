// Key tiles of the tensor-core MLA prefill kernels (mla_prefill.cu, mla_prefill_wide.cu): row geometry and the
// cp.async gather of a query's next keys.
#pragma once
#include <cstdint>

#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"

namespace moesrv::cuda::mla_tile {

// fp16 key rows: q_dim rounded up to 16 (zero padded) + 8 halves apart, so 8 rows x 16 bytes hit 32 banks.
__host__ __device__ constexpr int padded_dim(int q_dim) { return (q_dim + 15) / 16 * 16; }
__host__ __device__ constexpr int row_halves(int q_dim) { return padded_dim(q_dim) + 8; }

// Key idx of a query: sel[idx] with a DSA selection, else idx itself; -1 past `end`. visible(t, pos): -1 also for a
// key after the token. key_at: both (kernels that load the entries ahead take them in two steps).
__device__ __forceinline__ int key_entry(const int32_t* sel, int idx, int end) {
  return idx < end ? (sel ? __ldg(sel + idx) : idx) : -1;
}
__device__ __forceinline__ int visible(int t, int pos) { return t > pos ? -1 : t; }
__device__ __forceinline__ int key_at(const int32_t* sel, int idx, int end, int pos) {
  return visible(key_entry(sel, idx, end), pos);
}

// Keys [base, base + kKeys) into keys[] and their bf16 cache rows (D values) by cp.async (zeros for -1), as one
// commit group: 16-byte chunk c of row r to dst(r, c). kThreads: the block's threads, all of which call it.
template <int kKeys, int kThreads, class Dst>
__device__ __forceinline__ void gather_keys_to(int* keys, Dst dst, const uint16_t* cache, int D, const int32_t* sel,
                                               int base, int end, int pos) {
  const int tid = threadIdx.x, chunks = D / 8;
  if (tid < kKeys) keys[tid] = key_at(sel, base + tid, end, pos);
  for (int i = tid; i < kKeys * chunks; i += kThreads) {
    const int r = i / chunks, c = i - r * chunks, kt = key_at(sel, base + r, end, pos);
    cp_async16(dst(r, c), cache + int64_t(max(kt, 0)) * D + c * 8, kt >= 0);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// The same into rows dst_ld halves apart.
template <int kKeys, int kThreads>
__device__ __forceinline__ void gather_keys(int* keys, void* dst, int dst_ld, const uint16_t* cache, int D,
                                            const int32_t* sel, int base, int end, int pos) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  gather_keys_to<kKeys, kThreads>(
      keys, [d, dst_ld](int r, int c) { return d + r * dst_ld + c * 8; }, cache, D, sel, base, end, pos);
}

// A block's query token and its keys: block x = token s * blocks + head block (kHeads heads from h0).
struct QueryKeys {
  int s, h0, pos, n_keys;
  const int32_t* sel;     // the token's DSA selection, or null (every key up to pos)
  const uint16_t* cache;  // bf16 latent rows
  template <int kHeads>
  __device__ __forceinline__ static QueryKeys of(const AttentionArgs& a) {
    QueryKeys q;
    const int blocks = (a.H + kHeads - 1) / kHeads;
    q.s = int(blockIdx.x) / blocks, q.h0 = (int(blockIdx.x) % blocks) * kHeads;
    q.pos = *a.pos0 + q.s;
    q.cache = static_cast<const uint16_t*>(a.lc->kv);
    q.n_keys = a.selection ? a.sel_k : q.pos + 1;
    q.sel = a.selection ? a.selection + int64_t(q.s) * a.sel_k : nullptr;
    return q;
  }
};

// The online softmax's update of an m16n8 fragment's two rows (g, g + 8): mx holds this thread's max of the tile's
// scores per row; it becomes the row's max over the quad's lanes and the running max m_r (-inf: every key so far is
// padding), corr the factor the earlier sums and outputs take.
__device__ __forceinline__ void online_max(float (&mx)[2], float (&m_r)[2], float (&corr)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(m_r[r], mx[r]);
    corr[r] = m_new == -INFINITY ? 1.0f : m_r[r] == -INFINITY ? 0.0f : expf(m_r[r] - m_new);
    mx[r] = m_new;
    m_r[r] = m_new;
  }
}

// 1 / the rows' sums over the quad's lanes (l: this thread's keys), 0 for a row without keys.
__device__ __forceinline__ void row_inverses(float (&l_r)[2], float (&inv)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 1);
    l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 2);
    inv[r] = l_r[r] > 0.0f ? 1.0f / l_r[r] : 0.0f;
  }
}

}  // namespace moesrv::cuda::mla_tile
