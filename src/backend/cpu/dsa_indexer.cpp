// DeepSeek sparse attention's lightning indexer: scores every cached key with a few cheap ReLU heads and
// keeps the index_topk best positions per query token.
#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/topk.h"
#include "util/thread_pool.h"

namespace moesrv::cpu {

TokenSelection dsa_select(const IndexerWeights& w, const ModelSpec& c, const Rope& rope, const float* x,
                          const float* q_latent, int64_t S, int64_t pos0, LayerState& cache) {
  const int64_t nh = c.index_n_heads, d = c.index_head_dim, T = pos0 + S;
  std::vector<float>& index_k = cache[StateSlot::IndexK];
  std::vector<float> q(size_t(S * nh * d)), k(size_t(S * d)), hw(size_t(S * nh));
  w.wq_b->forward(q_latent, S, q.data());
  w.wk->forward(x, S, k.data());
  w.weights_proj->forward(x, S, hw.data());
  layer_norm(k.data(), w.k_norm.weight.data(), w.k_norm.bias.data(), S, d, 1e-6, k.data());
  index_k.resize(size_t(T * d));
  for (int64_t s = 0; s < S; ++s) {
    rope.apply(k.data() + s * d, pos0 + s, c.index_rope_layout);
    std::copy(k.data() + s * d, k.data() + (s + 1) * d, index_k.data() + (pos0 + s) * d);
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
            float qk = dot(q.data() + (s * nh + h) * d, index_k.data() + t * d, d) * softmax_scale;
            acc += std::max(qk, 0.0f) * (hw[size_t(s * nh + h)] * head_scale);
          }
        }
        ranked[size_t(t)] = {acc, t};
      }
      topk_like_torch(ranked, c.index_topk, n, sel[size_t(s)]);
    }
  });
  return sel;
}

}  // namespace moesrv::cpu
