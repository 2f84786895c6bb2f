// KDA / Gated DeltaNet kernels: short causal conv + SiLU, l2norm, KDA gates, the gated delta rule recurrence and
// the sigmoid-gated output RMSNorm. fp32 throughout; see glm5_next_kernels.h and src/backend/cpu/delta_rule.h.
#include <cmath>
#include <string>

#include "backend/cuda/glm5_next_kernels.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

namespace {

__device__ __forceinline__ float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

int grid_1d(int64_t n, int threads) { return int(std::min<int64_t>((n + threads - 1) / threads, 65535)); }

// ---- causal conv1d + SiLU: one thread per (token, channel); then the state update, one thread per channel.
__global__ void conv1d_silu_kernel(const float* x, int64_t x_stride, int T, int C, const float* w, int K,
                                   const float* state, float* y) {
  pdl_enter();
  const int64_t n = int64_t(T) * C;
  const int P = K - 1;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int t = int(idx / C), c = int(idx % C);
    float acc = 0.0f;
    for (int j = 0; j < K; ++j) {
      const int i = t - P + j;  // input row; < 0 reads the carried state
      const float xv = i < 0 ? state[int64_t(P + i) * C + c] : x[int64_t(i) * x_stride + c];
      acc += w[int64_t(c) * K + j] * xv;
    }
    y[idx] = acc / (1.0f + expf(-acc));
  }
}

// The same sums for prefill: a thread owns 4 adjacent channels of kConvTokens consecutive tokens and slides the
// window of its last K inputs through registers, so each input row is read about once (the kernel above re-reads
// it K times and spends most of its time on 64-bit index division). x, y, the state and x_stride are 16-byte aligned
// with C % 4 == 0 (conv_vec_ok). Same products in the same order as conv1d_silu_kernel: bit-identical.
constexpr int kConvTokens = 16, kConvThreads = 128;
template <int K>
__global__ void __launch_bounds__(kConvThreads) conv1d_silu_vec_kernel(const float* x, int64_t x_stride, int T, int C,
                                                                       const float* w, const float* state, float* y) {
  pdl_enter();
  constexpr int P = K - 1;
  const int c = (blockIdx.x * kConvThreads + threadIdx.x) * 4, t0 = blockIdx.y * kConvTokens;
  if (c >= C) return;
  float wk[4][K];
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int j = 0; j < K; ++j) wk[q][j] = w[int64_t(c + q) * K + j];
  auto input = [&](int i) {  // input row i at channels c..c+3; < 0 reads the carried state
    return *reinterpret_cast<const float4*>(i < 0 ? state + int64_t(P + i) * C + c : x + int64_t(i) * x_stride + c);
  };
  float4 win[K];  // win[j] = input row t - P + j
#pragma unroll
  for (int j = 0; j < P; ++j) win[j] = input(t0 - P + j);
  const int t1 = min(T, t0 + kConvTokens);
  for (int t = t0; t < t1; ++t) {
    win[P] = input(t);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const float v[4] = {win[j].x, win[j].y, win[j].z, win[j].w};
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[q] += wk[q][j] * v[q];
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[q] = acc[q] / (1.0f + expf(-acc[q]));
    *reinterpret_cast<float4*>(y + int64_t(t) * C + c) = make_float4(acc[0], acc[1], acc[2], acc[3]);
#pragma unroll
    for (int j = 0; j < P; ++j) win[j] = win[j + 1];
  }
}

bool conv_vec_ok(const float* x, int64_t x_stride, int C, const float* state, const float* y) {
  return C % 4 == 0 && x_stride % 4 == 0 && aligned16(x) && aligned16(state) && aligned16(y);
}

__global__ void conv1d_state_kernel(const float* x, int64_t x_stride, int T, int C, int K, float* state) {
  pdl_enter();
  const int P = K - 1;
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x) {
    // Ascending r: row r reads old row r + T (> r, not yet overwritten) or input row T - P + r.
    for (int r = 0; r < P; ++r) {
      const int i = T - P + r;
      state[int64_t(r) * C + c] = i < 0 ? state[int64_t(r + T) * C + c] : x[int64_t(i) * x_stride + c];
    }
  }
}

