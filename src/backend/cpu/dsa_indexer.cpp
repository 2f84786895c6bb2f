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

// Top-k by score over the whole masked row, selected like PyTorch's CPU topk (nth_element on (score, index)
// pairs): ReLU scores tie at exactly zero often, and this keeps tie resolution identical to the reference.
// Returns true when the k-th score ties with a score left out: the selection is then ambiguous (the
// reference's own choice depends on its sort internals).
bool select_top(std::vector<std::pair<float, int64_t>>& ranked, int64_t k, int64_t n_valid, std::vector<int32_t>& out) {
  auto greater = [](const std::pair<float, int64_t>& x, const std::pair<float, int64_t>& y) { return x.first > y.first; };
  // PyTorch keeps a heap of k when k * 64 <= n, else runs nth_element over the whole row.
  if (k * 64 <= int64_t(ranked.size())) {
    std::make_heap(ranked.begin(), ranked.begin() + k, greater);
    for (size_t i = size_t(k); i < ranked.size(); ++i)
      if (greater(ranked[i], ranked[0])) {
        auto v = ranked[i];
        std::pop_heap(ranked.begin(), ranked.begin() + k, greater);
        ranked[size_t(k - 1)] = v;
        std::push_heap(ranked.begin(), ranked.begin() + k, greater);
      }
  } else {
    std::nth_element(ranked.begin(), ranked.begin() + k - 1, ranked.end(), greater);
  }
  out.clear();
  float kth = ranked[size_t(k - 1)].first;
  for (int64_t i = 0; i < k; ++i) {
    if (ranked[size_t(i)].second < n_valid) out.push_back(int32_t(ranked[size_t(i)].second));
    kth = std::min(kth, ranked[size_t(i)].first);
  }
  for (size_t i = size_t(k); i < ranked.size(); ++i)
    if (ranked[i].first == kth && ranked[i].second < n_valid) return true;
  return false;
}

}  // namespace

TokenSelection dsa_select(const IndexerWeights& w, const ModelConfig& c, const Rope& rope, const float* x,
                          const float* q_latent, int64_t S, int64_t pos0, LayerCache& cache,
                          std::vector<uint8_t>* ambiguous) {
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
      if (select_top(ranked, std::min<int64_t>(c.index_topk, T), n, sel[size_t(s)]) && ambiguous)
        (*ambiguous)[size_t(s)] = 1;
    }
  });
  return sel;
}

}  // namespace moesrv::cpu
