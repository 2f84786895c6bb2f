// KDA linear attention (GLM-5.3-Flash): short causal convs + SiLU on q/k/v, per-head L2 norm, per-channel
// decay, the gated delta rule in fp32 (chunked for prefill, the recurrence for single tokens), and a
// sigmoid-gated RMSNorm on the output.
#include <cmath>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/delta_rule.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/recurrent_steps.h"

namespace moesrv::cpu {

namespace {
float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }
float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }
}  // namespace

KdaProjection kda_project(const KdaWeights& w, const ModelSpec& c, const float* x, int64_t S) {
  const LinearAttnDims& la = c.linear;
  const int64_t H = la.v_heads, d = la.dk, Hd = H * d, C = 3 * Hd;
  KdaProjection p;
  p.qkv.resize(size_t(S * C));
  std::vector<float> proj(size_t(S * Hd));
  for (int part = 0; part < 3; ++part) {
    (part == 0 ? w.q : part == 1 ? w.k : w.v)->forward(x, S, proj.data());
    for (int64_t s = 0; s < S; ++s)
      std::copy(proj.begin() + s * Hd, proj.begin() + (s + 1) * Hd, p.qkv.begin() + s * C + part * Hd);
  }
  // Per-channel log decay g (<= 0) and per-head beta.
  std::vector<float> fa(size_t(S * d));
  p.g.resize(size_t(S * Hd));
  p.beta.resize(size_t(S * H));
  w.f_a->forward(x, S, fa.data());
  w.f_b->forward(fa.data(), S, p.g.data());
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < H; ++h) {
      const float rate = std::exp(w.a_log[size_t(h)]);
      for (int64_t j = 0; j < d; ++j) {
        float& e = p.g[size_t(s * Hd + h * d + j)];
        const float f = e + w.dt_bias[size_t(h * d + j)];
        e = la.lower_bound_set ? float(la.lower_bound) * sigmoid(rate * f) : -rate * softplus(f);
      }
    }
  w.b->forward(x, S, p.beta.data());
  for (float& e : p.beta) e = sigmoid(e);
  // The output gate's logits, g_b(g_a x).
  std::vector<float> ga(size_t(S * d));
  p.gate.resize(size_t(S * Hd));
  w.g_a->forward(x, S, ga.data());
  w.g_b->forward(ga.data(), S, p.gate.data());
  return p;
}

void kda_forward(const KdaWeights& w, const ModelSpec& c, const float* x, int64_t S, LayerState& st, float* out) {
  const KdaProjection p = kda_project(w, c, x, S);
  std::vector<float> o(size_t(S * c.linear.v_heads * c.linear.dk));
  kda_mix(w, c, p, 0, S, st, o.data());
  w.o->forward(o.data(), S, out);
}

void kda_mix(const KdaWeights& w, const ModelSpec& c, const KdaProjection& p, int64_t r0, int64_t S, LayerState& st,
             float* o) {
  const LinearAttnDims& la = c.linear;
  const int64_t H = la.v_heads, d = la.dk, Hd = H * d, C = 3 * Hd, K = la.conv_kernel;
  // (a fresh or reset sequence holds no fixed state: zeros of the StateSpec's size on first use)
  if (st[StateSlot::Conv].empty()) st[StateSlot::Conv].assign(size_t(la.conv_state_floats()), 0.0f);
  if (st[StateSlot::Recurrent].empty()) st[StateSlot::Recurrent].assign(size_t(la.state_floats()), 0.0f);
  const float* qkv = p.qkv.data() + r0 * C;
  const float* g = p.g.data() + r0 * Hd;
  const float* beta = p.beta.data() + r0 * H;
  const float* gate = p.gate.data() + r0 * Hd;

  std::vector<float> mixed(size_t(S * C));
  const std::vector<float> conv_before = st[StateSlot::Conv];
  causal_conv1d_silu(qkv, S, C, w.conv.data(), K, st[StateSlot::Conv].data(), mixed.data());
  std::vector<float> q(size_t(S * Hd)), k(size_t(S * Hd)), v(size_t(S * Hd));
  for (int64_t s = 0; s < S; ++s) {
    const float* m = mixed.data() + s * C;
    std::copy(m, m + Hd, q.begin() + s * Hd);
    std::copy(m + Hd, m + 2 * Hd, k.begin() + s * Hd);
    std::copy(m + 2 * Hd, m + 3 * Hd, v.begin() + s * Hd);
  }
  l2_normalize_rows(q.data(), S * H, d);
  l2_normalize_rows(k.data(), S * H, d);
  const float qscale = 1.0f / std::sqrt(float(d));
  for (float& e : q) e *= qscale;

  const DeltaRuleShape shape{H, d, d, /*per_channel_decay=*/true};
  delta_rule_layer(shape, S, q.data(), k.data(), v.data(), g, beta, conv_before, qkv, C, st, o);

  // Output: RMSNorm per head over d with o_norm, times sigmoid(g_b(g_a x)).
  rms_norm(o, w.o_norm.weight.data(), S * H, d, c.rms_eps, o);
  for (size_t i = 0; i < size_t(S * Hd); ++i) o[i] *= sigmoid(gate[i]);
}

}  // namespace moesrv::cpu
