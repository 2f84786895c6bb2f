// Router (sigmoid with correction bias, or softmax; group-limited top-k; for decode also fused with its fp32 logits),
// the shared expert's sigmoid gate, grouped expert GEMVs for decode, and the weighted combine of expert outputs.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kRouteWarps = 4;        // tokens per block of the router (one warp each)
constexpr int kRouteMaxPerLane = 32;  // experts per lane (E <= 1024): the lane's taken-bit mask

// A float's order as an unsigned key (larger float, larger key; -0 as +0, so equal floats have equal keys); every
// key is above 0, which stands for no candidate.
__device__ __forceinline__ uint32_t order_key(float v) {
  uint32_t u = __float_as_uint(v);
  if (u == 0x80000000u) u = 0;
  return u & 0x80000000u ? ~u : u | 0x80000000u;
}

// Warp argmax step: (v, i) against the lane `o` away; the larger score wins, equal scores go to the lower index, an
// empty candidate (i < 0) always loses. This is the serial scan's rule (the first maximum in index order).
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (oi >= 0 && (i < 0 || ov > v || (ov == v && oi < i))) v = ov, i = oi;
  }
}

// Routes token s with one warp (lanes own experts l, l+32, ...; every choice is a warp argmax over the lanes' best
// candidates, so the result is the CPU router's, route_token: ties to the lower index). lg: the token's E logits;
// sm: 2E + 64 floats of the warp's shared memory. lg may be sm itself (each lane reads lg[e] only before it writes
// sm[e], the same e).
__device__ void route_warp(const float* lg, const float* bias, int s, int S, const RouterArgs& a, float* sm,
                           int32_t* ids, float* weights) {
  const int lane = threadIdx.x & 31;
  float* score = sm;             // sigmoid(logit), or the softmax probability
  float* choice = score + a.E;   // score (+ bias when sigmoid), -inf outside the kept groups
  float* gscore = choice + a.E;  // group scores (<= 64 groups)
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
      for (int g = lane; g < a.groups; g += 32) {
        const float c = gscore[g];
        if (!(kept >> g & 1ull) && (i < 0 || c > v)) v = c, i = g;
      }
      warp_argmax(v, i);
      kept |= 1ull << i;
    }
    for (int e = lane; e < a.E; e += 32)
      if (!(kept >> (e / per) & 1ull)) choice[e] = -INFINITY;
    __syncwarp();
  }
  // Each lane keeps its best untaken candidate (the first maximum in index order); a pick is the warp's largest key,
  // then the lowest index holding it (two warp reductions); only the winning lane rescans its candidates.
  uint32_t taken = 0;  // bit j: expert lane + 32 j is chosen
  float bv = -INFINITY;
  int bi = -1;
  auto rescan = [&] {
    bv = -INFINITY, bi = -1;
    for (int e = lane, b = 0; e < a.E; e += 32, ++b) {
      const float c = choice[e];  // loaded unconditionally: the loads pipeline
      if (!(taken >> b & 1u) && (bi < 0 || c > bv)) bv = c, bi = e;
    }
  };
  rescan();
  int my_id = -1;
  for (int j = 0; j < a.k; ++j) {
    const uint32_t key = bi < 0 ? 0u : order_key(bv);
    const uint32_t top = __reduce_max_sync(0xffffffffu, key);
    const int i = int(__reduce_min_sync(0xffffffffu, bi >= 0 && key == top ? uint32_t(bi) : 0xffffffffu));
    if ((i & 31) == lane) {
      taken |= 1u << (i >> 5);
      rescan();
    }
    if (lane == j) my_id = i;
  }
  const float my_w = lane < a.k ? score[my_id] : 0.0f;
  float sum = 0.0f;
  for (int j = 0; j < a.k; ++j) sum += __shfl_sync(0xffffffffu, my_w, j);  // in pick order, as the CPU
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

// One warp per token (kRouteWarps tokens per block).
__global__ void __launch_bounds__(kRouteWarps * 32)
    route_kernel(const float* logits, const float* bias, int S, RouterArgs a, int32_t* ids, float* weights) {
  pdl_enter();
  extern __shared__ float sm[];
  const int warp = threadIdx.x >> 5, s = blockIdx.x * kRouteWarps + warp;
  if (s >= S) return;  // warp-uniform; no block barrier below
  route_warp(logits + int64_t(s) * a.E, bias, s, S, a, sm + warp * (2 * a.E + 64), ids, weights);
}