// Rollback points of the conv: step t [K-1][C] = the last K-1 inputs after row t (older ones from the state).
__global__ void conv_steps_kernel(const float* x, int64_t x_stride, int T, int C, int K, const float* state,
                                  float* steps) {
  pdl_enter();
  const int P = K - 1;
  const int64_t n = int64_t(T - 1) * P * C;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(idx % C), r = int(idx / C % P), t = int(idx / (int64_t(P) * C));
    const int i = t + 1 - P + r;  // input row; < 0: the state before x
    steps[idx] = i < 0 ? state[int64_t(P + i) * C + c] : x[int64_t(i) * x_stride + c];
  }
}

// state [H][dk][dv] from a delta-rule step [H][dv][dk].
__global__ void state_from_step_kernel(const float* step, int H, int dk, int dv, float* state) {
  pdl_enter();
  const int64_t n = int64_t(H) * dk * dv;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = idx % dv, c = idx / dv % dk, h = idx / (int64_t(dk) * dv);
    state[idx] = step[(h * dv + j) * dk + c];
  }
}

// ---- l2norm: one warp per row.
__global__ void l2norm_kernel(float* x, int tokens, int heads, int64_t token_stride, int n, float eps, float scale) {
  pdl_enter();
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= int64_t(tokens) * heads) return;  // whole warps leave together
  float* p = x + (row / heads) * token_stride + (row % heads) * n;
  float ss = 0.0f;
  for (int i = lane; i < n; i += 32) ss += p[i] * p[i];
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(ss + eps);
  for (int i = lane; i < n; i += 32) p[i] = p[i] * inv * scale;
}

// ---- KDA gates: one thread per g element; the first S*H threads also do beta.
__global__ void kda_gates_kernel(float* g, const float* dt_bias, const float* a_log, int S, int H, int d,
                                 bool lower_bound_set, float lower_bound, float* beta) {
  pdl_enter();
  const int64_t n = int64_t(S) * H * d, nb = int64_t(S) * H;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t hd = idx % (int64_t(H) * d);
    const int h = int(hd / d);
    const float rate = expf(a_log[h]);
    const float f = g[idx] + dt_bias[hd];
    const float softplus = f > 20.0f ? f : log1pf(expf(f));
    g[idx] = lower_bound_set ? lower_bound * sigmoidf(rate * f) : -rate * softplus;
    if (beta && idx < nb) beta[idx] = sigmoidf(beta[idx]);  // nb <= n
  }
}

// ---- gated delta rule. Columns j of a head's state are independent: one warp per (head, column), each lane holds
// R = dk/32 state rows (c = lane + 32 i). A block of kDrWarps warps shares one head and kDrWarps adjacent columns
// (one 32-byte sector per state row, moved through shared memory so that global accesses are whole sectors); token
// rows of q, k, exp(g) and beta are staged in shared memory kDrTokens at a time.
constexpr int kDrWarps = 8, kDrTokens = 8;

