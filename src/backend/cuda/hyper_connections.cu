// mHC (manifold-constrained hyper-connections) around each sub-layer: the per-token mixing weights (pre, post,
// Sinkhorn comb), the collapsed and normalised sub-layer input, and the stream update; one block per token.
// Same math and eps placements as cpu::hyper_mix / cpu::Residual (src/backend/cpu/residual.cpp).
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "backend/cuda/glm5_next_kernels.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kMaxStreams = 8, kThreads = 256, kEnterThreads = 1024;
constexpr int kSplitTokens = 16;  // hyper_enter: up to this many tokens (with scratch), the split decode path
constexpr int kDotChunks = 16;    // ... each of them split over up to this many blocks
constexpr int kStepCols = 128;    // hyper_step: d values per block (times n streams: its threads)
constexpr int kStepMaxBlocks = 128;
constexpr int kStepMaxStreams = 4;

__device__ __forceinline__ float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

// The mixing logits fn[kk] . X (kk < mix) and, with gram, the stream products X_i . X_j (i <= j, kk - mix counting
// them row by row) of token s, chunk c of the values per block (grid (rows - kk0, chunks, S), kk = kk0 + x), so that
// hundreds of blocks share the reads; without gram, kk == mix is X . X. The partial sums go to
// out[s * out_ld + kk * chunks + c] for the enter kernels, which add them up in chunk order.
__global__ void __launch_bounds__(kThreads) hyper_dot_kernel(const float* x, int n, int D, const float* fn, int mix,
                                                             int kk0, bool gram, float* out, int64_t out_ld) {
  pdl_enter();
  const int kk = kk0 + blockIdx.x, c = blockIdx.y, chunks = gridDim.y, s = blockIdx.z;
  const float* X = x + s * int64_t(n) * D;
  const float *a = kk < mix ? fn + kk * int64_t(n) * D : X, *b = X;
  int64_t W = int64_t(n) * D;
  if (gram && kk >= mix) {  // pair (i, j) of the upper triangle, row by row
    int g = kk - mix, i = 0;
    while (g >= n - i) g -= n - i, ++i;
    a = X + int64_t(i) * D, b = X + int64_t(i + g) * D, W = D;
  }
  const int64_t per = (W + chunks - 1) / chunks, i0 = c * per, i1 = min(W, i0 + per);
  float acc = 0.0f;
#pragma unroll 4
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) acc += a[i] * b[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) out[int64_t(s) * out_ld + kk * chunks + c] = acc;
}

// The sum of a logit's `chunks` partial sums p[0..chunks) (<= kDotChunks), all loaded first, added in chunk order.
__device__ __forceinline__ float sum_chunks(const float* p, int chunks) {
  float v[kDotChunks], t = 0.0f;
#pragma unroll
  for (int c = 0; c < kDotChunks; ++c) v[c] = c < chunks ? p[c] : 0.0f;
#pragma unroll
  for (int c = 0; c < kDotChunks; ++c)
    if (c < chunks) t += v[c];
  return t;
}

// pre, post and the Sinkhorn-normalised comb from the scaled mixing logits m_s, by the first warp: lane l owns the
// comb entries l and l + 32 (n*n <= 64); every row / column sum runs in index order, as the CPU's serial loops, so
// the result is bit-identical to them. pre_s gets pre (shared), post and comb go to global memory.
__device__ void mix_weights(const float* m_s, int n, const float* scale, const float* base, float hc_eps,
                            int sinkhorn_iters, float* pre_s, float* post, float* comb) {
  __shared__ float c_s[kMaxStreams * kMaxStreams];
  const int lane = threadIdx.x & 31, nn = n * n;
  if (lane < n) {
    pre_s[lane] = sigmoidf(m_s[lane] * scale[0] + base[lane]) + hc_eps;
    post[lane] = 2.0f * sigmoidf(m_s[n + lane] * scale[1] + base[n + lane]);
  }
  if (nn <= 32) {  // lane = entry (i, j), the sums gathered by shuffles in index order: no shared memory round trips
    const int i = lane / n, j = lane % n;
    float c = lane < nn ? m_s[2 * n + lane] * scale[2] + base[2 * n + lane] : 0.0f;
    auto row_at = [&](float v, int t) { return __shfl_sync(0xffffffffu, v, i * n + t); };
    auto col_at = [&](float v, int t) { return __shfl_sync(0xffffffffu, v, t * n + j); };
    float mx = -INFINITY;
    for (int t = 0; t < n; ++t) mx = fmaxf(mx, row_at(c, t));
    c = expf(c - mx);
    float sum = 0.0f;
    for (int t = 0; t < n; ++t) sum += row_at(c, t);
    c = c * (1.0f / sum) + hc_eps;
    for (int it = 0; it < max(sinkhorn_iters, 1); ++it) {
      if (it > 0) {  // rows (from the second iteration on), then columns
        sum = 0.0f;
        for (int t = 0; t < n; ++t) sum += row_at(c, t);
        c /= sum + hc_eps;
      }
      sum = 0.0f;
      for (int t = 0; t < n; ++t) sum += col_at(c, t);
      c /= sum + hc_eps;
    }
    if (lane < nn) comb[lane] = c;
    return;
  }
  float c[2] = {0.0f, 0.0f};
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int e = lane + 32 * q;
    if (e < nn) c_s[e] = m_s[2 * n + e] * scale[2] + base[2 * n + e];
  }
  __syncwarp();
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int q = 0; q < 2; ++q) {  // row softmax of the comb logits, + eps
    const int e = lane + 32 * q, i = e / n;
    if (e < nn) {
      for (int j = 0; j < n; ++j) mx[q] = fmaxf(mx[q], c_s[i * n + j]);
      c[q] = expf(c_s[e] - mx[q]);
    }
  }
  __syncwarp();
  auto publish = [&] {
#pragma unroll
    for (int q = 0; q < 2; ++q)
      if (lane + 32 * q < nn) c_s[lane + 32 * q] = c[q];
    __syncwarp();
  };
  // Divides each entry by (the sum of its row (rows) or column, in index order) + add; then publishes.
  auto normalise = [&](bool rows, float add, bool reciprocal) {
    float sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int e = lane + 32 * q, i = e / n, j = e % n;
      if (e < nn)
        for (int t = 0; t < n; ++t) sum[q] += rows ? c_s[i * n + t] : c_s[t * n + j];
    }
    __syncwarp();
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      if (reciprocal) c[q] = c[q] * (1.0f / sum[q]) + add;
      else c[q] /= sum[q] + add;
    }
    publish();
  };
  publish();
  normalise(true, hc_eps, true);  // the softmax's quotients, + eps
  for (int it = 0; it < max(sinkhorn_iters, 1); ++it) {
    if (it > 0) normalise(true, hc_eps, false);  // rows (from the second iteration on), then columns
    normalise(false, hc_eps, false);
  }