// route_fused: block (bx, by) = 8 router rows (a warp each) x one slice of kFusedCols columns. Lane l holds the
// float4s l + 32 j (j < 8) of its row's slice, loaded before pdl_enter (the router is a weight). The slice of the S
// hidden rows is staged in shared memory; part[by][s][e] = the slice's dot. The last block to draw a ticket resets
// it, adds the slices in order into shared memory and routes token s with warp s (route_warp).
constexpr int kFusedWarps = 8, kFusedVec = 8, kFusedCols = 32 * 4 * kFusedVec;
static_assert(kFusedCols == 4 * kFusedWarps * 32 && kFusedVec == 8 && kRouteFusedMaxTokens <= 32,
              "route_fused_kernel: a float4 of each hidden row per thread, 8 float4s of a router row per lane");

__global__ void __launch_bounds__(kFusedWarps * 32)
    route_fused_kernel(const float* router, const float* h, const float* bias, int S, int D, RouterArgs a, float* part,
                       unsigned* ticket, int32_t* ids, float* weights) {
  extern __shared__ __align__(16) float sm[];
  __shared__ bool last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, e = blockIdx.x * kFusedWarps + warp;
  const int c0 = blockIdx.y * kFusedCols;
  float4 w[kFusedVec];
#pragma unroll
  for (int j = 0; j < kFusedVec; ++j) {
    const int c = c0 + 4 * (lane + 32 * j);
    w[j] = e < a.E && c < D ? __ldg(reinterpret_cast<const float4*>(router + int64_t(e) * D + c))
                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  // the bias (a weight) into L2 for whichever block routes
  if (blockIdx.y == 0 && lane == 0 && e < a.E && e % 32 == 0 && !a.softmax)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(bias + e));
  pdl_enter();
  float4* hs = reinterpret_cast<float4*>(sm);  // [S][kFusedCols / 4]: thread t stages float4 t of each row
  float4 hv[kRouteFusedMaxTokens];
  const int ct = c0 + 4 * threadIdx.x;
#pragma unroll
  for (int s = 0; s < kRouteFusedMaxTokens; ++s)
    hv[s] = s < S && ct < D ? *reinterpret_cast<const float4*>(h + int64_t(s) * D + ct)
                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int s = 0; s < kRouteFusedMaxTokens; ++s)
    if (s < S) hs[s * (kFusedCols / 4) + threadIdx.x] = hv[s];
  __syncthreads();
  if (e < a.E) {  // warp-uniform
    float acc[kRouteFusedMaxTokens];
#pragma unroll
    for (int s = 0; s < kRouteFusedMaxTokens; ++s) {
      acc[s] = 0.0f;
      if (s < S) {
        float d[kFusedVec];
#pragma unroll
        for (int j = 0; j < kFusedVec; ++j) {
          const float4 x = hs[s * (kFusedCols / 4) + lane + 32 * j];
          d[j] = w[j].x * x.x + w[j].y * x.y + w[j].z * x.z + w[j].w * x.w;
        }
        acc[s] = ((d[0] + d[1]) + (d[2] + d[3])) + ((d[4] + d[5]) + (d[6] + d[7]));
      }
    }
    if (S == 1) {
      acc[0] = warp_sum(acc[0]);
    } else {  // the tokens' shuffle rounds interleaved
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int s = 0; s < kRouteFusedMaxTokens; ++s) acc[s] += __shfl_xor_sync(0xffffffffu, acc[s], o);
    }
