// Grouped-query attention with optional q/k RMSNorm and partial rotary embedding (GLM-4.5 family).
#include <cmath>
#include <limits>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/ops.h"
#include "util/thread_pool.h"

namespace moesrv::cpu {

void gqa_forward(const GqaWeights& w, const ModelSpec& c, const Rope& rope, const float* x, int64_t S, int64_t pos0,
                 LayerState& cache, float* out) {
  const int64_t H = c.num_heads, KV = c.num_kv_heads, hd = c.head_dim, T = pos0 + S;
  std::vector<float> q(size_t(S * H * hd)), k(size_t(S * KV * hd)), v(size_t(S * KV * hd)), gate;
  if (c.attn_output_gate) {  // q_proj yields [H, (query, gate)] per token
    std::vector<float> qg(size_t(S * H * 2 * hd));
    w.q->forward(x, S, qg.data());
    gate.resize(q.size());
    for (int64_t i = 0; i < S * H; ++i) {
      std::copy(qg.begin() + i * 2 * hd, qg.begin() + i * 2 * hd + hd, q.begin() + i * hd);
      std::copy(qg.begin() + i * 2 * hd + hd, qg.begin() + (i + 1) * 2 * hd, gate.begin() + i * hd);
    }
  } else {
    w.q->forward(x, S, q.data());
  }
  w.k->forward(x, S, k.data());
  w.v->forward(x, S, v.data());
  if (c.qk_norm) {
    rms_norm(q.data(), w.q_norm.weight.data(), S * H, hd, c.rms_eps, q.data());
    rms_norm(k.data(), w.k_norm.weight.data(), S * KV, hd, c.rms_eps, k.data());
  }
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t h = 0; h < H; ++h) rope.apply(q.data() + (s * H + h) * hd, pos0 + s, c.rope.layout);
    for (int64_t h = 0; h < KV; ++h) rope.apply(k.data() + (s * KV + h) * hd, pos0 + s, c.rope.layout);
  }
  cache.k.resize(size_t(T * KV * hd));
  cache.v.resize(size_t(T * KV * hd));
  std::copy(k.begin(), k.end(), cache.k.begin() + pos0 * KV * hd);
  std::copy(v.begin(), v.end(), cache.v.begin() + pos0 * KV * hd);

  std::vector<float> attn(size_t(S * H * hd));
  const float scale = float(c.softmax_scale);
  const int64_t group = H / KV;
  ThreadPool::global().parallel_for(S * H, [&](int64_t b, int64_t e) {
    std::vector<float> scores;
    for (int64_t i = b; i < e; ++i) {
      const int64_t s = i / H, h = i % H, kvh = h / group, pos = pos0 + s;
      const float* qh = q.data() + (s * H + h) * hd;
      scores.resize(size_t(pos + 1));
      for (int64_t t = 0; t <= pos; ++t) scores[size_t(t)] = dot(qh, cache.k.data() + (t * KV + kvh) * hd, hd) * scale;
      softmax(scores.data(), pos + 1);
      float* oh = attn.data() + (s * H + h) * hd;
      std::fill(oh, oh + hd, 0.0f);
      for (int64_t t = 0; t <= pos; ++t) axpy(scores[size_t(t)], cache.v.data() + (t * KV + kvh) * hd, hd, oh);
    }
  });
  for (size_t i = 0; i < gate.size(); ++i) attn[i] *= 1.0f / (1.0f + std::exp(-gate[i]));
  w.o->forward(attn.data(), S, out);
}

}  // namespace moesrv::cpu