#pragma unroll
  for (int q = 0; q < 2; ++q)
    if (lane + 32 * q < nn) comb[lane + 32 * q] = c[q];
}

// One block per token. dot_chunks > 0: the logits and X . X are in h (prefill: the GEMM and hyper_dot_kernel put them
// there, dot_chunks partials each); else this block computes them, 8 rows per pass over X.
__global__ void __launch_bounds__(kEnterThreads)
    hyper_enter_kernel(const float* x, int n, int D, const float* fn, const float* scale, const float* base,
                       const float* norm_w, float rms_eps, float hc_eps, int sinkhorn_iters, int dot_chunks, float* h,
                       float* post_out, float* comb_out) {
  pdl_enter();
  constexpr int kRows = 8;
  __shared__ float m_s[(2 + kMaxStreams) * kMaxStreams + 1], pre_s[kMaxStreams];
  const int s = blockIdx.x, tid = threadIdx.x;
  const int64_t W = int64_t(n) * D;
  const int mix = (2 + n) * n;
  const float* X = x + s * W;

  // m = fn . X * rsqrt(mean(X^2) + rms_eps)
  if (dot_chunks > 0) {
    if (tid <= mix) m_s[tid] = sum_chunks(h + int64_t(s) * D + tid * dot_chunks, dot_chunks);
    __syncthreads();
    const float r = 1.0f / sqrtf(m_s[mix] / float(W) + rms_eps);
    __syncthreads();
    if (tid < mix) m_s[tid] *= r;
  } else {
    float ss = 0.0f;
    for (int64_t i = tid; i < W; i += blockDim.x) ss += X[i] * X[i];
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / float(W) + rms_eps);
    for (int k0 = 0; k0 < mix; k0 += kRows) {
      float acc[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) acc[j] = 0.0f;
      for (int64_t i = tid; i < W; i += blockDim.x) {
        const float xv = X[i];
#pragma unroll
        for (int j = 0; j < kRows; ++j)
          if (k0 + j < mix) acc[j] += fn[(k0 + j) * W + i] * xv;
      }
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const float dot = block_sum(acc[j]);  // uniform over the block
        if (tid == 0 && k0 + j < mix) m_s[k0 + j] = dot * r;
      }
    }
  }
  __syncthreads();

  if (tid < 32)
    mix_weights(m_s, n, scale, base, hc_eps, sinkhorn_iters, pre_s, post_out + int64_t(s) * n,
                comb_out + int64_t(s) * n * n);
  __syncthreads();

  // h = rms_norm(sum_i pre_i X_i) * norm_w; up to kKeep values per thread stay in registers
  constexpr int kKeep = 8;
  float* hs = h + int64_t(s) * D;
  float keep[kKeep], hss = 0.0f;
