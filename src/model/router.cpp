#include "model/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace moesrv {

RoutedExperts route_token(const float* logits, const float* bias, const ModelSpec& c) {
  const int64_t E = c.n_routed_experts, G = c.n_group, per = E / G;
  std::vector<float> s(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
  if (c.router == RouterKind::Softmax) {  // softmax over all experts; no correction bias
    float mx = *std::max_element(logits, logits + E);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += s[size_t(e)] = std::exp(logits[e] - mx);
    for (int64_t e = 0; e < E; ++e) choice[size_t(e)] = s[size_t(e)] = float(s[size_t(e)] / sum);
  } else {
    for (int64_t e = 0; e < E; ++e) {
      s[size_t(e)] = 1.0f / (1.0f + std::exp(-logits[e]));
      choice[size_t(e)] = s[size_t(e)] + bias[e];
    }
  }
  if (G > 1) {
    // Group score: sum of the two best biased scores in the group; keep the topk_group best groups.
    std::vector<std::pair<float, int64_t>> groups(static_cast<size_t>(G));
    for (int64_t g = 0; g < G; ++g) {
      std::vector<float> v(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::partial_sort(v.begin(), v.begin() + std::min<int64_t>(2, per), v.end(), std::greater<>());
      groups[size_t(g)] = {v[0] + (per > 1 ? v[1] : 0.0f), g};
    }
    std::partial_sort(groups.begin(), groups.begin() + c.topk_group, groups.end(),
                      [](auto& a, auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
    std::vector<bool> keep(static_cast<size_t>(G), false);
    for (int64_t i = 0; i < c.topk_group; ++i) keep[size_t(groups[size_t(i)].second)] = true;
    for (int64_t e = 0; e < E; ++e)
      if (!keep[size_t(e / per)]) choice[size_t(e)] = -std::numeric_limits<float>::infinity();
  }
  std::vector<int32_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + c.experts_per_token, order.end(), [&](int32_t a, int32_t b) {
    return choice[size_t(a)] > choice[size_t(b)] || (choice[size_t(a)] == choice[size_t(b)] && a < b);
  });
  RoutedExperts r;
  r.ids.assign(order.begin(), order.begin() + c.experts_per_token);
  float sum = 0;
  for (int32_t id : r.ids) {
    r.weights.push_back(s[size_t(id)]);
    sum += s[size_t(id)];
  }
  for (float& w : r.weights) {
    if (c.norm_topk_prob) w /= (sum + 1e-20f);
    w *= float(c.routed_scaling_factor);
  }
  return r;
}

}  // namespace moesrv
