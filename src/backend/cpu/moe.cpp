// Dense SwiGLU MLP and the routed mixture of experts (tokens grouped per expert, plus shared experts).
#include <algorithm>
#include <cmath>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/expert_batch.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/ops.h"
#include "model/router.h"

namespace moesrv::cpu {

void mlp_forward(const MlpWeights& w, const float* x, int64_t S, float* out) {
  const int64_t inter = w.gate->out_features();
  std::vector<float> g(size_t(S * inter)), u(size_t(S * inter));
  w.gate->forward(x, S, g.data());
  w.up->forward(x, S, u.data());
  if (w.limit > 0)
    for (size_t i = 0; i < g.size(); ++i) {
      g[i] = std::min(g[i], w.limit);
      u[i] = std::clamp(u[i], -w.limit, w.limit);
    }
  silu_mul(g.data(), u.data(), S * inter, g.data());
  w.down->forward(g.data(), S, out);
}

void moe_forward(const MoeWeights& w, const ModelSpec& c, const float* x, int64_t S, float* out, UsageStats* usage,
                 int64_t layer) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts;
  std::vector<float> logits(size_t(S * E));
  gemm_f32(x, S, w.router.data(), E, D, logits.data());
  // Group the batch's tokens by expert so each expert's weights are read once.
  std::vector<std::vector<std::pair<int64_t, float>>> assigned(static_cast<size_t>(E));
  for (int64_t s = 0; s < S; ++s) {
    RoutedExperts r = route_token(logits.data() + s * E, w.router_bias.data(), c);
    if (usage) usage->record(layer, r.ids);
    for (size_t i = 0; i < r.ids.size(); ++i) assigned[size_t(r.ids[i])].push_back({s, r.weights[i]});
  }
  if (w.shared) {
    mlp_forward(*w.shared, x, S, out);
    if (!w.shared_gate.empty())
      for (int64_t s = 0; s < S; ++s) {
        const float gate = 1.0f / (1.0f + std::exp(-dot(x + s * D, w.shared_gate.data(), D)));
        for (int64_t d = 0; d < D; ++d) out[s * D + d] *= gate;
      }
  } else {
    std::fill(out, out + S * D, 0.0f);
  }
  std::vector<RoutedRows> jobs;
  for (int64_t e = 0; e < E; ++e) {
    const auto& toks = assigned[size_t(e)];
    if (toks.empty()) continue;
    RoutedRows& j = jobs.emplace_back();
    j.expert = &w.experts[size_t(e)];
    for (const auto& [t, wt] : toks) j.tokens.push_back(int32_t(t)), j.weights.push_back(wt);
  }
  add_routed_experts(jobs, x, D, out);
}

}  // namespace moesrv::cpu