#pragma unroll
  for (int j = 0; j < kKeep; ++j) {
    const int d = tid + j * kEnterThreads;
    keep[j] = 0.0f;
    if (d < D) {
      float v = 0.0f;
      for (int i = 0; i < n; ++i) v += pre_s[i] * X[int64_t(i) * D + d];
      keep[j] = v;
      hss += v * v;
    }
  }
  for (int d = tid + kKeep * kEnterThreads; d < D; d += kEnterThreads) {  // wide models: through memory
    float v = 0.0f;
    for (int i = 0; i < n; ++i) v += pre_s[i] * X[int64_t(i) * D + d];
    hs[d] = v;
    hss += v * v;
  }
  hss = block_sum(hss);
  const float inv = 1.0f / sqrtf(hss / float(D) + rms_eps);
#pragma unroll
  for (int j = 0; j < kKeep; ++j) {
    const int d = tid + j * kEnterThreads;
    if (d < D) hs[d] = (keep[j] * inv) * norm_w[d];
  }
  for (int d = tid + kKeep * kEnterThreads; d < D; d += kEnterThreads) hs[d] = (hs[d] * inv) * norm_w[d];
}

// Prefill after the logits GEMM, the weights apart: a block of kEnterHThreads per token holds its n <= 4 streams in
// registers (NV float4 each per thread) and makes r, pre and h; it leaves the scaled post and comb logits in
// post_out / comb_out, which hyper_weights_inplace_kernel turns into the weights (a warp per token). The block does
// not wait for the Sinkhorn chain, so an SM keeps several tokens' reads in flight (the form it replaced, 1024
// threads per token with the weights in the block, ran one chain per token while the other 31 warps waited).
constexpr int kEnterHThreads = 256, kEnterHMaxVec = 4;
template <int NV>
__global__ void __launch_bounds__(kEnterHThreads)
    hyper_enter_h_kernel(const float* x, int n, int D, const float* scale, const float* base, const float* norm_w,
                         float rms_eps, float hc_eps, float* h, float* post_out, float* comb_out) {
  pdl_enter();
  __shared__ float pre_s[kMaxStreams];
  const int s = blockIdx.x, tid = threadIdx.x, D4 = D / 4;
  const float* X = x + int64_t(s) * n * D;
  float4 xv[4][NV];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const int j = tid + v * kEnterHThreads;
      xv[i][v] = i < n && j < D4 ? *reinterpret_cast<const float4*>(X + int64_t(i) * D + 4 * j)
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
      ss += xv[i][v].x * xv[i][v].x + xv[i][v].y * xv[i][v].y + xv[i][v].z * xv[i][v].z + xv[i][v].w * xv[i][v].w;
    }
  ss = block_sum(ss);
  const float r = 1.0f / sqrtf(ss / float(int64_t(n) * D) + rms_eps);
  const float* m = h + int64_t(s) * D;  // the logits GEMM's row
  if (tid < (2 + n) * n) {
    const float ms = m[tid] * r;
    if (tid < n) pre_s[tid] = sigmoidf(ms * scale[0] + base[tid]) + hc_eps;
    else if (tid < 2 * n) post_out[int64_t(s) * n + tid - n] = ms;
    else comb_out[int64_t(s) * n * n + tid - 2 * n] = ms;
  }
  __syncthreads();
  // h = rms_norm(sum_i pre_i X_i) * norm_w
  float4 hv[NV];
  float hss = 0.0f;
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (i < n) {
        const float p = pre_s[i];
        a.x += p * xv[i][v].x, a.y += p * xv[i][v].y, a.z += p * xv[i][v].z, a.w += p * xv[i][v].w;
      }
    hv[v] = a;
    if (tid + v * kEnterHThreads < D4) hss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
  }
  hss = block_sum(hss);  // (its barriers: every thread has read its logit from h before h is written)
  const float inv = 1.0f / sqrtf(hss / float(D) + rms_eps);
  float* hs = h + int64_t(s) * D;
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    const int j = tid + v * kEnterHThreads;
    if (j >= D4) continue;
    const float4 w = *reinterpret_cast<const float4*>(norm_w + 4 * j);
    *reinterpret_cast<float4*>(hs + 4 * j) =
        make_float4((hv[v].x * inv) * w.x, (hv[v].y * inv) * w.y, (hv[v].z * inv) * w.z, (hv[v].w * inv) * w.w);
  }
}

// post and comb from the scaled logits hyper_enter_h_kernel left in them, in place: a warp (block) per token.
__global__ void hyper_weights_inplace_kernel(int n, const float* scale, const float* base, float hc_eps,
                                             int sinkhorn_iters, float* post, float* comb) {
  pdl_enter();
  __shared__ float m_s[(2 + kMaxStreams) * kMaxStreams], pre_s[kMaxStreams];
  const int s = blockIdx.x, nn = n * n;
  for (int kk = threadIdx.x; kk < (2 + n) * n; kk += 32)
    m_s[kk] = kk < n ? 0.0f : kk < 2 * n ? post[int64_t(s) * n + kk - n] : comb[int64_t(s) * nn + kk - 2 * n];
  __syncwarp();
  mix_weights(m_s, n, scale, base, hc_eps, sinkhorn_iters, pre_s, post + int64_t(s) * n, comb + int64_t(s) * nn);
}

