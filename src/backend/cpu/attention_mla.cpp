// Multi-head latent attention, absorbed form: scores and values are computed against the cached latent,
// so the cache holds kv_lora_rank + qk_rope_dim floats per token instead of full per-head keys and values.
#include <cmath>
#include <limits>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/ops.h"
#include "util/thread_pool.h"

namespace moesrv::cpu {

void mla_forward(const MlaWeights& w, const ModelConfig& c, const Rope& rope, const float* x, int64_t S, int64_t pos0,
                 LayerCache& cache, TokenSelection& selection, float* out, std::vector<uint8_t>* ambiguous) {
  const int64_t H = c.num_heads, dn = c.qk_nope_dim, dr = c.qk_rope_dim, qk = c.qk_head_dim();
  const int64_t r = c.kv_lora_rank, dv = c.v_head_dim;

  std::vector<float> q(size_t(S * H * qk)), q_latent;
  if (w.q_a) {
    q_latent.resize(size_t(S * c.q_lora_rank));
    w.q_a->forward(x, S, q_latent.data());
    rms_norm(q_latent.data(), w.q_a_norm.weight.data(), S, c.q_lora_rank, 1e-6, q_latent.data());
    w.q_b->forward(q_latent.data(), S, q.data());
  } else {
    w.q->forward(x, S, q.data());
  }

  std::vector<float> kv(size_t(S * (r + dr)));
  w.kv_a->forward(x, S, kv.data());
  const int64_t T0 = pos0, T = pos0 + S;
  cache.latent.resize(size_t(T * r));
  cache.k_rope.resize(size_t(T * dr));
  for (int64_t s = 0; s < S; ++s) {
    rms_norm(kv.data() + s * (r + dr), w.kv_a_norm.weight.data(), 1, r, 1e-6, cache.latent.data() + (T0 + s) * r);
    float* kr = cache.k_rope.data() + (T0 + s) * dr;
    std::copy(kv.data() + s * (r + dr) + r, kv.data() + (s + 1) * (r + dr), kr);
    rope.apply(kr, pos0 + s, c.rope.layout);
  }

  if (w.indexer) selection = dsa_select(*w.indexer, c, rope, x, q_latent.data(), S, pos0, cache, ambiguous);

  std::vector<float> attn(size_t(S * H * dv));
  const float scale = float(c.softmax_scale);
  ThreadPool::global().parallel_for(S * H, [&](int64_t b, int64_t e) {
    std::vector<float> q_abs(static_cast<size_t>(r)), scores, o_lat(static_cast<size_t>(r));
    for (int64_t i = b; i < e; ++i) {
      const int64_t s = i / H, h = i % H, pos = pos0 + s;
      float* qh = q.data() + (s * H + h) * qk;
      rope.apply(qh + dn, pos, c.rope.layout);
      // q_abs = W_uk[h]^T q_nope: the query moved into latent space.
      std::fill(q_abs.begin(), q_abs.end(), 0.0f);
      const float* uk = w.w_uk.data() + h * dn * r;
      for (int64_t d = 0; d < dn; ++d) axpy(qh[d], uk + d * r, r, q_abs.data());
      scores.assign(size_t(pos + 1), -std::numeric_limits<float>::infinity());
      auto score = [&](int64_t t) {
        scores[size_t(t)] = (dot(q_abs.data(), cache.latent.data() + t * r, r) +
                             dot(qh + dn, cache.k_rope.data() + t * dr, dr)) * scale;
      };
      if (!selection.empty()) {
        for (int32_t t : selection[size_t(s)])
          if (t <= pos) score(t);
      } else {
        for (int64_t t = 0; t <= pos; ++t) score(t);
      }
      softmax(scores.data(), pos + 1);
      std::fill(o_lat.begin(), o_lat.end(), 0.0f);
      for (int64_t t = 0; t <= pos; ++t)
        if (scores[size_t(t)] != 0.0f) axpy(scores[size_t(t)], cache.latent.data() + t * r, r, o_lat.data());
      const float* uv = w.w_uv.data() + h * dv * r;
      float* oh = attn.data() + (s * H + h) * dv;
      for (int64_t d = 0; d < dv; ++d) oh[d] = dot(uv + d * r, o_lat.data(), r);
    }
  });
  w.o->forward(attn.data(), S, out);
}

}  // namespace moesrv::cpu