template <int R>
__global__ void __launch_bounds__(kDrWarps * 32) delta_rule_kernel(DeltaRuleArgs a) {
  pdl_enter();
  constexpr int dk = 32 * R;
  __shared__ float q_s[kDrTokens][dk], k_s[kDrTokens][dk], e_s[kDrTokens][dk], b_s[kDrTokens];
  __shared__ float tile[dk][kDrWarps + 1];  // state columns j0 .. j0+kDrWarps-1 (padded: no bank conflicts)
  const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int T = a.T, H = a.heads, dv = a.dv, hk = h / a.qk_group;
  const int j0 = blockIdx.x * kDrWarps, j = j0 + warp;
  const bool active = j < dv;  // uniform per warp
  float* S = a.state + int64_t(h) * dk * dv;
  for (int idx = threadIdx.x; idx < dk * kDrWarps; idx += blockDim.x) {
    const int c = idx / kDrWarps, jj = idx % kDrWarps;
    tile[c][jj] = j0 + jj < dv ? S[int64_t(c) * dv + j0 + jj] : 0.0f;
  }
  __syncthreads();
  float s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] = tile[lane + 32 * i][warp];

  for (int t0 = 0; t0 < T; t0 += kDrTokens) {
    const int n = min(kDrTokens, T - t0);
    __syncthreads();
    for (int idx = threadIdx.x; idx < n * dk; idx += blockDim.x) {
      const int r = idx / dk, c = idx % dk;
      const int64_t ti = int64_t(t0 + r) * H + h, qk = int64_t(t0 + r) * a.qk_stride + int64_t(hk) * dk + c;
      q_s[r][c] = a.q[qk];
      k_s[r][c] = a.k[qk];
      e_s[r][c] = expf(a.per_channel_decay ? a.g[ti * dk + c] : a.g[ti]);
    }
    for (int r = threadIdx.x; r < n; r += blockDim.x) b_s[r] = a.beta[int64_t(t0 + r) * H + h];
    __syncthreads();
    if (!active) continue;
    for (int r = 0; r < n; ++r) {
      const int64_t ti = int64_t(t0 + r) * H + h;
      float u = 0.0f;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        s[i] *= e_s[r][lane + 32 * i];
        u += s[i] * k_s[r][lane + 32 * i];
      }
      u = warp_sum(u);
      const float delta = b_s[r] * (a.v[int64_t(t0 + r) * a.v_stride + int64_t(h) * dv + j] - u);
      float o = 0.0f;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        s[i] += k_s[r][lane + 32 * i] * delta;
        o += s[i] * q_s[r][lane + 32 * i];
      }
      o = warp_sum(o);
      if (lane == 0) a.out[ti * dv + j] = o;
      if (a.steps && t0 + r < T - 1) {  // rollback point: column j's dk values, contiguous
        float* st = a.steps + ((int64_t(t0 + r) * H + h) * dv + j) * dk;
#pragma unroll
        for (int i = 0; i < R; ++i) st[lane + 32 * i] = s[i];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i) tile[lane + 32 * i][warp] = s[i];  // each warp its own column
  __syncthreads();
  for (int idx = threadIdx.x; idx < dk * kDrWarps; idx += blockDim.x) {
    const int c = idx / kDrWarps, jj = idx % kDrWarps;
    if (j0 + jj < dv) S[int64_t(c) * dv + j0 + jj] = tile[c][jj];
  }
}

template <int R>
void launch_delta_rule(const DeltaRuleArgs& a, cudaStream_t st) {
  const dim3 grid(unsigned(ceil_div(a.dv, kDrWarps)), unsigned(a.heads));
  launch(delta_rule_kernel<R>, grid, kDrWarps * 32, 0, st, a);
}

// ---- the same recurrence for long token runs (prefill), dk = 64 or 128. The kernel above spends a warp on each
// column: two 5-step shuffle sums per token, and 16 blocks per head each staging the head's q, k, exp(g) rows. Here a
// lane quad holds a column (lane q of the quad: rows 16 i + 4 q .. + 3, read from the staged rows as float4
// broadcasts), so a warp runs 8 columns with two 2-step sums per token, and a block of kDqWarps warps covers 64
// columns of one head (2 blocks per head at dv = 128: each SM runs one block, issue-bound on the FMAs). The next
// kDqTokens token rows are loaded into registers before the current ones are processed and stored after them.
constexpr int kDqWarps = 8, kDqTokens = 8, kDqCols = kDqWarps * 8, kDqThreads = kDqWarps * 32;
constexpr int kDqMinTokens = 32;  // shorter runs (decode) keep the column-per-warp kernel

template <int dk>
struct DqStage {  // one thread's share of a group of kDqTokens token rows
  static constexpr int kRows = kDqTokens * dk / kDqThreads;
  static_assert(kRows * kDqThreads == kDqTokens * dk, "whole token rows per stage");
  float q[kRows], k[kRows], e[kRows], v[kDqTokens * kDqCols / kDqThreads], b;
};