// Decode (few tokens): grid (x, S) over the partial sums hyper_dot_kernel left in part (the mix logits, then the
// n(n+1)/2 stream products X_i . X_j). Blocks below h_blocks make h over their share of D (its norm is
// sum_ij pre_i pre_j X_i . X_j, so no block waits for another); a block at h_blocks makes post and comb (the Sinkhorn
// chain). One grid of h_blocks + 1 does both; or h alone (h_blocks = x) and the weights alone (h_blocks = 0, one
// block) on another stream, off the path to the sub-layer: the weights are needed only at its exit.
__global__ void __launch_bounds__(kThreads)
    hyper_enter_split_kernel(const float* x, int n, int D, const float* scale, const float* base, const float* norm_w,
                             float rms_eps, float hc_eps, int sinkhorn_iters, int chunks, const float* part, float* h,
                             float* post_out, float* comb_out, int h_blocks) {
  pdl_enter();
  __shared__ float m_s[(2 + kMaxStreams) * kMaxStreams + kMaxStreams * (kMaxStreams + 1) / 2 + 1];
  __shared__ float pre_s[kMaxStreams];
  const int s = blockIdx.y, tid = threadIdx.x, mix = (2 + n) * n, rows = mix + n * (n + 1) / 2;
  const bool weights_block = int(blockIdx.x) == h_blocks;
  const float* P = part + int64_t(s) * rows * chunks;
  for (int kk = tid; kk < rows; kk += blockDim.x) {
    if (!weights_block && kk >= n && kk < mix) continue;  // h needs pre's logits and the products only
    m_s[kk] = sum_chunks(P + kk * chunks, chunks);
  }
  __syncthreads();
  const float* gram = m_s + mix;  // (i, j), i <= j, row by row
  auto at = [&](int i, int j) {   // X_i . X_j
    if (i > j) {
      const int t = i;
      i = j, j = t;
    }
    return gram[i * n - i * (i - 1) / 2 + (j - i)];
  };
  float xx = 0.0f;
  for (int i = 0; i < n; ++i) xx += at(i, i);
  const float r = 1.0f / sqrtf(xx / float(int64_t(n) * D) + rms_eps);
  __syncthreads();
  if (tid < (weights_block ? mix : n)) m_s[tid] *= r;
  __syncthreads();
  if (weights_block) {
    if (tid < 32)
      mix_weights(m_s, n, scale, base, hc_eps, sinkhorn_iters, pre_s, post_out + int64_t(s) * n,
                  comb_out + int64_t(s) * n * n);
    return;
  }
  float pre[kMaxStreams];
  for (int i = 0; i < n; ++i) pre[i] = sigmoidf(m_s[i] * scale[0] + base[i]) + hc_eps;
  float hss = 0.0f;  // sum_d (sum_i pre_i X_i[d])^2
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) hss += pre[i] * pre[j] * at(i, j);
  const float inv = 1.0f / sqrtf(fmaxf(hss, 0.0f) / float(D) + rms_eps);
  const float* X = x + int64_t(s) * n * D;
  float* hs = h + int64_t(s) * D;
  for (int d = blockIdx.x * blockDim.x + tid; d < D; d += h_blocks * blockDim.x) {
    float v = 0.0f;
    for (int i = 0; i < n; ++i) v += pre[i] * X[int64_t(i) * D + d];
    hs[d] = (v * inv) * norm_w[d];
  }
}

// hyper_step's scratch, one layout for every token count (calls of different S share it; the counters must never
// move): per token slot a barrier's arrival count (zero between launches) and generation (uint32 each), then the
// blocks' partial sums [slot][rows][blocks] and the scaled mixing logits [slot][mix], kSplitTokens slots.
struct StepScratch {
  unsigned *count, *gen;
  float *part, *logits;
  __host__ __device__ StepScratch(float* base, int n) {
    const int rows = (2 + n) * n + n * (n + 1) / 2;
    count = reinterpret_cast<unsigned*>(base), gen = count + kSplitTokens;
    part = base + 2 * kSplitTokens, logits = part + size_t(kSplitTokens) * rows * kStepMaxBlocks;
  }
  static size_t floats(int n) {
    const int mix = (2 + n) * n, rows = mix + n * (n + 1) / 2;
    return 2 * kSplitTokens + size_t(kSplitTokens) * (size_t(rows) * kStepMaxBlocks + mix);
  }
};

// Called by one thread of each of `blocks` blocks (all resident at once): returns once every block has arrived.
// The last to arrive resets the count and moves the generation on; the others wait for that (acquire).
__device__ void grid_barrier(unsigned* count, unsigned* gen, unsigned blocks) {
  unsigned g;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(g) : "l"(gen) : "memory");
  if (atomicAdd(count, 1u) == blocks - 1) {
    *count = 0;
    __threadfence();
    atomicAdd(gen, 1u);
    return;
  }
  for (unsigned now = g; now == g;) {
    __nanosleep(32);
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(gen) : "memory");
  }
}