#pragma unroll
    for (int s = 0; s < kRouteFusedMaxTokens; ++s)
      if (lane == s && s < S) part[(int64_t(blockIdx.y) * S + s) * a.E + e] = acc[s];
  }
  __threadfence();  // the partial sums before the ticket
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x * gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) *ticket = 0;  // every block has drawn: ready for the next launch (graph replays)
  // Logits (the slices added in order) into each token's score array, the bias after the S arrays. A thread takes 4
  // entries at a time, indices clamped so that the loads are unconditional and in flight together.
  const int n = S * a.E, span = 2 * a.E + 64, threads = kFusedWarps * 32;
  float* bias_s = sm + S * span;
  for (int i0 = threadIdx.x; i0 < n; i0 += 4 * threads) {
    int i[4];
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f}, b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int u = 0; u < 4; ++u) i[u] = min(i0 + u * threads, n - 1);
    if (!a.softmax)
#pragma unroll
      for (int u = 0; u < 4; ++u) b[u] = bias[min(i[u], a.E - 1)];
    for (int y = 0; y < int(gridDim.y); ++y) {
      const float* p = part + int64_t(y) * n;
      float t[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) t[u] = __ldcg(p + i[u]);
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] += t[u];
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (i0 + u * threads < n) sm[(i[u] / a.E) * span + i[u] % a.E] = v[u];
      if (i0 + u * threads < a.E) bias_s[i[u]] = b[u];
    }
  }
  __syncthreads();
  if (warp >= S) return;  // warp-uniform; no block barrier below
  float* lg = sm + warp * span;
  route_warp(lg, bias_s, warp, S, a, lg, ids, weights);
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

// Block (column chunk, token): the token's k entries (row, weight) go to shared memory once, then each thread adds
// V adjacent columns at a time (V = 4: 16-byte rows). The sums run in entry order, as the CPU's.
constexpr int kCombineThreads = 256, kCombineMaxK = 64;
__device__ __forceinline__ float vec_add(float a, float b) { return a + b; }
__device__ __forceinline__ float4 vec_add(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}
__device__ __forceinline__ float vec_fma(float w, float y, float v) { return fmaf(w, y, v); }
__device__ __forceinline__ float4 vec_fma(float w, float4 y, float4 v) {
  return make_float4(fmaf(w, y.x, v.x), fmaf(w, y.y, v.y), fmaf(w, y.z, v.z), fmaf(w, y.w, v.w));
}
template <int V>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(float* out, const float* y, const int32_t* rowmap, const float* weights, const float* extra, int k,
                   int D, int cols, bool overwrite, int row_lo, int row_hi, const int32_t* tokens) {
  pdl_enter();
  using Vec = std::conditional_t<V == 4, float4, float>;
  __shared__ int row_s[kCombineMaxK];
  __shared__ float w_s[kCombineMaxK];
  const int s = tokens ? tokens[blockIdx.y] : blockIdx.y;
  bool mine = false;
  if (threadIdx.x < k) {
    const int e = s * k + threadIdx.x, row = rowmap ? rowmap[e] : e;
    mine = row >= row_lo && row < row_hi;
    row_s[threadIdx.x] = mine ? row - row_lo : -1;
    w_s[threadIdx.x] = mine ? weights[e] : 0.0f;
  }
  // a token with no entry in this wave keeps its row
  if (!__syncthreads_or(mine) && !overwrite && !extra) return;
  const int d1 = min(D, (blockIdx.x + 1) * cols);
  for (int d = blockIdx.x * cols + threadIdx.x * V; d < d1; d += kCombineThreads * V) {
    const int64_t o = int64_t(s) * D + d;
    Vec v = overwrite ? Vec{} : *reinterpret_cast<const Vec*>(out + o);
    if (extra) v = vec_add(v, *reinterpret_cast<const Vec*>(extra + o));
    for (int j = 0; j < k; ++j)
      if (const int r = row_s[j]; r >= 0) v = vec_fma(w_s[j], *reinterpret_cast<const Vec*>(y + int64_t(r) * D + d), v);
    *reinterpret_cast<Vec*>(out + o) = v;
  }
}

void check_router(const RouterArgs& a, const char* who) {
  if (a.groups < 1 || a.groups > 64 || a.E % a.groups != 0 || a.E > 32 * kRouteMaxPerLane || a.topk_groups < 1 ||
      a.topk_groups > a.groups || a.k < 1 || a.k > 32 || a.k > a.E)
    throw std::runtime_error(std::string(who) + ": " + std::to_string(a.E) + " experts in " + std::to_string(a.groups) +
                             " groups, top-" + std::to_string(a.k) + " is not supported");
}

