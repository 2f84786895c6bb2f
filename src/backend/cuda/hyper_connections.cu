// mHC (manifold-constrained hyper-connections) around each sub-layer: the per-token mixing weights (pre, post,
// Sinkhorn comb), the collapsed and normalised sub-layer input, and the stream update; one block per token.
// Same math and eps placements as cpu::hyper_mix / cpu::Residual (src/backend/cpu/residual.cpp).
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "backend/cuda/glm5_next_kernels.h"
#include "backend/cuda/kernel_util.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kMaxStreams = 8, kThreads = 256, kEnterThreads = 1024;
constexpr int kSplitTokens = 16;  // hyper_enter: up to this many tokens, the mixing logits use more blocks
constexpr int kDotChunks = 16;    // ... each of them split over up to this many blocks

__device__ __forceinline__ float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

// Decode: the mixing logits fn[kk] . X (kk < mix) and X . X (kk == mix) of token s, chunk c of the n*D values per
// block (grid (mix + 1 - kk0, chunks, S), kk = kk0 + x), so that hundreds of blocks share the reads. The partial sums
// are parked in the token's h row at [kk * chunks + c] until hyper_enter_kernel adds them up in chunk order.
__global__ void __launch_bounds__(kThreads)
    hyper_dot_kernel(const float* x, int n, int D, const float* fn, int mix, int kk0, float* h) {
  const int kk = kk0 + blockIdx.x, c = blockIdx.y, chunks = gridDim.y, s = blockIdx.z;
  const int64_t W = int64_t(n) * D, per = (W + chunks - 1) / chunks, i0 = c * per, i1 = min(W, i0 + per);
  const float* X = x + s * W;
  const float* row = kk < mix ? fn + kk * W : X;
  float acc = 0.0f;
#pragma unroll 4
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) acc += row[i] * X[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) h[int64_t(s) * D + kk * chunks + c] = acc;
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

// One block per token. dot_chunks > 0: hyper_dot_kernel left the partial logits and X . X in h (decode); else this
// block computes them, 8 rows per pass over X.
__global__ void __launch_bounds__(kEnterThreads)
    hyper_enter_kernel(const float* x, int n, int D, const float* fn, const float* scale, const float* base,
                       const float* norm_w, float rms_eps, float hc_eps, int sinkhorn_iters, int dot_chunks, float* h,
                       float* post_out, float* comb_out) {
  constexpr int kRows = 8;
  __shared__ float m_s[(2 + kMaxStreams) * kMaxStreams + 1], pre_s[kMaxStreams];
  const int s = blockIdx.x, tid = threadIdx.x;
  const int64_t W = int64_t(n) * D;
  const int mix = (2 + n) * n;
  const float* X = x + s * W;

  // m = fn . X * rsqrt(mean(X^2) + rms_eps)
  if (dot_chunks > 0) {
    if (tid <= mix) {
      float p[kDotChunks], t = 0.0f;  // all loads first, then the sum in chunk order
#pragma unroll
      for (int c = 0; c < kDotChunks; ++c) p[c] = c < dot_chunks ? h[int64_t(s) * D + tid * dot_chunks + c] : 0.0f;
#pragma unroll
      for (int c = 0; c < kDotChunks; ++c)
        if (c < dot_chunks) t += p[c];
      m_s[tid] = t;
    }
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

__global__ void hyper_leave_kernel(float* x, const float* y, const float* post, const float* comb, int n, int D) {
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

__global__ void hyper_expand_kernel(const float* e, int n, int D, float* x) {
  const int s = blockIdx.y;
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= D) return;
  const float v = e[int64_t(s) * D + d];
  for (int i = 0; i < n; ++i) x[(int64_t(s) * n + i) * D + d] = v;
}

__global__ void hyper_collapse_mean_kernel(const float* x, int n, int D, float* out) {
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

}  // namespace

void hyper_enter(const float* x, int S, int n, int D, const float* fn, const float* scale, const float* base,
                 const float* norm_w, float rms_eps, float hc_eps, int sinkhorn_iters, float* h, float* post,
                 float* comb, cudaStream_t st, void* cublas) {
  check_streams(n, "hyper_enter");
  if (S <= 0) return;
  // Few tokens (decode): one block per token would read fn ((2+n)*n rows of n*D) on one SM; the logits and X . X go
  // to (mix + 1) x chunks blocks per token first (their partials fit the token's h row).
  const int mix = (2 + n) * n;
  const int64_t W = int64_t(n) * D;
  int chunks = S <= kSplitTokens ? std::min(kDotChunks, D / (mix + 1)) : 0;
  if (chunks > 0) {
    hyper_dot_kernel<<<dim3(unsigned(mix + 1), unsigned(chunks), unsigned(S)), kThreads, 0, st>>>(x, n, D, fn, mix, 0,
                                                                                                  h);
    MOESRV_CUDA_LAUNCH_CHECK();
  } else if (cublas && D > mix) {
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
    hyper_dot_kernel<<<dim3(1, 1, unsigned(S)), kThreads, 0, st>>>(x, n, D, fn, mix, mix, h);
    MOESRV_CUDA_LAUNCH_CHECK();
    chunks = 1;
  }
  hyper_enter_kernel<<<S, kEnterThreads, 0, st>>>(x, n, D, fn, scale, base, norm_w, rms_eps, hc_eps, sinkhorn_iters,
                                                  chunks, h, post, comb);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void hyper_leave(float* x, const float* y, const float* post, const float* comb, int S, int n, int D, cudaStream_t st) {
  check_streams(n, "hyper_leave");
  if (S <= 0) return;
  hyper_leave_kernel<<<dim3(unsigned(ceil_div(D, kThreads)), unsigned(S)), kThreads, 0, st>>>(x, y, post, comb, n, D);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void hyper_expand(const float* e, int S, int n, int D, float* x, cudaStream_t st) {
  if (S <= 0) return;
  hyper_expand_kernel<<<dim3(unsigned(ceil_div(D, kThreads)), unsigned(S)), kThreads, 0, st>>>(e, n, D, x);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void hyper_collapse_mean(const float* x, int S, int n, int D, float* out, cudaStream_t st) {
  if (S <= 0) return;
  hyper_collapse_mean_kernel<<<dim3(unsigned(ceil_div(D, kThreads)), unsigned(S)), kThreads, 0, st>>>(x, n, D, out);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