// The stream products' slot of (i, j), i <= j, row by row (hyper_enter_split_kernel's gram order).
__host__ __device__ constexpr int pair_slot(int n, int i, int j) { return i * n - i * (i - 1) / 2 + (j - i); }

// Grid (blocks, S), N * kStepCols threads: thread (i, c) owns stream i of column d = blockIdx.x * kStepCols + c.
// It applies the previous site's leave to that column (y set; hyper_leave_kernel's arithmetic, its stream written
// back) and adds its share of the mixing logits fn[kk] . X and of the stream products X_i . X_j; the block sums go
// to the scratch; after a barrier over the token's blocks (hyper_step_supported keeps the grid within one block
// per SM, so all are resident) each block adds them up in block order and makes h of its columns
// (hyper_enter_split_kernel's math); block 0 leaves the scaled logits for the side stream, or (no side) makes post
// and comb itself.
template <int N>
__global__ void __launch_bounds__(N* kStepCols)
    hyper_step_kernel(float* x, const float* y, int D, const float* fn, const float* scale, const float* base,
                      const float* norm_w, float rms_eps, float hc_eps, int sinkhorn_iters, float* h, float* post,
                      float* comb, float* scratch, bool side) {
  constexpr int kMix = (2 + N) * N, kRows = kMix + N * (N + 1) / 2, kWarps = N * kStepCols / 32;
  const int s = blockIdx.y, blocks = gridDim.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int i = tid / kStepCols, d = blockIdx.x * kStepCols + tid % kStepCols;
  const bool live = d < D;
  const int64_t W = int64_t(N) * D;
  float f[kMix];  // fn is constant: its loads go out before the previous kernel ends
#pragma unroll
  for (int kk = 0; kk < kMix; ++kk) f[kk] = live ? __ldg(fn + kk * W + int64_t(i) * D + d) : 0.0f;
  const float nw = live && i == 0 ? __ldg(norm_w + d) : 0.0f;
  pdl_enter();
  const StepScratch sc(scratch, N);
  float* X = x + s * W;
  float xn[N];
#pragma unroll
  for (int j = 0; j < N; ++j) xn[j] = live ? X[int64_t(j) * D + d] : 0.0f;
  __syncthreads();  // the column's old streams read by all its threads before any is overwritten
  if (y && live) {  // x_j = post_j * y + sum_i comb[i][j] * x_i
    const float yv = y[int64_t(s) * D + d], *ps = post + s * N, *cs = comb + s * N * N;
    float old[N];
#pragma unroll
    for (int j = 0; j < N; ++j) old[j] = xn[j];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float v = ps[j] * yv;
#pragma unroll
      for (int a = 0; a < N; ++a) v += cs[a * N + j] * old[a];
      xn[j] = v;
    }
    X[int64_t(i) * D + d] = xn[i];
  }
  float acc[kRows];
  float mine = 0.0f;
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (j == i) mine = xn[j];
#pragma unroll
  for (int kk = 0; kk < kMix; ++kk) acc[kk] = f[kk] * mine;
#pragma unroll
  for (int a = 0; a < N; ++a)
#pragma unroll
    for (int b = a; b < N; ++b) acc[kMix + pair_slot(N, a, b)] = a == i ? xn[a] * xn[b] : 0.0f;

  // block sums through shared memory: row r's values [r][thread], then a warp per row
  extern __shared__ float red[];  // [kRows][N * kStepCols]
  __shared__ float m_s[kRows];
  __shared__ float pre_s[kMaxStreams];
  constexpr int kThreads = N * kStepCols;
#pragma unroll
  for (int r = 0; r < kRows; ++r) red[r * kThreads + tid] = acc[r];
  __syncthreads();
  for (int r = warp; r < kRows; r += kWarps) {
    float v = 0.0f;
#pragma unroll
    for (int j = 0; j < kThreads / 32; ++j) v += red[r * kThreads + j * 32 + lane];
    v = warp_sum(v);
    if (lane == 0) sc.part[(int64_t(s) * kRows + r) * kStepMaxBlocks + blockIdx.x] = v;
  }
  __threadfence();  // this block's partial sums, before it arrives
  __syncthreads();
  if (tid == 0) grid_barrier(sc.count + s, sc.gen + s, unsigned(blocks));
  __syncthreads();

  // Every block: the sums in block order (a warp per row, a fixed shuffle tree: the same bits in every block), the
  // norms and pre, then h of its own columns from the streams in registers.
  for (int r = warp; r < kRows; r += kWarps) {
    const float* p = sc.part + (int64_t(s) * kRows + r) * kStepMaxBlocks;
    float v = 0.0f;
    for (int b = lane; b < blocks; b += 32) v += __ldcg(p + b);
    v = warp_sum(v);
    if (lane == 0) m_s[r] = v;
  }
  __syncthreads();
  const float* gram = m_s + kMix;
  float xx = 0.0f;
#pragma unroll
  for (int a = 0; a < N; ++a) xx += gram[pair_slot(N, a, a)];
  const float rr = 1.0f / sqrtf(xx / float(W) + rms_eps);
  __syncthreads();
  if (tid < kMix) m_s[tid] *= rr;
  __syncthreads();
  float pre[N];
