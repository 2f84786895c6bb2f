// The residual around each sub-layer: plain (x += y) or mHC hyper-connections over `streams` copies of the
// hidden vector. enter() makes the sub-layer input h = norm(collapse(x)); leave() merges its output y into x.
#pragma once
#include <cstdint>
#include <vector>

#include "model/weights.h"

namespace moesrv::cpu {

class Residual {
 public:
  explicit Residual(const ModelSpec& c) : c_(c) {}
  // x: [S, stream_width]; h: [S, hidden]. `hc` is the site's mHC weights (ignored for a plain residual).
  void enter(const float* x, int64_t S, const NormWeights& norm, const HyperWeights& hc, float* h);
  // x: [S, stream_width] updated in place from y [S, hidden] with the mixing enter() computed.
  void leave(float* x, int64_t S, const float* y);

 private:
  const ModelSpec& c_;
  std::vector<float> post_, comb_;  // per token: [streams], [streams x streams]
};

// Per-token mHC mixing weights from the streams X [hc, D] (fp32, as transformers computes them): pre [hc],
// post [hc], comb [hc x hc] (Sinkhorn-normalised).
void hyper_mix(const float* x, const HyperWeights& w, int64_t hc, int64_t D, double rms_eps, double hc_eps,
               int64_t sinkhorn_iters, float* pre, float* post, float* comb);

}  // namespace moesrv::cpu
