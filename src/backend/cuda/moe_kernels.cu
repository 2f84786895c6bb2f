// Router (sigmoid with correction bias, or softmax; group-limited top-k), the shared expert's sigmoid gate, grouped
// expert GEMVs for decode, and the weighted combine of expert outputs.
#include <cmath>

#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kRouteWarps = 4;        // tokens per block of the router (one warp each)
constexpr int kRouteMaxPerLane = 32;  // experts per lane (E <= 1024): the lane's taken-bit mask

// Warp argmax step: (v, i) against the lane `o` away; the larger score wins, equal scores go to the lower index, an
// empty candidate (i < 0) always loses. This is the serial scan's rule (the first maximum in index order).
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (oi >= 0 && (i < 0 || ov > v || (ov == v && oi < i))) v = ov, i = oi;
  }
}

// One warp per token (kRouteWarps tokens per block). Lane l owns experts l, l+32, ...; every choice is a warp argmax
// over the lanes' best candidates, so the result is the CPU router's (route_token): ties to the lower index.
__global__ void __launch_bounds__(kRouteWarps * 32)
    route_kernel(const float* logits, const float* bias, int S, RouterArgs a, int32_t* ids, float* weights) {
  pdl_enter();
  extern __shared__ float sm[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, s = blockIdx.x * kRouteWarps + warp;
  if (s >= S) return;                         // warp-uniform; no block barrier below
  float* score = sm + warp * (2 * a.E + 64);  // sigmoid(logit), or the softmax probability
  float* choice = score + a.E;                // score (+ bias when sigmoid), -inf outside the kept groups
  float* gscore = choice + a.E;               // group scores (<= 64 groups)
  const float* lg = logits + int64_t(s) * a.E;
  if (a.softmax) {  // as route_token: max, exp(l - max), the sum in double in expert order, then the quotients
    float m = -INFINITY;
    for (int e = lane; e < a.E; e += 32) m = fmaxf(m, lg[e]);
    m = warp_max(m);
    for (int e = lane; e < a.E; e += 32) score[e] = expf(lg[e] - m);
    __syncwarp();
    double sum = 0;
    if (lane == 0)
      for (int e = 0; e < a.E; ++e) sum += score[e];
    sum = __shfl_sync(0xffffffffu, sum, 0);
    for (int e = lane; e < a.E; e += 32) choice[e] = score[e] = float(double(score[e]) / sum);
  } else {
    for (int e = lane; e < a.E; e += 32) {
      const float v = 1.0f / (1.0f + expf(-lg[e]));
      score[e] = v;
      choice[e] = v + bias[e];
    }
  }
  __syncwarp();
  if (a.groups > 1) {
    const int per = a.E / a.groups;
    for (int g = lane; g < a.groups; g += 32) {  // group score: the two best choices of the group
      float m1 = -INFINITY, m2 = -INFINITY;
      for (int e = g * per; e < (g + 1) * per; ++e) {
        const float v = choice[e];
        if (v > m1) m2 = m1, m1 = v;
        else if (v > m2) m2 = v;
      }
      gscore[g] = m1 + (per > 1 ? m2 : 0.0f);
    }
    __syncwarp();
    unsigned long long kept = 0;  // groups <= 64
    for (int pick = 0; pick < a.topk_groups; ++pick) {
      float v = -INFINITY;
      int i = -1;
      for (int g = lane; g < a.groups; g += 32)
        if (!(kept >> g & 1ull) && (i < 0 || gscore[g] > v)) v = gscore[g], i = g;
      warp_argmax(v, i);
      kept |= 1ull << i;
    }
    for (int e = lane; e < a.E; e += 32)
      if (!(kept >> (e / per) & 1ull)) choice[e] = -INFINITY;
    __syncwarp();
  }
  uint32_t taken = 0;  // bit j: expert lane + 32 j is chosen
  float my_w = 0.0f, sum = 0.0f;
  int my_id = -1;
  for (int j = 0; j < a.k; ++j) {
    float v = -INFINITY;
    int i = -1;
    for (int e = lane, b = 0; e < a.E; e += 32, ++b)
      if (!(taken >> b & 1u) && (i < 0 || choice[e] > v)) v = choice[e], i = e;
    warp_argmax(v, i);
    if ((i & 31) == lane) taken |= 1u << (i >> 5);
    const float w = score[i];
    sum += w;  // in pick order, as the CPU
    if (lane == j) my_w = w, my_id = i;
  }
  const int row = a.k + (a.shared_id >= 0 ? 1 : 0), first = row - a.k;
  if (lane < a.k) {
    float w = my_w;
    if (a.norm_topk) w /= (sum + 1e-20f);
    ids[int64_t(s) * row + first + lane] = my_id;
    weights[int64_t(s) * row + first + lane] = w * a.scaling;
    if (a.counts) atomicAdd(&a.counts[my_id], 1u);
  }
  if (lane == 0 && first) {
    ids[int64_t(s) * row] = a.shared_id;
    weights[int64_t(s) * row] = 1.0f;
  }
  if (lane == 0 && s == 0 && a.tokens) atomicAdd(a.tokens, uint32_t(S));
}

// Block per token: y[s] *= sigmoid(x[s] . w).
__global__ void shared_gate_kernel(const float* x, const float* w, int D, float* y) {
  pdl_enter();
  const int64_t s = blockIdx.x;
  float acc = 0.0f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) acc += x[s * D + d] * w[d];
  const float g = 1.0f / (1.0f + expf(-block_sum(acc)));
  for (int d = threadIdx.x; d < D; d += blockDim.x) y[s * D + d] *= g;
}