#pragma unroll
  for (int a = 0; a < N; ++a) pre[a] = sigmoidf(m_s[a] * scale[0] + base[a]) + hc_eps;
  float hss = 0.0f;  // sum_d (sum_i pre_i X_i[d])^2
#pragma unroll
  for (int a = 0; a < N; ++a)
#pragma unroll
    for (int b = 0; b < N; ++b) hss += pre[a] * pre[b] * gram[a <= b ? pair_slot(N, a, b) : pair_slot(N, b, a)];
  const float inv = 1.0f / sqrtf(fmaxf(hss, 0.0f) / float(D) + rms_eps);
  if (i == 0 && live) {
    float v = 0.0f;
#pragma unroll
    for (int a = 0; a < N; ++a) v += pre[a] * xn[a];
    h[int64_t(s) * D + d] = (v * inv) * nw;
  }
  if (blockIdx.x != 0) return;
  if (side) {
    if (tid < kMix) sc.logits[s * kMix + tid] = m_s[tid];
  } else if (tid < 32) {
    mix_weights(m_s, N, scale, base, hc_eps, sinkhorn_iters, pre_s, post + s * N, comb + s * N * N);
  }
}

// post and comb of hyper_step's tokens from the scaled logits it left (one warp per token, on the side stream).
__global__ void hyper_weights_kernel(const float* logits, int n, const float* scale, const float* base, float hc_eps,
                                     int sinkhorn_iters, float* post, float* comb) {
  pdl_enter();
  __shared__ float m_s[(2 + kMaxStreams) * kMaxStreams], pre_s[kMaxStreams];
  const int s = blockIdx.x, mix = (2 + n) * n;
  for (int kk = threadIdx.x; kk < mix; kk += 32) m_s[kk] = logits[s * mix + kk];
  __syncwarp();
  mix_weights(m_s, n, scale, base, hc_eps, sinkhorn_iters, pre_s, post + s * n, comb + s * n * n);
}

__global__ void hyper_leave_kernel(float* x, const float* y, const float* post, const float* comb, int n, int D) {
  pdl_enter();
  const int s = blockIdx.y;
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= D) return;
  float* X = x + int64_t(s) * n * D;
  const float* ps = post + int64_t(s) * n;
  const float* cs = comb + int64_t(s) * n * n;
  float old[kMaxStreams];
  for (int i = 0; i < n; ++i) old[i] = X[int64_t(i) * D + d];
  const float yv = y[int64_t(s) * D + d];
  for (int j = 0; j < n; ++j) {
    float v = ps[j] * yv;
    for (int i = 0; i < n; ++i) v += cs[i * n + j] * old[i];
    X[int64_t(j) * D + d] = v;
  }
}

// The same with 4 adjacent values per thread (D % 4 == 0, 16-byte aligned rows), post and comb read once.
__global__ void __launch_bounds__(kThreads)
    hyper_leave4_kernel(float* x, const float* y, const float* post, const float* comb, int n, int D) {
  pdl_enter();
  const int s = blockIdx.y, d = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (d >= D) return;
  float* X = x + int64_t(s) * n * D + d;
  const float* ps = post + int64_t(s) * n;
  const float* cs = comb + int64_t(s) * n * n;
  float4 old[kStepMaxStreams];
#pragma unroll
  for (int i = 0; i < kStepMaxStreams; ++i)
    if (i < n) old[i] = *reinterpret_cast<const float4*>(X + int64_t(i) * D);
  const float4 yv = *reinterpret_cast<const float4*>(y + int64_t(s) * D + d);
#pragma unroll
  for (int j = 0; j < kStepMaxStreams; ++j) {
    if (j >= n) break;
    const float p = ps[j];
    float4 v = make_float4(p * yv.x, p * yv.y, p * yv.z, p * yv.w);
#pragma unroll
    for (int i = 0; i < kStepMaxStreams; ++i)
      if (i < n) {
        const float c = cs[i * n + j];
        v.x += c * old[i].x, v.y += c * old[i].y, v.z += c * old[i].z, v.w += c * old[i].w;
      }
    *reinterpret_cast<float4*>(X + int64_t(j) * D) = v;
  }
}

__global__ void hyper_expand_kernel(const float* e, int n, int D, float* x) {
  pdl_enter();
  const int s = blockIdx.y;
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= D) return;
  const float v = e[int64_t(s) * D + d];
  for (int i = 0; i < n; ++i) x[(int64_t(s) * n + i) * D + d] = v;
}

__global__ void hyper_collapse_mean_kernel(const float* x, int n, int D, float* out) {
  pdl_enter();
  const int s = blockIdx.y;
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= D) return;
  float v = 0.0f;
  for (int i = 0; i < n; ++i) v += x[(int64_t(s) * n + i) * D + d];
  out[int64_t(s) * D + d] = n > 1 ? v / float(n) : v;
}

