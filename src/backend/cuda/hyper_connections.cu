// mHC (manifold-constrained hyper-connections) around each sub-layer: the per-token mixing weights (pre, post,
// Sinkhorn comb), the collapsed and normalised sub-layer input, and the stream update; one block per token.
// Same math and eps placements as cpu::hyper_mix / cpu::Residual (src/backend/cpu/residual.cpp).
#include <cmath>
#include <string>

#include "backend/cuda/glm5_next_kernels.h"
#include "backend/cuda/kernel_util.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kMaxStreams = 8, kThreads = 256;
constexpr int kSplitTokens = 16;  // hyper_enter: up to this many tokens, the mixing logits use more blocks

__device__ __forceinline__ float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

// Raw mixing logit fn[kk] . X of token s by a whole block (thread-strided partial sums, then block_sum): the same
// summation order as hyper_enter_kernel's own loop.
__global__ void __launch_bounds__(kThreads) hyper_dot_kernel(const float* x, int n, int D, const float* fn, float* h) {
  const int kk = blockIdx.x, s = blockIdx.y;
  const int64_t W = int64_t(n) * D;
  const float *X = x + s * W, *row = fn + kk * W;
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < W; i += blockDim.x) acc += row[i] * X[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) h[int64_t(s) * D + kk] = acc;  // parked in the token's h row until hyper_enter_kernel
}

// One block per token. dots_ready: the raw logits fn . X were parked in h[s][0, mix) by hyper_dot_kernel (decode:
// spread over mix blocks per token); else this block computes them, 8 rows per pass over X.
__global__ void __launch_bounds__(kThreads)
    hyper_enter_kernel(const float* x, int n, int D, const float* fn, const float* scale, const float* base,
                       const float* norm_w, float rms_eps, float hc_eps, int sinkhorn_iters, bool dots_ready, float* h,
                       float* post_out, float* comb_out) {
  constexpr int kRows = 8;
  __shared__ float m_s[(2 + kMaxStreams) * kMaxStreams], pre_s[kMaxStreams];
  const int s = blockIdx.x, tid = threadIdx.x;
  const int64_t W = int64_t(n) * D;
  const int mix = (2 + n) * n;
  const float* X = x + s * W;

  // m = fn . X * rsqrt(mean(X^2) + rms_eps)
  float ss = 0.0f;
  for (int64_t i = tid; i < W; i += blockDim.x) ss += X[i] * X[i];
  ss = block_sum(ss);
  const float r = 1.0f / sqrtf(ss / float(W) + rms_eps);
  if (dots_ready) {
    for (int kk = tid; kk < mix; kk += blockDim.x) m_s[kk] = h[int64_t(s) * D + kk] * r;
  } else {
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

  if (tid == 0) {  // n <= 8: a few hundred flops, serial
    float comb[kMaxStreams * kMaxStreams];
    float* post = post_out + int64_t(s) * n;
    for (int i = 0; i < n; ++i) {
      pre_s[i] = sigmoidf(m_s[i] * scale[0] + base[i]) + hc_eps;
      post[i] = 2.0f * sigmoidf(m_s[n + i] * scale[1] + base[n + i]);
    }
    for (int i = 0; i < n; ++i) {  // row softmax of the comb logits, + eps
      float* row = comb + i * n;
      float mx = -INFINITY;
      for (int j = 0; j < n; ++j) {
        row[j] = m_s[2 * n + i * n + j] * scale[2] + base[2 * n + i * n + j];
        mx = fmaxf(mx, row[j]);
      }
      float sum = 0.0f;
      for (int j = 0; j < n; ++j) sum += row[j] = expf(row[j] - mx);
      const float inv = 1.0f / sum;
      for (int j = 0; j < n; ++j) row[j] = row[j] * inv + hc_eps;
    }
    for (int it = 0; it < max(sinkhorn_iters, 1); ++it) {
      if (it > 0)  // rows (from the second iteration on), then columns
        for (int i = 0; i < n; ++i) {
          float sum = 0.0f;
          for (int j = 0; j < n; ++j) sum += comb[i * n + j];
          for (int j = 0; j < n; ++j) comb[i * n + j] /= sum + hc_eps;
        }
      for (int j = 0; j < n; ++j) {
        float sum = 0.0f;
        for (int i = 0; i < n; ++i) sum += comb[i * n + j];
        for (int i = 0; i < n; ++i) comb[i * n + j] /= sum + hc_eps;
      }
    }
    for (int i = 0; i < n * n; ++i) comb_out[int64_t(s) * n * n + i] = comb[i];
  }
  __syncthreads();

  // h = rms_norm(sum_i pre_i X_i) * norm_w
  float* hs = h + int64_t(s) * D;
  float hss = 0.0f;
  for (int d = tid; d < D; d += blockDim.x) {
    float v = 0.0f;
    for (int i = 0; i < n; ++i) v += pre_s[i] * X[int64_t(i) * D + d];
    hs[d] = v;
    hss += v * v;
  }
  hss = block_sum(hss);
  const float inv = 1.0f / sqrtf(hss / float(D) + rms_eps);
  for (int d = tid; d < D; d += blockDim.x) hs[d] = (hs[d] * inv) * norm_w[d];
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
                 float* comb, cudaStream_t st) {
  check_streams(n, "hyper_enter");
  if (S <= 0) return;
  // Few tokens (decode): one block per token would read fn ((2+n)*n rows of n*D) on one SM; spread the logits over
  // (2+n)*n blocks per token first.
  const int mix = (2 + n) * n;
  const bool split = S <= kSplitTokens && D >= mix;
  if (split) {
    hyper_dot_kernel<<<dim3(unsigned(mix), unsigned(S)), kThreads, 0, st>>>(x, n, D, fn, h);
    MOESRV_CUDA_LAUNCH_CHECK();
  }
  hyper_enter_kernel<<<S, kThreads, 0, st>>>(x, n, D, fn, scale, base, norm_w, rms_eps, hc_eps, sinkhorn_iters, split,
                                             h, post, comb);
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
