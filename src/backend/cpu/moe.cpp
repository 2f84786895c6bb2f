// Dense SwiGLU MLP and the routed mixture of experts (tokens grouped per expert, plus shared experts).
#include <algorithm>
#include <cmath>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/exl3_gemv.h"
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
  // Experts with few rows (decode) run together first (experts_forward: EXL3 experts share parallel loops); the others
  // one at a time below. Either way the outputs are added in expert order, as one expert at a time would.
  const int64_t few = exl3_gemv_fast_rows(exl3_gemv_default_path());
  int64_t rows = 0;
  for (const auto& toks : assigned)
    if (int64_t(toks.size()) <= few) rows += int64_t(toks.size());
  std::vector<float> xs(size_t(rows * D)), ys(size_t(rows * D));
  std::vector<ExpertRows> jobs;
  std::vector<const float*> out_of(size_t(E), nullptr);  // expert e's output rows, when computed in the batch
  auto gather = [&](const std::vector<std::pair<int64_t, float>>& toks, float* dst) {
    for (size_t i = 0; i < toks.size(); ++i) std::copy(x + toks[i].first * D, x + (toks[i].first + 1) * D, dst + i * D);
  };
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    const auto& toks = assigned[size_t(e)];
    const int64_t n = int64_t(toks.size());
    if (n == 0 || n > few) continue;
    gather(toks, xs.data() + row * D);
    jobs.push_back({&w.experts[size_t(e)], xs.data() + row * D, n, ys.data() + row * D});
    out_of[size_t(e)] = ys.data() + row * D;
    row += n;
  }
  experts_forward(jobs);
  std::vector<float> xl, yl;
  for (int64_t e = 0; e < E; ++e) {
    const auto& toks = assigned[size_t(e)];
    const int64_t n = int64_t(toks.size());
    if (n == 0) continue;
    const float* ye = out_of[size_t(e)];
    if (!ye) {
      xl.resize(size_t(n * D));
      yl.resize(size_t(n * D));
      gather(toks, xl.data());
      mlp_forward(w.experts[size_t(e)], xl.data(), n, yl.data());
      ye = yl.data();
    }
    for (int64_t i = 0; i < n; ++i) axpy(toks[size_t(i)].second, ye + i * D, D, out + toks[size_t(i)].first * D);
  }
}

}  // namespace moesrv::cpu