void check_streams(int n, const char* what) {
  if (n < 1 || n > kMaxStreams)
    throw std::runtime_error(std::string(what) + ": " + std::to_string(n) + " residual streams (1.." +
                             std::to_string(kMaxStreams) + " supported)");
}

// Throws naming the failed stream call of hyper_enter's side branch.
void side_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("hyper_enter: ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace

size_t hyper_enter_scratch(int S, int n) {
  return S <= kSplitTokens ? size_t(S) * size_t((2 + n) * n + n * (n + 1) / 2) * kDotChunks : 0;
}

bool hyper_step_supported(int S, int n, int D) {
  static const bool off = env_flag("MOESRV_MHC_UNFUSED");  // comparisons: hyper_enter and hyper_leave apart
  static int sms[64] = {};                                 // per device, read once
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  if (!sms[dev] && cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return false;
  return !off && S >= 1 && S <= kSplitTokens && n >= 1 && n <= kStepMaxStreams && D >= 1 &&
         D <= kStepCols * kStepMaxBlocks && int64_t(S) * ceil_div(D, kStepCols) <= sms[dev];
}

size_t hyper_step_scratch(int n) { return StepScratch::floats(n); }

bool hyper_step(float* x, const float* y, int S, int n, int D, const float* fn, const float* scale, const float* base,
                const float* norm_w, float rms_eps, float hc_eps, int sinkhorn_iters, float* h, float* post,
                float* comb, float* scratch, cudaStream_t st, const HyperSide* side) {
  if (!hyper_step_supported(S, n, D))
    throw std::runtime_error("hyper_step: " + std::to_string(S) + " tokens, " + std::to_string(n) + " streams, D " +
                             std::to_string(D) + " not supported");
  const dim3 grid(unsigned(ceil_div(D, kStepCols)), unsigned(S));
  auto go = [&](auto kernel, auto streams) {
    constexpr int N = decltype(streams)::value, threads = N * kStepCols;
    const size_t smem = size_t((2 + N) * N + N * (N + 1) / 2) * threads * sizeof(float);
    reserve_dynamic_smem(kernel, smem, "hyper_step");  // over the default 48 KB (per device: every launch)
    launch(kernel, grid, threads, smem, st, x, y, D, fn, scale, base, norm_w, rms_eps, hc_eps, sinkhorn_iters, h, post,
           comb, scratch, side != nullptr);
  };
  switch (n) {
    case 1: go(hyper_step_kernel<1>, std::integral_constant<int, 1>{}); break;
    case 2: go(hyper_step_kernel<2>, std::integral_constant<int, 2>{}); break;
    case 3: go(hyper_step_kernel<3>, std::integral_constant<int, 3>{}); break;
    default: go(hyper_step_kernel<4>, std::integral_constant<int, 4>{});
  }
  MOESRV_CUDA_LAUNCH_CHECK();
  if (!side) return false;
  side_ok(cudaEventRecord(side->fork, st), "cudaEventRecord");
  side_ok(cudaStreamWaitEvent(side->stream, side->fork, 0), "cudaStreamWaitEvent");
  launch(hyper_weights_kernel, unsigned(S), 32, 0, side->stream, StepScratch(scratch, n).logits, n, scale, base, hc_eps,
         sinkhorn_iters, post, comb);
  MOESRV_CUDA_LAUNCH_CHECK();
  side_ok(cudaEventRecord(side->join, side->stream), "cudaEventRecord");
  return true;
}

bool hyper_enter(const float* x, int S, int n, int D, const float* fn, const float* scale, const float* base,
                 const float* norm_w, float rms_eps, float hc_eps, int sinkhorn_iters, float* h, float* post,
                 float* comb, float* part, cudaStream_t st, void* cublas, const HyperSide* side) {
  check_streams(n, "hyper_enter");
  if (S <= 0) return false;
  const int mix = (2 + n) * n;
  const int64_t W = int64_t(n) * D;
  if (part && S <= kSplitTokens) {
    // Few tokens (decode): one block per token would read fn ((2+n)*n rows of n*D) on one SM and run the Sinkhorn
    // chain while the block waits; the logits and stream products go to (rows x chunks) blocks per token first,
    // then h and the weights are made by different blocks.
    const int rows = mix + n * (n + 1) / 2, chunks = std::clamp(D / 32, 1, kDotChunks);
    launch(hyper_dot_kernel, dim3(unsigned(rows), unsigned(chunks), unsigned(S)), kThreads, 0, st, x, n, D, fn, mix, 0,
           true, part, int64_t(rows) * chunks);
    MOESRV_CUDA_LAUNCH_CHECK();
    const int blocks = std::min(ceil_div(D, kThreads), 64);
    if (side) {  // the Sinkhorn weights on the side stream, h on st
      side_ok(cudaEventRecord(side->fork, st), "cudaEventRecord");
      side_ok(cudaStreamWaitEvent(side->stream, side->fork, 0), "cudaStreamWaitEvent");
      launch(hyper_enter_split_kernel, dim3(1, unsigned(S)), kThreads, 0, side->stream, x, n, D, scale, base, norm_w,
             rms_eps, hc_eps, sinkhorn_iters, chunks, part, h, post, comb, 0);
      MOESRV_CUDA_LAUNCH_CHECK();
      side_ok(cudaEventRecord(side->join, side->stream), "cudaEventRecord");
    }
    launch(hyper_enter_split_kernel, dim3(unsigned(side ? blocks : blocks + 1), unsigned(S)), kThreads, 0, st, x, n, D,
           scale, base, norm_w, rms_eps, hc_eps, sinkhorn_iters, chunks, part, h, post, comb, blocks);
    MOESRV_CUDA_LAUNCH_CHECK();
    return side != nullptr;
  }
  int chunks = 0;
  if (cublas && D > mix) {
    // Many tokens (prefill): a block per token would read all of fn per token; the logits of every token as one fp32
    // GEMM into the tokens' h rows (h[s][kk] = fn[kk] . X_s), X . X per token into h[s][mix]: one chunk each.
    cublasHandle_t blas = static_cast<cublasHandle_t>(cublas);
    cudaStream_t cur = nullptr;
    if (cublasGetStream(blas, &cur) != CUBLAS_STATUS_SUCCESS ||
        (cur != st && cublasSetStream(blas, st) != CUBLAS_STATUS_SUCCESS))
      throw std::runtime_error("hyper_enter: cublas stream");
    const float one = 1.0f, zero = 0.0f;
    if (cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, mix, S, int(W), &one, fn, int(W), x, int(W), &zero, h, D) !=
        CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error("hyper_enter: cublasSgemm failed");
    // h by hyper_enter_h_kernel, the weights by hyper_weights_inplace_kernel; where they do not apply (more than 4
    // streams, D > 4096, unaligned rows) or with MOESRV_MHC_ENTER_REGS=0 (comparisons), X . X by hyper_dot_kernel and
    // the rest by hyper_enter_kernel. (Session 33 removed the form between them, one 1024-thread block per token
    // with the weights in it: 490 us at 4K tokens against 131 + 19, docs/perf-cuda.md, twenty-fifth round.)
    static const bool regs = env_choice("MOESRV_MHC_ENTER_REGS", 0, 1, 1) != 0;
    const int NV = ceil_div(D / 4, kEnterHThreads);
    if (regs && n <= 4 && D % 4 == 0 && NV <= kEnterHMaxVec && aligned16(x) && aligned16(h) && aligned16(norm_w)) {
      auto go = [&](auto kernel) {
        launch(kernel, S, kEnterHThreads, 0, st, x, n, D, scale, base, norm_w, rms_eps, hc_eps, h, post, comb);
      };
      if (NV == 1) go(hyper_enter_h_kernel<1>);
      else if (NV == 2) go(hyper_enter_h_kernel<2>);
      else go(hyper_enter_h_kernel<4>);
      MOESRV_CUDA_LAUNCH_CHECK();
      launch(hyper_weights_inplace_kernel, S, 32, 0, st, n, scale, base, hc_eps, sinkhorn_iters, post, comb);
      MOESRV_CUDA_LAUNCH_CHECK();
      return false;
    }
    launch(hyper_dot_kernel, dim3(1, 1, unsigned(S)), kThreads, 0, st, x, n, D, fn, mix, mix, false, h, D);
    MOESRV_CUDA_LAUNCH_CHECK();
    chunks = 1;
  }
  launch(hyper_enter_kernel, S, kEnterThreads, 0, st, x, n, D, fn, scale, base, norm_w, rms_eps, hc_eps, sinkhorn_iters,
         chunks, h, post, comb);
  MOESRV_CUDA_LAUNCH_CHECK();
  return false;
}

void hyper_leave(float* x, const float* y, const float* post, const float* comb, int S, int n, int D, cudaStream_t st) {
  check_streams(n, "hyper_leave");
  if (S <= 0) return;
  if (n <= kStepMaxStreams && D % 4 == 0 && aligned16(x) && aligned16(y))
    launch(hyper_leave4_kernel, dim3(unsigned(ceil_div(D / 4, kThreads)), unsigned(S)), kThreads, 0, st, x, y, post,
           comb, n, D);
  else
    launch(hyper_leave_kernel, dim3(unsigned(ceil_div(D, kThreads)), unsigned(S)), kThreads, 0, st, x, y, post, comb, n,
           D);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void hyper_expand(const float* e, int S, int n, int D, float* x, cudaStream_t st) {
  if (S <= 0) return;
  launch(hyper_expand_kernel, dim3(unsigned(ceil_div(D, kThreads)), unsigned(S)), kThreads, 0, st, e, n, D, x);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void hyper_collapse_mean(const float* x, int S, int n, int D, float* out, cudaStream_t st) {
  if (S <= 0) return;
  launch(hyper_collapse_mean_kernel, dim3(unsigned(ceil_div(D, kThreads)), unsigned(S)), kThreads, 0, st, x, n, D, out);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
