#include "backend/cpu/residual.h"

#include <cmath>

#include "backend/cpu/linear.h"
#include "backend/cpu/ops.h"
#include "util/thread_pool.h"

namespace moesrv::cpu {

namespace {
float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }
}  // namespace

void hyper_mix(const float* x, const HyperWeights& w, int64_t hc, int64_t D, double rms_eps, double hc_eps,
               int64_t sinkhorn_iters, float* pre, float* post, float* comb) {
  const int64_t W = hc * D, mix = (2 + hc) * hc;
  const float eps = float(hc_eps);
  double ss = 0;
  for (int64_t i = 0; i < W; ++i) ss += double(x[i]) * double(x[i]);
  const float r = 1.0f / std::sqrt(float(ss / double(W)) + float(rms_eps));
  std::vector<float> m(static_cast<size_t>(mix));
  for (int64_t k = 0; k < mix; ++k) m[size_t(k)] = dot(w.fn.data() + k * W, x, W) * r;
  for (int64_t i = 0; i < hc; ++i) {
    pre[i] = sigmoid(m[size_t(i)] * w.scale[0] + w.base[size_t(i)]) + eps;
    post[i] = 2.0f * sigmoid(m[size_t(hc + i)] * w.scale[1] + w.base[size_t(hc + i)]);
  }
  for (int64_t i = 0; i < hc; ++i) {  // row softmax of the comb logits, + eps
    float* row = comb + i * hc;
    for (int64_t j = 0; j < hc; ++j) row[j] = m[size_t(2 * hc + i * hc + j)] * w.scale[2] + w.base[size_t(2 * hc + i * hc + j)];
    softmax(row, hc);
    for (int64_t j = 0; j < hc; ++j) row[j] += eps;
  }
  auto normalize_columns = [&] {
    for (int64_t j = 0; j < hc; ++j) {
      float s = 0;
      for (int64_t i = 0; i < hc; ++i) s += comb[i * hc + j];
      for (int64_t i = 0; i < hc; ++i) comb[i * hc + j] /= s + eps;
    }
  };
  normalize_columns();
  for (int64_t it = 1; it < sinkhorn_iters; ++it) {
    for (int64_t i = 0; i < hc; ++i) {
      float s = 0;
      for (int64_t j = 0; j < hc; ++j) s += comb[i * hc + j];
      for (int64_t j = 0; j < hc; ++j) comb[i * hc + j] /= s + eps;
    }
    normalize_columns();
  }
}

void Residual::enter(const float* x, int64_t S, const NormWeights& norm, const HyperWeights& hc, float* h) {
  const int64_t D = c_.hidden_size, n = c_.residual.streams;
  if (!c_.residual.hyper) {
    rms_norm(x, norm.weight.data(), S, D, c_.rms_eps, h);
    return;
  }
  post_.resize(size_t(S * n));
  comb_.resize(size_t(S * n * n));
  ThreadPool::global().parallel_for(S, [&](int64_t b, int64_t e) {
    std::vector<float> pre(static_cast<size_t>(n));
    for (int64_t s = b; s < e; ++s) {
      const float* X = x + s * n * D;
      hyper_mix(X, hc, n, D, c_.rms_eps, c_.residual.eps, c_.residual.sinkhorn_iters, pre.data(),
                post_.data() + s * n, comb_.data() + s * n * n);
      float* hs = h + s * D;
      for (int64_t d = 0; d < D; ++d) hs[d] = 0;
      for (int64_t i = 0; i < n; ++i) axpy(pre[size_t(i)], X + i * D, D, hs);
    }
  });
  rms_norm(h, norm.weight.data(), S, D, c_.rms_eps, h);
}

void Residual::leave(float* x, int64_t S, const float* y) {
  const int64_t D = c_.hidden_size, n = c_.residual.streams;
  if (!c_.residual.hyper) {
    for (int64_t i = 0; i < S * D; ++i) x[i] += y[i];
    return;
  }
  ThreadPool::global().parallel_for(S, [&](int64_t b, int64_t e) {
    std::vector<float> old(static_cast<size_t>(n * D));
    for (int64_t s = b; s < e; ++s) {
      float* X = x + s * n * D;
      std::copy(X, X + n * D, old.begin());
      const float *post = post_.data() + s * n, *comb = comb_.data() + s * n * n;
      for (int64_t j = 0; j < n; ++j) {
        float* out = X + j * D;
        for (int64_t d = 0; d < D; ++d) out[d] = post[j] * y[s * D + d];
        for (int64_t i = 0; i < n; ++i) axpy(comb[i * n + j], old.data() + i * D, D, out);
      }
    }
  });
}

}  // namespace moesrv::cpu