size_t route_fused_smem(int S, int E) {
  return std::max(size_t(S) * kFusedCols, size_t(S) * (2 * E + 64) + size_t(E)) * sizeof(float);
}

__global__ void write_ints_kernel(IntWrites w) {
  pdl_enter();
  int off = 0;
  for (int a = 0; a < 4; ++a) {
    for (int i = threadIdx.x; i < w.n[a]; i += blockDim.x) w.dst[a][i] = w.v[off + i];
    off += w.n[a];
  }
}

}  // namespace

void write_ints(const IntWrites& w, cudaStream_t st) {
  int total = 0;
  for (int a = 0; a < 4; ++a) {
    if (w.n[a] < 0 || (w.n[a] > 0 && !w.dst[a])) throw std::runtime_error("write_ints: bad array");
    total += w.n[a];
  }
  if (total > kIntWritesMax) throw std::runtime_error("write_ints: " + std::to_string(total) + " values");
  if (total == 0) return;
  launch(write_ints_kernel, 1, 256, 0, st, w);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void route(const float* logits, const float* bias, int S, const RouterArgs& a, int32_t* ids, float* weights,
           cudaStream_t st) {
  check_router(a, "route");
  if (S <= 0) return;
  const size_t smem = size_t(kRouteWarps) * (2 * a.E + 64) * sizeof(float);
  launch(route_kernel, ceil_div(S, kRouteWarps), kRouteWarps * 32, smem, st, logits, bias, S, a, ids, weights);
  MOESRV_CUDA_LAUNCH_CHECK();
}

bool route_fused_supported(int S, int E, int D, const float* router, const float* h) {
  return S >= 1 && S <= kRouteFusedMaxTokens && E >= 1 && D >= 4 && D % 4 == 0 && aligned16(router) && aligned16(h);
}

size_t route_fused_floats(int S, int E, int D) { return size_t(ceil_div(D, kFusedCols)) * size_t(S) * size_t(E); }

void route_fused(const float* router, const float* h, const float* bias, int S, int D, const RouterArgs& a, float* part,
                 unsigned* ticket, int32_t* ids, float* weights, cudaStream_t st) {
  check_router(a, "route_fused");
  if (!route_fused_supported(S, a.E, D, router, h))
    throw std::runtime_error("route_fused: " + std::to_string(S) + " tokens of width " + std::to_string(D) +
                             " (or unaligned rows) are not supported");
  const size_t smem = route_fused_smem(S, a.E);
  if (smem > 48 * 1024) reserve_dynamic_smem(route_fused_kernel, smem, "route_fused");
  launch(route_fused_kernel, dim3(ceil_div(a.E, kFusedWarps), ceil_div(D, kFusedCols)), kFusedWarps * 32, smem, st,
         router, h, bias, S, D, a, part, ticket, ids, weights);
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
                 int k, int D, cudaStream_t st, bool overwrite, int row_lo, int row_hi, const int32_t* tokens,
                 int n_tokens) {
  const int blocks_y = tokens ? n_tokens : S;
  if (S <= 0 || blocks_y <= 0) return;
  if (row_lo < 0) throw std::runtime_error("moe_combine: negative first row");
  if (k < 0 || k > kCombineMaxK) throw std::runtime_error("moe_combine: " + std::to_string(k) + " entries per token");
  const bool vec = D % 4 == 0 && aligned16(out) && aligned16(y) && aligned16(extra);
  // a block per token and column chunk: a few chunks of a row when tokens are few (decode), the whole row otherwise
  const int cols = blocks_y >= 256 ? D : kCombineThreads * (vec ? 4 : 1);
  const dim3 grid(unsigned(ceil_div(D, cols)), unsigned(blocks_y));
  if (vec)
    launch(combine_kernel<4>, grid, kCombineThreads, 0, st, out, y, rowmap, weights, extra, k, D, cols, overwrite,
           row_lo, row_hi, tokens);
  else
    launch(combine_kernel<1>, grid, kCombineThreads, 0, st, out, y, rowmap, weights, extra, k, D, cols, overwrite,
           row_lo, row_hi, tokens);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
