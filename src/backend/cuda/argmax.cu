// Greedy decoding's argmax of a logits row on the device (issue 19, item 8): the chosen id comes back as 4 bytes
// instead of the whole row. Blocks scan chunks; the last block to draw a ticket merges their bests.
#include <cmath>
#include <stdexcept>

#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kBlocks = 64, kThreads = 256;
constexpr int kNone = 0x7fffffff;  // no value seen (every value NaN)

// Best of (v, i) and (w, j): the larger value, the lower index among equals (a total order: merges in any grouping
// give the same answer).
__device__ __forceinline__ void keep_best(float& v, int& i, float w, int j) {
  if (w > v || (w == v && j < i)) v = w, i = j;
}

__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1)
    keep_best(v, i, __shfl_xor_sync(0xffffffffu, v, m), __shfl_xor_sync(0xffffffffu, i, m));
}

// Block-wide best of each thread's (v, i): the result in every thread.
__device__ void block_best(float& v, int& i) {
  __shared__ float sv[kThreads / 32];
  __shared__ int si[kThreads / 32];
  warp_best(v, i);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // (earlier uses of the arrays are done)
  if (lane == 0) sv[warp] = v, si[warp] = i;
  __syncthreads();
  v = lane < kThreads / 32 ? sv[lane] : -INFINITY;
  i = lane < kThreads / 32 ? si[lane] : kNone;
  warp_best(v, i);
}

__global__ void __launch_bounds__(kThreads)
    argmax_kernel(const float* x, int n, float* part_v, int* part_i, unsigned* ticket, int32_t* out) {
  pdl_enter();
  const int per = (n + int(gridDim.x) - 1) / int(gridDim.x), i0 = int(blockIdx.x) * per, i1 = min(n, i0 + per);
  float v = -INFINITY;
  int at = kNone;
  for (int i = i0 + int(threadIdx.x); i < i1; i += kThreads) {
    const float w = x[i];
    if (!isnan(w)) keep_best(v, at, w, i);  // w == -inf at a lower index than kNone is kept too
  }
  block_best(v, at);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    part_v[blockIdx.x] = v, part_i[blockIdx.x] = at;
    __threadfence();
    last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  v = -INFINITY, at = kNone;
  for (int b = int(threadIdx.x); b < int(gridDim.x); b += kThreads)
    keep_best(v, at, __ldcg(part_v + b), __ldcg(part_i + b));
  block_best(v, at);
  if (threadIdx.x == 0) {
    // std::max_element's answer: a NaN first value is never replaced, nor is the first of all-NaN values
    *out = isnan(x[0]) || at == kNone ? 0 : at;
    *ticket = 0;  // for the next launch (graph replays)
  }
}

}  // namespace

size_t argmax_scratch_bytes() { return size_t(kBlocks) * 8 + 16; }

void argmax(const float* x, int n, void* scratch, int32_t* out, cudaStream_t st) {
  if (n < 1) throw std::runtime_error("argmax: empty row");
  float* part_v = static_cast<float*>(scratch);
  int* part_i = reinterpret_cast<int*>(part_v + kBlocks);
  unsigned* ticket = reinterpret_cast<unsigned*>(part_i + kBlocks);
  launch(argmax_kernel, std::min(kBlocks, ceil_div(n, kThreads)), kThreads, 0, st, x, n, part_v, part_i, ticket, out);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
