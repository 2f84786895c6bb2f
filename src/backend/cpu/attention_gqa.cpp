// Grouped-query attention with optional q/k RMSNorm and partial rotary embedding (GLM-4.5 family).
#include <cmath>
#include <limits>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/ops.h"
#include "util/thread_pool.h"

namespace moesrv::cpu {

GqaProjection gqa_project(const GqaWeights& w, const ModelSpec& c, const float* x, int64_t S) {
  const int64_t H = c.num_heads, KV = c.num_kv_heads, hd = c.head_dim;
  GqaProjection p;
  p.q.resize(size_t(S * H * hd));
  p.k.resize(size_t(S * KV * hd));
  p.v.resize(size_t(S * KV * hd));
  if (c.attn_output_gate) {  // q_proj yields [H, (query, gate)] per token
    std::vector<float> qg(size_t(S * H * 2 * hd));
    w.q->forward(x, S, qg.data());
    p.gate.resize(p.q.size());
    for (int64_t i = 0; i < S * H; ++i) {
      std::copy(qg.begin() + i * 2 * hd, qg.begin() + i * 2 * hd + hd, p.q.begin() + i * hd);
      std::copy(qg.begin() + i * 2 * hd + hd, qg.begin() + (i + 1) * 2 * hd, p.gate.begin() + i * hd);
    }
  } else {
    w.q->forward(x, S, p.q.data());
  }
  w.k->forward(x, S, p.k.data());
  w.v->forward(x, S, p.v.data());
  if (c.qk_norm) {
    rms_norm(p.q.data(), w.q_norm.weight.data(), S * H, hd, c.rms_eps, p.q.data());
    rms_norm(p.k.data(), w.k_norm.weight.data(), S * KV, hd, c.rms_eps, p.k.data());
  }
  return p;
}

void gqa_finish(const GqaWeights& w, const GqaProjection& p, int64_t S, float* attn, float* out) {
  for (size_t i = 0; i < p.gate.size(); ++i) attn[i] *= 1.0f / (1.0f + std::exp(-p.gate[i]));
  w.o->forward(attn, S, out);
}

void gqa_forward(const GqaWeights& w, const ModelSpec& c, const Rope& rope, const float* x, int64_t S, int64_t pos0,
                 LayerState& cache, float* out) {
  GqaProjection p = gqa_project(w, c, x, S);
  std::vector<float> attn(size_t(S * c.num_heads * c.head_dim));
  gqa_attend(c, rope, p, 0, S, pos0, cache, attn.data());
  gqa_finish(w, p, S, attn.data(), out);
}

void gqa_attend(const ModelSpec& c, const Rope& rope, GqaProjection& p, int64_t r0, int64_t S, int64_t pos0,
                LayerState& cache, float* attn) {
  const int64_t H = c.num_heads, KV = c.num_kv_heads, hd = c.head_dim, T = pos0 + S;
  float* q = p.q.data() + r0 * H * hd;
  float* k = p.k.data() + r0 * KV * hd;
  const float* v = p.v.data() + r0 * KV * hd;
  std::vector<float>& k_cache = cache[StateSlot::Kv];
  std::vector<float>& v_cache = cache[StateSlot::V];
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t h = 0; h < H; ++h) rope.apply(q + (s * H + h) * hd, pos0 + s, c.rope.layout);
    for (int64_t h = 0; h < KV; ++h) rope.apply(k + (s * KV + h) * hd, pos0 + s, c.rope.layout);
  }
  k_cache.resize(size_t(T * KV * hd));
  v_cache.resize(size_t(T * KV * hd));
  std::copy(k, k + S * KV * hd, k_cache.begin() + pos0 * KV * hd);
  std::copy(v, v + S * KV * hd, v_cache.begin() + pos0 * KV * hd);

  const float scale = float(c.softmax_scale);
  const int64_t group = H / KV;
  ThreadPool::global().parallel_for(S * H, [&](int64_t b, int64_t e) {
    std::vector<float> scores;
    for (int64_t i = b; i < e; ++i) {
      const int64_t s = i / H, h = i % H, kvh = h / group, pos = pos0 + s;
      const float* qh = q + (s * H + h) * hd;
      scores.resize(size_t(pos + 1));
      for (int64_t t = 0; t <= pos; ++t) scores[size_t(t)] = dot(qh, k_cache.data() + (t * KV + kvh) * hd, hd) * scale;
      softmax(scores.data(), pos + 1);
      float* oh = attn + (s * H + h) * hd;
      std::fill(oh, oh + hd, 0.0f);
      for (int64_t t = 0; t <= pos; ++t) axpy(scores[size_t(t)], v_cache.data() + (t * KV + kvh) * hd, hd, oh);
    }
  });
}

}  // namespace moesrv::cpu
