// DeepSeek sparse attention's lightning indexer: scores every cached key with a few cheap ReLU heads and
// keeps the index_topk best positions per query token.
#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/ops.h"
#include "util/thread_pool.h"

namespace moesrv::cpu {

namespace {

// The k best (score, position) pairs, best first; equal scores keep the lower position. Positions >= n_valid
// (causally masked, score -inf) are never selected.
void select_top(std::vector<std::pair<float, int64_t>>& ranked, int64_t k, int64_t n_valid, std::vector<int32_t>& out) {
  k = std::min(k, n_valid);
  std::partial_sort(ranked.begin(), ranked.begin() + k, ranked.begin() + n_valid, [](const auto& x, const auto& y) {
    return x.first > y.first || (x.first == y.first && x.second < y.second);
  });
  out.clear();
  for (int64_t i = 0; i < k; ++i) out.push_back(int32_t(ranked[size_t(i)].second));
}

}  // namespace

TokenSelection dsa_select(const IndexerWeights& w, const ModelConfig& c, const Rope& rope, const float* x,
                          const float* q_latent, int64_t S, int64_t pos0, LayerState& cache) {
  const int64_t nh = c.index_n_heads, d = c.index_head_dim, T = pos0 + S;
  std::vector<float> q(size_t(S * nh * d)), k(size_t(S * d)), hw(size_t(S * nh));
  w.wq_b->forward(q_latent, S, q.data());
  w.wk->forward(x, S, k.data());
  w.weights_proj->forward(x, S, hw.data());
  layer_norm(k.data(), w.k_norm.weight.data(), w.k_norm.bias.data(), S, d, 1e-6, k.data());
  cache.index_k.resize(size_t(T * d));
  for (int64_t s = 0; s < S; ++s) {
    rope.apply(k.data() + s * d, pos0 + s, c.index_rope_layout);
    std::copy(k.data() + s * d, k.data() + (s + 1) * d, cache.index_k.data() + (pos0 + s) * d);
    for (int64_t h = 0; h < nh; ++h) rope.apply(q.data() + (s * nh + h) * d, pos0 + s, c.index_rope_layout);
  }
  const float head_scale = 1.0f / std::sqrt(float(nh)), softmax_scale = 1.0f / std::sqrt(float(d));
  TokenSelection sel(static_cast<size_t>(S));
  ThreadPool::global().parallel_for(S, [&](int64_t b, int64_t e) {
    std::vector<std::pair<float, int64_t>> ranked;
    for (int64_t s = b; s < e; ++s) {
      const int64_t n = pos0 + s + 1;  // causal: keys 0..pos; later keys of this batch are masked
      ranked.resize(size_t(T));
      for (int64_t t = 0; t < T; ++t) {
        float acc = -std::numeric_limits<float>::infinity();
        if (t < n) {
          acc = 0;
          for (int64_t h = 0; h < nh; ++h) {
            float qk = dot(q.data() + (s * nh + h) * d, cache.index_k.data() + t * d, d) * softmax_scale;
            acc += std::max(qk, 0.0f) * (hw[size_t(s * nh + h)] * head_scale);
          }
        }
        ranked[size_t(t)] = {acc, t};
      }
      select_top(ranked, c.index_topk, n, sel[size_t(s)]);
    }
  });
  return sel;
}

}  // namespace moesrv::cpu