template <int dk>
__device__ __forceinline__ void dq_load(const DeltaRuleArgs& a, int h, int hk, int j0, int t0, DqStage<dk>& r) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int m = 0; m < DqStage<dk>::kRows; ++m) {
    const int idx = tid + m * kDqThreads, t = t0 + idx / dk, c = idx % dk;
    r.q[m] = r.k[m] = r.e[m] = 0.0f;
    if (t < a.T) {
      const int64_t qk = int64_t(t) * a.qk_stride + int64_t(hk) * dk + c, ti = int64_t(t) * a.heads + h;
      r.q[m] = __ldg(a.q + qk);
      r.k[m] = __ldg(a.k + qk);
      r.e[m] = __ldg(a.per_channel_decay ? a.g + ti * dk + c : a.g + ti);
    }
  }
#pragma unroll
  for (int m = 0; m < kDqTokens * kDqCols / kDqThreads; ++m) {
    const int idx = tid + m * kDqThreads, t = t0 + idx / kDqCols, col = j0 + idx % kDqCols;
    r.v[m] = t < a.T && col < a.dv ? __ldg(a.v + int64_t(t) * a.v_stride + int64_t(h) * a.dv + col) : 0.0f;
  }
  r.b = tid < kDqTokens && t0 + tid < a.T ? __ldg(a.beta + int64_t(t0 + tid) * a.heads + h) : 0.0f;
}

template <int dk>
struct DqSmem {
  float q[kDqTokens][dk], k[kDqTokens][dk], e[kDqTokens][dk], v[kDqTokens][kDqCols], b[kDqTokens];
};

template <int dk>
__device__ __forceinline__ void dq_store(const DqStage<dk>& r, DqSmem<dk>& sm) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int m = 0; m < DqStage<dk>::kRows; ++m) {
    const int idx = tid + m * kDqThreads, t = idx / dk, c = idx % dk;
    sm.q[t][c] = r.q[m];
    sm.k[t][c] = r.k[m];
    sm.e[t][c] = expf(r.e[m]);
  }
#pragma unroll
  for (int m = 0; m < kDqTokens * kDqCols / kDqThreads; ++m) {
    const int idx = tid + m * kDqThreads;
    sm.v[idx / kDqCols][idx % kDqCols] = r.v[m];
  }
  if (tid < kDqTokens) sm.b[tid] = r.b;
}