constexpr int kGemvWarps = 8;

// Block (row tile, entry): warp per output row of the entry's expert matrix.
__global__ void expert_gemv_kernel(const float* x, int64_t x_stride, int x_div, const int32_t* ids,
                                   const uint16_t* const* mats, int rows, int cols, float* y) {
  pdl_enter();
  const int entry = blockIdx.y, warp = threadIdx.x >> 5, row = blockIdx.x * kGemvWarps + warp;
  if (row >= rows) return;
  const uint16_t* w = mats[ids[entry]] + int64_t(row) * cols;
  const float v = warp_dot_bf16(w, x + int64_t(entry / x_div) * x_stride, cols);
  if ((threadIdx.x & 31) == 0) y[int64_t(entry) * rows + row] = v;
}

__global__ void combine_kernel(float* out, const float* y, const int32_t* rowmap, const float* weights,
                               const float* extra, int k, int D, bool overwrite, int row_lo, int row_hi) {
  pdl_enter();
  const int s = blockIdx.y;
  if (!overwrite && !extra) {  // a token with no entry in this wave keeps its row
    bool any = false;
    for (int j = 0; j < k; ++j) {
      const int row = rowmap ? rowmap[s * k + j] : s * k + j;
      any |= row >= row_lo && row < row_hi;
    }
    if (!any) return;
  }
  for (int d = blockIdx.x * blockDim.x + threadIdx.x; d < D; d += gridDim.x * blockDim.x) {
    float v = (overwrite ? 0.0f : out[int64_t(s) * D + d]) + (extra ? extra[int64_t(s) * D + d] : 0.0f);
    for (int j = 0; j < k; ++j) {
      const int e = s * k + j, row = rowmap ? rowmap[e] : e;
      if (row >= row_lo && row < row_hi) v += weights[e] * y[int64_t(row - row_lo) * D + d];
    }
    out[int64_t(s) * D + d] = v;
  }
}

}  // namespace

void route(const float* logits, const float* bias, int S, const RouterArgs& a, int32_t* ids, float* weights,
           cudaStream_t st) {
  if (a.groups < 1 || a.groups > 64 || a.E % a.groups != 0 || a.E > 32 * kRouteMaxPerLane || a.topk_groups < 1 ||
      a.topk_groups > a.groups || a.k < 1 || a.k > 32 || a.k > a.E)
    throw std::runtime_error("route: " + std::to_string(a.E) + " experts in " + std::to_string(a.groups) +
                             " groups, top-" + std::to_string(a.k) + " is not supported");
  if (S <= 0) return;
  const size_t smem = size_t(kRouteWarps) * (2 * a.E + 64) * sizeof(float);
  launch(route_kernel, ceil_div(S, kRouteWarps), kRouteWarps * 32, smem, st, logits, bias, S, a, ids, weights);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void shared_expert_gate(const float* x, const float* w, int S, int D, float* y, cudaStream_t st) {
  if (S == 0) return;
  launch(shared_gate_kernel, S, 256, 0, st, x, w, D, y);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void moe_gemv(const float* x, const int32_t* ids, int S, int k, int D, int I, const uint16_t* const* gate_up,
              const uint16_t* const* down, float* gu_scratch, float* act, float* y, cudaStream_t st, float limit) {
  const int entries = S * k;
  launch(expert_gemv_kernel, dim3(ceil_div(2 * I, kGemvWarps), entries), kGemvWarps * 32, 0, st, x, D, k, ids, gate_up,
         2 * I, D, gu_scratch);
  MOESRV_CUDA_LAUNCH_CHECK();
  silu_mul_clamped(gu_scratch, entries, I, limit, act, st);
  launch(expert_gemv_kernel, dim3(ceil_div(D, kGemvWarps), entries), kGemvWarps * 32, 0, st, act, I, 1, ids, down, D, I,
         y);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void moe_combine(float* out, const float* y, const int32_t* rowmap, const float* weights, const float* extra, int S,
                 int k, int D, cudaStream_t st, bool overwrite, int row_lo, int row_hi) {
  if (S <= 0) return;
  if (row_lo < 0) throw std::runtime_error("moe_combine: negative first row");
  launch(combine_kernel, dim3(unsigned(ceil_div(D, 256)), unsigned(S)), 256, 0, st, out, y, rowmap, weights, extra, k,
         D, overwrite, row_lo, row_hi);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
