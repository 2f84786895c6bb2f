// Multi-head latent attention, absorbed form: scores and values are computed against the cached latent,
// so the cache holds kv_lora_rank + qk_rope_dim floats per token instead of full per-head keys and values.
#include <cmath>
#include <algorithm>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/ops.h"
#include "util/thread_pool.h"

namespace moesrv::cpu {

MlaProjection mla_project(const MlaWeights& w, const ModelSpec& c, const float* x, int64_t S) {
  MlaProjection p;
  p.q.resize(size_t(S * c.num_heads * c.qk_head_dim()));
  if (w.q_a) {
    p.q_latent.resize(size_t(S * c.q_lora_rank));
    w.q_a->forward(x, S, p.q_latent.data());
    rms_norm(p.q_latent.data(), w.q_a_norm.weight.data(), S, c.q_lora_rank, 1e-6, p.q_latent.data());
    w.q_b->forward(p.q_latent.data(), S, p.q.data());
  } else {
    w.q->forward(x, S, p.q.data());
  }
  p.kv.resize(size_t(S * (c.kv_lora_rank + c.qk_rope_dim)));
  w.kv_a->forward(x, S, p.kv.data());
  return p;
}

void mla_forward(const MlaWeights& w, const ModelSpec& c, const Rope& rope, const float* x, int64_t S, int64_t pos0,
                 LayerState& cache, TokenSelection& selection, float* out) {
  MlaProjection p = mla_project(w, c, x, S);
  std::vector<float> attn(size_t(S * c.num_heads * c.v_head_dim));
  mla_attend(w, c, rope, x, p, 0, S, pos0, cache, selection, attn.data());
  w.o->forward(attn.data(), S, out);
}

void mla_attend(const MlaWeights& w, const ModelSpec& c, const Rope& rope, const float* x_all, MlaProjection& p,
                int64_t r0, int64_t S, int64_t pos0, LayerState& cache, TokenSelection& selection, float* attn) {
  const int64_t H = c.num_heads, dn = c.qk_nope_dim, dr = c.qk_rope_dim, qk = c.qk_head_dim();
  const int64_t r = c.kv_lora_rank, dv = c.v_head_dim;
  const float* x = x_all + r0 * c.hidden_size;
  float* q = p.q.data() + r0 * H * qk;
  const float* kv = p.kv.data() + r0 * (r + dr);
  const float* q_latent = p.q_latent.empty() ? nullptr : p.q_latent.data() + r0 * c.q_lora_rank;
  const int64_t T0 = pos0, T = pos0 + S;
  std::vector<float>& latent = cache[StateSlot::Kv];
  std::vector<float>& k_rope = cache[StateSlot::KRope];
  latent.resize(size_t(T * r));
  k_rope.resize(size_t(T * dr));
  for (int64_t s = 0; s < S; ++s) {
    rms_norm(kv + s * (r + dr), w.kv_a_norm.weight.data(), 1, r, 1e-6, latent.data() + (T0 + s) * r);
    float* kr = k_rope.data() + (T0 + s) * dr;
    std::copy(kv + s * (r + dr) + r, kv + (s + 1) * (r + dr), kr);
    rope.apply(kr, pos0 + s, c.rope.layout);
  }

  if (w.indexer)
    selection = c.index_kpool > 1 ? kpool_select(*w.indexer, c, x, q_latent, S, pos0, cache)
                                  : dsa_select(*w.indexer, c, rope, x, q_latent, S, pos0, cache);

  // Queries into latent space: q_abs[s, h] = W_uk[h]^T q_nope[s, h]; rope part kept contiguous beside it.
  std::vector<float> q_abs(size_t(S * H * r), 0.0f), q_rope(size_t(S * H * dr));
  ThreadPool::global().parallel_for(S * H, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t s = i / H, h = i % H;
      float* qh = q + i * qk;
      rope.apply(qh + dn, pos0 + s, c.rope.layout);
      std::copy(qh + dn, qh + qk, q_rope.data() + i * dr);
      const float* uk = w.w_uk.data() + h * dn * r;
      for (int64_t d = 0; d < dn; ++d) axpy(qh[d], uk + d * r, r, q_abs.data() + i * r);
    }
  });

  // Per token, all heads at once: every cached latent row is read once and scored against H queries.
  std::vector<float> o_lat(size_t(S * H * r), 0.0f), scores, rope_scores, keys_lat, keys_rope;
  const float scale = float(c.softmax_scale);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t pos = pos0 + s;
    const float *kl = latent.data(), *kr = k_rope.data();
    int64_t n = pos + 1;
    if (!selection.empty()) {  // DSA: gather the selected keys
      const auto& sel = selection[size_t(s)];
      keys_lat.resize(sel.size() * size_t(r));
      keys_rope.resize(sel.size() * size_t(dr));
      n = 0;
      for (int32_t t : sel) {
        if (t > pos) continue;
        std::copy(kl + t * r, kl + (t + 1) * r, keys_lat.begin() + n * r);
        std::copy(kr + t * dr, kr + (t + 1) * dr, keys_rope.begin() + n * dr);
        ++n;
      }
      kl = keys_lat.data();
      kr = keys_rope.data();
    }
    scores.resize(size_t(H * n));
    rope_scores.resize(size_t(H * n));
    gemm_f32(q_abs.data() + s * H * r, H, kl, n, r, scores.data());
    if (dr > 0) gemm_f32(q_rope.data() + s * H * dr, H, kr, n, dr, rope_scores.data());
    else std::fill(rope_scores.begin(), rope_scores.end(), 0.0f);
    for (int64_t h = 0; h < H; ++h) {
      float* row = scores.data() + h * n;
      for (int64_t t = 0; t < n; ++t) row[t] = (row[t] + rope_scores[size_t(h * n + t)]) * scale;
      softmax(row, n);
    }
    // o_lat[s, h] = sum_t p[h, t] * latent[t]: threads own column slices, so each key row is read once.
    float* o = o_lat.data() + s * H * r;
    ThreadPool::global().parallel_for((r + 63) / 64, [&](int64_t b, int64_t e) {
      const int64_t j0 = b * 64, j1 = std::min(r, e * 64);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t h = 0; h < H; ++h) axpy(scores[size_t(h * n + t)], kl + t * r + j0, j1 - j0, o + h * r + j0);
    });
  }

  ThreadPool::global().parallel_for(S * H, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* uv = w.w_uv.data() + (i % H) * dv * r;
      for (int64_t d = 0; d < dv; ++d) attn[i * dv + d] = dot(uv + d * r, o_lat.data() + i * r, r);
    }
  });
}

}  // namespace moesrv::cpu
