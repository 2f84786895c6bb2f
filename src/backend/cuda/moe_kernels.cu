// Router (sigmoid with correction bias, or softmax; group-limited top-k), the shared expert's sigmoid gate, grouped
// expert GEMVs for decode, and the weighted combine of expert outputs.
#include <cmath>

#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"

namespace moesrv::cuda {

namespace {

// One block per token; the selection itself is serial (E <= a few hundred, k <= 16): exact and tie-stable
// (equal scores go to the lower index), like the CPU router.
__global__ void route_kernel(const float* logits, const float* bias, RouterArgs a, int32_t* ids, float* weights) {
  extern __shared__ float sm[];
  float* score = sm;         // sigmoid(logit), or the softmax probability
  float* choice = sm + a.E;  // score (+ bias when sigmoid), -inf outside the kept groups
  const int s = blockIdx.x;
  const float* lg = logits + int64_t(s) * a.E;
  if (a.softmax) {  // as route_token: max, exp(l - max), the sum in double in expert order, then the quotients
    __shared__ float mx;
    __shared__ double sum;
    if (threadIdx.x == 0) {
      float m = lg[0];
      for (int e = 1; e < a.E; ++e) m = fmaxf(m, lg[e]);
      mx = m;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < a.E; e += blockDim.x) score[e] = expf(lg[e] - mx);
    __syncthreads();
    if (threadIdx.x == 0) {
      double t = 0;
      for (int e = 0; e < a.E; ++e) t += score[e];
      sum = t;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < a.E; e += blockDim.x) choice[e] = score[e] = float(double(score[e]) / sum);
  } else {
    for (int e = threadIdx.x; e < a.E; e += blockDim.x) {
      const float v = 1.0f / (1.0f + expf(-lg[e]));
      score[e] = v;
      choice[e] = v + bias[e];
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int per = a.E / a.groups;
  if (a.groups > 1) {
    unsigned long long kept = 0;  // groups <= 64
    for (int pick = 0; pick < a.topk_groups; ++pick) {
      int best = -1;
      float best_v = -INFINITY;
      for (int g = 0; g < a.groups; ++g) {
        if (kept >> g & 1ull) continue;
        float m1 = -INFINITY, m2 = -INFINITY;
        for (int e = g * per; e < (g + 1) * per; ++e) {
          const float v = choice[e];
          if (v > m1) m2 = m1, m1 = v;
          else if (v > m2) m2 = v;
        }
        const float gs = m1 + (per > 1 ? m2 : 0.0f);
        if (best < 0 || gs > best_v) best = g, best_v = gs;
      }
      kept |= 1ull << best;
    }
    for (int e = 0; e < a.E; ++e)
      if (!(kept >> (e / per) & 1ull)) choice[e] = -INFINITY;
  }
  float sum = 0.0f;
  int32_t* out_ids = ids + int64_t(s) * a.k;
  float* out_w = weights + int64_t(s) * a.k;
  for (int j = 0; j < a.k; ++j) {
    int best = -1;
    for (int e = 0; e < a.E; ++e) {
      bool taken = false;
      for (int p = 0; p < j; ++p) taken |= out_ids[p] == e;
      if (taken) continue;
      if (best < 0 || choice[e] > choice[best]) best = e;
    }
    out_ids[j] = best;
    out_w[j] = score[best];
    sum += score[best];
  }
  for (int j = 0; j < a.k; ++j) {
    float w = out_w[j];
    if (a.norm_topk) w /= (sum + 1e-20f);
    out_w[j] = w * a.scaling;
  }
}

// Block per token: y[s] *= sigmoid(x[s] . w).
__global__ void shared_gate_kernel(const float* x, const float* w, int D, float* y) {
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
  const int entry = blockIdx.y, warp = threadIdx.x >> 5, row = blockIdx.x * kGemvWarps + warp;
  if (row >= rows) return;
  const uint16_t* w = mats[ids[entry]] + int64_t(row) * cols;
  const float v = warp_dot_bf16(w, x + int64_t(entry / x_div) * x_stride, cols);
  if ((threadIdx.x & 31) == 0) y[int64_t(entry) * rows + row] = v;
}

__global__ void combine_kernel(float* out, const float* y, const int32_t* rowmap, const float* weights,
                               const float* extra, int k, int D) {
  const int s = blockIdx.x;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float v = out[int64_t(s) * D + d] + (extra ? extra[int64_t(s) * D + d] : 0.0f);
    for (int j = 0; j < k; ++j) {
      const int e = s * k + j, row = rowmap ? rowmap[e] : e;
      if (row >= 0) v += weights[e] * y[int64_t(row) * D + d];
    }
    out[int64_t(s) * D + d] = v;
  }
}

}  // namespace

void route(const float* logits, const float* bias, int S, const RouterArgs& a, int32_t* ids, float* weights,
           cudaStream_t st) {
  if (a.groups > 64 || a.E % a.groups != 0) throw std::runtime_error("route: " + std::to_string(a.E) + " experts in " + std::to_string(a.groups) + " groups is not supported");
  route_kernel<<<S, 256, size_t(2 * a.E) * sizeof(float), st>>>(logits, bias, a, ids, weights);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void shared_expert_gate(const float* x, const float* w, int S, int D, float* y, cudaStream_t st) {
  if (S == 0) return;
  shared_gate_kernel<<<S, 256, 0, st>>>(x, w, D, y);
  MOESRV_CUDA_LAUNCH_CHECK();
}

namespace {
__global__ void count_experts_kernel(const int32_t* ids, int n, int S, uint32_t* counts, uint32_t* tokens) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    atomicAdd(&counts[ids[i]], 1u);
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(tokens, uint32_t(S));
}
}  // namespace

void count_experts(const int32_t* ids, int S, int k, uint32_t* counts, uint32_t* tokens, cudaStream_t st) {
  const int n = S * k;
  if (n == 0) return;
  count_experts_kernel<<<std::min(ceil_div(n, 256), 64), 256, 0, st>>>(ids, n, S, counts, tokens);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void moe_gemv(const float* x, const int32_t* ids, int S, int k, int D, int I, const uint16_t* const* gate_up,
              const uint16_t* const* down, float* gu_scratch, float* act, float* y, cudaStream_t st, float limit) {
  const int entries = S * k;
  expert_gemv_kernel<<<dim3(ceil_div(2 * I, kGemvWarps), entries), kGemvWarps * 32, 0, st>>>(x, D, k, ids, gate_up,
                                                                                              2 * I, D, gu_scratch);
  MOESRV_CUDA_LAUNCH_CHECK();
  silu_mul_clamped(gu_scratch, entries, I, limit, act, st);
  expert_gemv_kernel<<<dim3(ceil_div(D, kGemvWarps), entries), kGemvWarps * 32, 0, st>>>(act, I, 1, ids, down, D, I, y);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void moe_combine(float* out, const float* y, const int32_t* rowmap, const float* weights, const float* extra, int S,
                 int k, int D, cudaStream_t st) {
  combine_kernel<<<S, 256, 0, st>>>(out, y, rowmap, weights, extra, k, D);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
