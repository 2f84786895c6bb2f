// The k-pool DSA indexer of GLM-5.3-Flash: keys are pooled over index_kpool consecutive tokens (a per-channel
// softmax of gate logits + a learned position embedding weights the pool's LayerNorm'd keys); queries score
// completed pools, keep the best index_topk / kpool, and also see the open pool's tokens (the "tail").
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/ops.h"
#include "util/error.h"
#include "util/thread_pool.h"

namespace moesrv::cpu {

namespace {

// Pooled key of kp tokens: per channel, softmax over the tokens of (gate + ape[t]) weights their keys.
void pool_key(const float* k, const float* g, const float* ape, int64_t kp, int64_t d, float* out) {
  for (int64_t c = 0; c < d; ++c) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < kp; ++t) mx = std::max(mx, g[t * d + c] + ape[t * d + c]);
    float sum = 0, acc = 0;
    for (int64_t t = 0; t < kp; ++t) sum += std::exp(g[t * d + c] + ape[t * d + c] - mx);
    for (int64_t t = 0; t < kp; ++t) acc += std::exp(g[t * d + c] + ape[t * d + c] - mx) / sum * k[t * d + c];
    out[c] = acc;
  }
}

}  // namespace

TokenSelection kpool_select(const IndexerWeights& w, const ModelConfig& c, const float* x, const float* q_latent,
                            int64_t S, int64_t pos0, LayerState& st) {
  const int64_t nh = c.index_n_heads, d = c.index_head_dim, kp = c.index_kpool;
  std::vector<float> q(size_t(S * nh * d)), k(size_t(S * d)), g(size_t(S * d)), hw(size_t(S * nh));
  w.wq_b->forward(q_latent, S, q.data());
  w.wk->forward(x, S, k.data());
  w.pool_gate->forward(x, S, g.data());
  w.weights_proj->forward(x, S, hw.data());
  layer_norm(k.data(), w.k_norm.weight.data(), w.k_norm.bias.data(), S, d, 1e-6, k.data());
  const float head_scale = 1.0f / std::sqrt(float(nh));
  for (float& v : hw) v *= head_scale;

  // Extend the pooled keys: the open pool's tokens, then this batch's; every kp tokens close a pool.
  if (int64_t(st.open_k.size()) != (pos0 % kp) * d || int64_t(st.pool_k.size()) != pos0 / kp * d)
    fail("k-pool indexer: state holds {} pools + {} open tokens, batch starts at {}", st.pool_k.size() / size_t(d),
         st.open_k.size() / size_t(d), pos0);
  for (int64_t s = 0; s < S; ++s) {
    st.open_k.insert(st.open_k.end(), k.begin() + s * d, k.begin() + (s + 1) * d);
    st.open_g.insert(st.open_g.end(), g.begin() + s * d, g.begin() + (s + 1) * d);
    if (int64_t(st.open_k.size()) == kp * d) {
      st.pool_k.resize(st.pool_k.size() + size_t(d));
      pool_key(st.open_k.data(), st.open_g.data(), w.pool_ape.data(), kp, d, st.pool_k.data() + st.pool_k.size() - size_t(d));
      st.open_k.clear();
      st.open_g.clear();
    }
  }

  const float scale = 1.0f / std::sqrt(float(d));
  const int64_t budget = c.index_topk / kp;
  TokenSelection sel(static_cast<size_t>(S));
  ThreadPool::global().parallel_for(S, [&](int64_t b, int64_t e) {
    std::vector<float> score;
    std::vector<int32_t> order;
    for (int64_t s = b; s < e; ++s) {
      const int64_t p = pos0 + s, pools = (p + 1) / kp;  // pools whose last token p can see
      score.assign(size_t(pools), 0.0f);
      for (int64_t P = 0; P < pools; ++P) {
        float acc = 0;
        for (int64_t h = 0; h < nh; ++h)
          acc += hw[size_t(s * nh + h)] * std::max(dot(q.data() + (s * nh + h) * d, st.pool_k.data() + P * d, d) * scale, 0.0f);
        score[size_t(P)] = acc;
      }
      const int64_t keep = std::min(budget, pools);
      order.resize(size_t(pools));
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + keep, order.end(), [&](int32_t a, int32_t z) {
        return score[size_t(a)] > score[size_t(z)] || (score[size_t(a)] == score[size_t(z)] && a < z);
      });
      auto& out = sel[size_t(s)];
      for (int64_t i = 0; i < keep; ++i)
        for (int64_t t = 0; t < kp; ++t) out.push_back(int32_t(order[size_t(i)] * kp + t));
      if (c.index_select_tail)
        for (int64_t t = pools * kp; t <= p; ++t) out.push_back(int32_t(t));
      std::sort(out.begin(), out.end());
    }
  });
  return sel;
}

}  // namespace moesrv::cpu