template <int dk>
__global__ void __launch_bounds__(kDqThreads) delta_rule_quad_kernel(DeltaRuleArgs a) {
  pdl_enter();
  constexpr int N = dk / 16;  // float4 row groups per lane
  __shared__ __align__(16) DqSmem<dk> sm[2];
  const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, quad = lane & 3;
  const int hk = h / a.qk_group, j0 = blockIdx.x * kDqCols, jc = warp * 8 + (lane >> 2), j = j0 + jc;
  const bool active = j < a.dv;  // uniform over the quad
  float* S = a.state + int64_t(h) * dk * a.dv;
  float4 s[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int r = 16 * i + 4 * quad;
    s[i] = active ? make_float4(S[int64_t(r) * a.dv + j], S[int64_t(r + 1) * a.dv + j], S[int64_t(r + 2) * a.dv + j],
                                S[int64_t(r + 3) * a.dv + j])
                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  DqStage<dk> next;
  dq_load<dk>(a, h, hk, j0, 0, next);
  dq_store<dk>(next, sm[0]);
  __syncthreads();
  for (int t0 = 0, buf = 0; t0 < a.T; t0 += kDqTokens, buf ^= 1) {
    const bool more = t0 + kDqTokens < a.T;  // block-uniform
    if (more) dq_load<dk>(a, h, hk, j0, t0 + kDqTokens, next);
    const DqSmem<dk>& cur = sm[buf];
    const int n = min(kDqTokens, a.T - t0);
    for (int r = 0; r < n; ++r) {
      float4 k4[N];
      float u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float4 e4 = *reinterpret_cast<const float4*>(&cur.e[r][16 * i + 4 * quad]);
        k4[i] = *reinterpret_cast<const float4*>(&cur.k[r][16 * i + 4 * quad]);
        s[i].x *= e4.x, s[i].y *= e4.y, s[i].z *= e4.z, s[i].w *= e4.w;
        u[0] += s[i].x * k4[i].x;
        u[1] += s[i].y * k4[i].y;
        u[2] += s[i].z * k4[i].z;
        u[3] += s[i].w * k4[i].w;
      }
      float uu = (u[0] + u[1]) + (u[2] + u[3]);
      uu += __shfl_xor_sync(0xffffffffu, uu, 1);
      uu += __shfl_xor_sync(0xffffffffu, uu, 2);
      const float delta = cur.b[r] * (cur.v[r][jc] - uu);
      float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float4 q4 = *reinterpret_cast<const float4*>(&cur.q[r][16 * i + 4 * quad]);
        s[i].x += k4[i].x * delta, s[i].y += k4[i].y * delta, s[i].z += k4[i].z * delta, s[i].w += k4[i].w * delta;
        o[0] += s[i].x * q4.x;
        o[1] += s[i].y * q4.y;
        o[2] += s[i].z * q4.z;
        o[3] += s[i].w * q4.w;
      }
      float oo = (o[0] + o[1]) + (o[2] + o[3]);
      oo += __shfl_xor_sync(0xffffffffu, oo, 1);
      oo += __shfl_xor_sync(0xffffffffu, oo, 2);
      if (quad == 0 && active) a.out[(int64_t(t0 + r) * a.heads + h) * a.dv + j] = oo;
    }
    if (more) dq_store<dk>(next, sm[buf ^ 1]);  // the other buffer: last read before the previous barrier
    __syncthreads();
  }
  if (active)
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int r = 16 * i + 4 * quad;
      S[int64_t(r) * a.dv + j] = s[i].x;
      S[int64_t(r + 1) * a.dv + j] = s[i].y;
      S[int64_t(r + 2) * a.dv + j] = s[i].z;
      S[int64_t(r + 3) * a.dv + j] = s[i].w;
    }
}

template <int dk>
void launch_delta_rule_quad(const DeltaRuleArgs& a, cudaStream_t st) {
  const dim3 grid(unsigned(ceil_div(a.dv, kDqCols)), unsigned(a.heads));
  launch(delta_rule_quad_kernel<dk>, grid, kDqThreads, 0, st, a);
}

// ---- gated output RMSNorm: one warp per (token, head) row: rms_norm(o) * w * sigmoid(gate) (KDA) or
// * silu(gate) (Gated DeltaNet).
template <bool kSilu>
__global__ void gated_rms_norm_kernel(float* o, const float* gate, const float* w, int rows, int d, float eps) {
  pdl_enter();
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  float* p = o + row * d;
  const float* gr = gate + row * d;
  float ss = 0.0f;
  for (int i = lane; i < d; i += 32) ss += p[i] * p[i];
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(ss / float(d) + eps);
  for (int i = lane; i < d; i += 32) {
    const float z = gr[i];
    p[i] = (p[i] * inv) * w[i] * (kSilu ? z / (1.0f + expf(-z)) : sigmoidf(z));
  }
}

// ---- Gated DeltaNet input regrouping and gates (layouts of cpu::gated_delta_forward).
__global__ void gdn_split_kernel(const float* qkvz, int S, int Hk, int r, int dk, int dv, float* mixed, float* z) {
  pdl_enter();
  const int group = 2 * dk + 2 * r * dv, QK = Hk * dk, V = Hk * r * dv, C = 2 * QK + V;
  const int64_t n = int64_t(S) * Hk * group;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = idx / (int64_t(Hk) * group);
    const int h = int(idx / group % Hk), o = int(idx % group);
    const float x = qkvz[idx];
    float* m = mixed + s * C;
    if (o < dk) m[h * dk + o] = x;
    else if (o < 2 * dk) m[QK + h * dk + (o - dk)] = x;
    else if (o < 2 * dk + r * dv) m[2 * QK + h * r * dv + (o - 2 * dk)] = x;
    else z[s * V + h * r * dv + (o - 2 * dk - r * dv)] = x;
  }
}

