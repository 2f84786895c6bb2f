// The k-pool DSA indexer of GLM-5.3-Flash: keys are pooled over index_kpool consecutive tokens (a per-channel
// softmax of gate logits + a learned position embedding weights the pool's LayerNorm'd keys); queries score
// completed pools, keep the best index_topk / kpool, and also see the open pool's tokens (the "tail").
#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/topk.h"
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

TokenSelection kpool_select(const IndexerWeights& w, const ModelSpec& c, const float* x, const float* q_latent,
                            int64_t S, int64_t pos0, LayerState& st) {
  const int64_t nh = c.index_n_heads, d = c.index_head_dim, kp = c.index_kpool;
  std::vector<float>& pool_k = st[StateSlot::PoolK];
  std::vector<float>& open_k = st[StateSlot::Open];
  std::vector<float>& open_g = st[StateSlot::OpenG];
  std::vector<float> q(size_t(S * nh * d)), k(size_t(S * d)), g(size_t(S * d)), hw(size_t(S * nh));
  w.wq_b->forward(q_latent, S, q.data());
  w.wk->forward(x, S, k.data());
  w.pool_gate->forward(x, S, g.data());
  w.weights_proj->forward(x, S, hw.data());
  layer_norm(k.data(), w.k_norm.weight.data(), w.k_norm.bias.data(), S, d, 1e-6, k.data());
  const float head_scale = 1.0f / std::sqrt(float(nh));
  for (float& v : hw) v *= head_scale;

  // Extend the pooled keys: the open pool's tokens, then this batch's; every kp tokens close a pool.
  if (int64_t(open_k.size()) != (pos0 % kp) * d || int64_t(pool_k.size()) != pos0 / kp * d)
    fail("k-pool indexer: state holds {} pools + {} open tokens, batch starts at {}", pool_k.size() / size_t(d),
         open_k.size() / size_t(d), pos0);
  for (int64_t s = 0; s < S; ++s) {
    open_k.insert(open_k.end(), k.begin() + s * d, k.begin() + (s + 1) * d);
    open_g.insert(open_g.end(), g.begin() + s * d, g.begin() + (s + 1) * d);
    if (int64_t(open_k.size()) == kp * d) {
      pool_k.resize(pool_k.size() + size_t(d));
      pool_key(open_k.data(), open_g.data(), w.pool_ape.data(), kp, d, pool_k.data() + pool_k.size() - size_t(d));
      open_k.clear();
      open_g.clear();
    }
    if (st.record_steps && s + 1 < S) {
      StateBuffers& f = st.steps.emplace_back();
      f[StateSlot::Open] = open_k, f[StateSlot::OpenG] = open_g;
    }
  }

  const float scale = 1.0f / std::sqrt(float(d));
  const int64_t budget = c.index_topk / kp;
  const int64_t all_pools = (pos0 + S) / kp;  // completed pools in the cache after this batch
  TokenSelection sel(static_cast<size_t>(S));
  ThreadPool::global().parallel_for(S, [&](int64_t b, int64_t e) {
    std::vector<std::pair<float, int64_t>> ranked;
    std::vector<int32_t> chosen;
    for (int64_t s = b; s < e; ++s) {
      const int64_t p = pos0 + s, pools = (p + 1) / kp;  // pools whose last token p can see
      ranked.resize(size_t(all_pools));
      for (int64_t P = 0; P < all_pools; ++P) {
        float acc = -std::numeric_limits<float>::infinity();
        if (P < pools) {
          acc = 0;
          for (int64_t h = 0; h < nh; ++h)
            acc += hw[size_t(s * nh + h)] *
                   std::max(dot(q.data() + (s * nh + h) * d, pool_k.data() + P * d, d) * scale, 0.0f);
        }
        ranked[size_t(P)] = {acc, P};
      }
      topk_like_torch(ranked, budget, pools, chosen);
      auto& out = sel[size_t(s)];
      for (int32_t P : chosen)
        for (int64_t t = 0; t < kp; ++t) out.push_back(int32_t(P * kp + t));
      if (c.index_select_tail)
        for (int64_t t = pools * kp; t <= p; ++t) out.push_back(int32_t(t));
      std::sort(out.begin(), out.end());
    }
  });
  return sel;
}

}  // namespace moesrv::cpu