__global__ void gdn_gates_kernel(const float* ba, const float* dt_bias, const float* a_log, int S, int Hk, int r,
                                 float* g, float* beta) {
  pdl_enter();
  const int Hv = Hk * r;
  const int64_t n = int64_t(S) * Hv;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = idx / Hv;
    const int hv = int(idx % Hv), h = hv / r, i = hv % r;
    const float b = ba[s * 2 * Hv + h * 2 * r + i], av = ba[s * 2 * Hv + h * 2 * r + r + i];
    beta[idx] = sigmoidf(b);
    const float f = av + dt_bias[hv];
    g[idx] = -expf(a_log[hv]) * (f > 20.0f ? f : log1pf(expf(f)));
  }
}

}  // namespace

void causal_conv1d_silu(const float* x, int64_t x_stride, int T, int C, const float* w, int K, float* state, float* y,
                        cudaStream_t st) {
  if (T <= 0 || C <= 0) return;
  if (K < 1) throw std::runtime_error("causal_conv1d_silu: kernel size " + std::to_string(K));
  if (K >= 2 && K <= 4 && conv_vec_ok(x, x_stride, C, state, y)) {
    const dim3 grid(unsigned(ceil_div(C / 4, kConvThreads)), unsigned(ceil_div(T, kConvTokens)));
    auto go = [&](auto kernel) { launch(kernel, grid, kConvThreads, 0, st, x, x_stride, T, C, w, state, y); };
    if (K == 2) go(conv1d_silu_vec_kernel<2>);
    else if (K == 3) go(conv1d_silu_vec_kernel<3>);
    else go(conv1d_silu_vec_kernel<4>);
  } else {
    launch(conv1d_silu_kernel, grid_1d(int64_t(T) * C, 256), 256, 0, st, x, x_stride, T, C, w, K, state, y);
  }
  MOESRV_CUDA_LAUNCH_CHECK();
  if (K == 1) return;
  launch(conv1d_state_kernel, grid_1d(C, 256), 256, 0, st, x, x_stride, T, C, K, state);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void conv_state_steps(const float* x, int64_t x_stride, int T, int C, int K, const float* state, float* steps,
                      cudaStream_t st) {
  if (T <= 1 || C <= 0 || K <= 1) return;
  launch(conv_steps_kernel, grid_1d(int64_t(T - 1) * (K - 1) * C, 256), 256, 0, st, x, x_stride, T, C, K, state, steps);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void state_from_step(const float* step, int H, int dk, int dv, float* state, cudaStream_t st) {
  const int64_t n = int64_t(H) * dk * dv;
  if (n == 0) return;
  launch(state_from_step_kernel, grid_1d(n, 256), 256, 0, st, step, H, dk, dv, state);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void l2norm_rows(float* x, int tokens, int heads, int64_t token_stride, int n, float eps, float scale,
                 cudaStream_t st) {
  const int64_t rows = int64_t(tokens) * heads;
  if (rows == 0) return;
  launch(l2norm_kernel, ceil_div(rows * 32, 256), 256, 0, st, x, tokens, heads, token_stride, n, eps, scale);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void kda_gates(float* g, const float* dt_bias, const float* a_log, int S, int H, int d, bool lower_bound_set,
               float lower_bound, float* beta, cudaStream_t st) {
  const int64_t n = int64_t(S) * H * d;
  if (n == 0) return;
  launch(kda_gates_kernel, grid_1d(n, 256), 256, 0, st, g, dt_bias, a_log, S, H, d, lower_bound_set, lower_bound, beta);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void delta_rule(const DeltaRuleArgs& args, cudaStream_t st) {
  DeltaRuleArgs a = args;
  if (a.T <= 0 || a.heads <= 0 || a.dv <= 0) return;
  if (a.qk_group < 1 || a.heads % a.qk_group != 0)
    throw std::runtime_error("delta_rule: " + std::to_string(a.heads) + " value heads in groups of " +
                             std::to_string(a.qk_group));
  if (a.qk_stride == 0) a.qk_stride = int64_t(a.heads / a.qk_group) * a.dk;
  if (a.v_stride == 0) a.v_stride = int64_t(a.heads) * a.dv;
  static const bool columns = env_flag("MOESRV_DELTA_RULE_COLUMNS");  // 1: the column-per-warp kernel always
  if (a.steps && a.T > kDqMinTokens) throw std::runtime_error("delta_rule: rollback points of more than 32 tokens");
  if (a.T >= kDeltaRuleChunkMinTokens && delta_rule_chunked_on() && delta_rule_chunked(a, st))
    return;  // (no getenv per decode step)
  if (a.T >= kDqMinTokens && (a.dk == 64 || a.dk == 128) && !columns && !a.steps) {
    if (a.dk == 64) launch_delta_rule_quad<64>(a, st);
    else launch_delta_rule_quad<128>(a, st);
    MOESRV_CUDA_LAUNCH_CHECK();
    return;
  }
  switch (a.dk) {  // the sizes cuda_delta_rule_supports() (cuda_engine.h) lists
    case 32: launch_delta_rule<1>(a, st); break;
    case 64: launch_delta_rule<2>(a, st); break;
    case 96: launch_delta_rule<3>(a, st); break;
    case 128: launch_delta_rule<4>(a, st); break;
    case 192: launch_delta_rule<6>(a, st); break;
    case 256: launch_delta_rule<8>(a, st); break;
    default: throw std::runtime_error("delta_rule: key head dim " + std::to_string(a.dk) + " not supported");
  }
  MOESRV_CUDA_LAUNCH_CHECK();
}

void delta_rule(int T, int H, int dk, int dv, bool per_channel_decay, const float* q, const float* k, const float* v,
                const float* g, const float* beta, float* state, float* out, cudaStream_t st) {
  DeltaRuleArgs a;
  a.T = T, a.heads = H, a.dk = dk, a.dv = dv, a.per_channel_decay = per_channel_decay;
  a.q = q, a.k = k, a.v = v, a.g = g, a.beta = beta, a.state = state, a.out = out;
  delta_rule(a, st);
}

void kda_output_norm(float* o, const float* gate, const float* w, int rows, int d, float eps, cudaStream_t st) {
  if (rows <= 0) return;
  launch(gated_rms_norm_kernel<false>, ceil_div(int64_t(rows) * 32, 256), 256, 0, st, o, gate, w, rows, d, eps);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void gdn_output_norm(float* o, const float* z, const float* w, int rows, int d, float eps, cudaStream_t st) {
  if (rows <= 0) return;
  launch(gated_rms_norm_kernel<true>, ceil_div(int64_t(rows) * 32, 256), 256, 0, st, o, z, w, rows, d, eps);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void gdn_split_qkvz(const float* qkvz, int S, int Hk, int r, int dk, int dv, float* mixed, float* z, cudaStream_t st) {
  const int64_t n = int64_t(S) * Hk * (2 * dk + 2 * r * dv);
  if (n <= 0) return;
  launch(gdn_split_kernel, grid_1d(n, 256), 256, 0, st, qkvz, S, Hk, r, dk, dv, mixed, z);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void gdn_gates(const float* ba, const float* dt_bias, const float* a_log, int S, int Hk, int r, float* g, float* beta,
               cudaStream_t st) {
  const int64_t n = int64_t(S) * Hk * r;
  if (n <= 0) return;
  launch(gdn_gates_kernel, grid_1d(n, 256), 256, 0, st, ba, dt_bias, a_log, S, Hk, r, g, beta);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
