// Gated DeltaNet (Qwen3-Next): projections grouped per key head (q, k, v, z and b, a), a short causal conv +
// SiLU, per-head decay g = -exp(A_log) * softplus(a + dt_bias), the gated delta rule with q/k shared by
// linear_num_value_heads / linear_num_key_heads value heads, and a SiLU(z)-gated RMSNorm on the output.
#include <cmath>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/delta_rule.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/recurrent_steps.h"

namespace moesrv::cpu {

GatedDeltaProjection gated_delta_project(const GatedDeltaWeights& w, const ModelSpec& c, const float* x, int64_t S) {
  const LinearAttnDims& la = c.linear;
  GatedDeltaProjection p;
  p.qkvz.resize(size_t(S * la.k_heads * (2 * la.dk + 2 * (la.v_heads / la.k_heads) * la.dv)));
  p.ba.resize(size_t(S * 2 * la.v_heads));
  w.qkvz->forward(x, S, p.qkvz.data());
  w.ba->forward(x, S, p.ba.data());
  return p;
}

void gated_delta_forward(const GatedDeltaWeights& w, const ModelSpec& c, const float* x, int64_t S, LayerState& st,
                         float* out) {
  const GatedDeltaProjection p = gated_delta_project(w, c, x, S);
  std::vector<float> o(size_t(S * c.linear.v_heads * c.linear.dv));
  gated_delta_mix(w, c, p, 0, S, st, o.data());
  w.out->forward(o.data(), S, out);
}

void gated_delta_mix(const GatedDeltaWeights& w, const ModelSpec& c, const GatedDeltaProjection& p, int64_t r0,
                     int64_t S, LayerState& st, float* o) {
  const LinearAttnDims& la = c.linear;
  const int64_t Hk = la.k_heads, Hv = la.v_heads, dk = la.dk, dv = la.dv, r = Hv / Hk, K = la.conv_kernel;
  const int64_t C = la.conv_channels(), group = 2 * dk + 2 * r * dv, QK = Hk * dk, V = Hv * dv;
  // (a fresh or reset sequence holds no fixed state: zeros of the StateSpec's size on first use)
  if (st[StateSlot::Conv].empty()) st[StateSlot::Conv].assign(size_t(la.conv_state_floats()), 0.0f);
  if (st[StateSlot::Recurrent].empty()) st[StateSlot::Recurrent].assign(size_t(la.state_floats()), 0.0f);
  const float* qkvz = p.qkvz.data() + r0 * Hk * group;
  const float* ba = p.ba.data() + r0 * 2 * Hv;
  // Regroup per token into conv channels q | k | v (all heads), and z, b, a per value head.
  std::vector<float> mixed(size_t(S * C)), z(size_t(S * V)), beta(size_t(S * Hv)), g(size_t(S * Hv));
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < Hk; ++h) {
      const float* src = qkvz + (s * Hk + h) * group;
      float* m = mixed.data() + s * C;
      std::copy(src, src + dk, m + h * dk);
      std::copy(src + dk, src + 2 * dk, m + QK + h * dk);
      std::copy(src + 2 * dk, src + 2 * dk + r * dv, m + 2 * QK + h * r * dv);
      std::copy(src + 2 * dk + r * dv, src + group, z.begin() + s * V + h * r * dv);
      for (int64_t i = 0; i < r; ++i) {
        const int64_t hv = h * r + i;
        const float b = ba[size_t(s * 2 * Hv + h * 2 * r + i)], a = ba[size_t(s * 2 * Hv + h * 2 * r + r + i)];
        beta[size_t(s * Hv + hv)] = 1.0f / (1.0f + std::exp(-b));
        const float f = a + w.dt_bias[size_t(hv)];
        g[size_t(s * Hv + hv)] = -std::exp(w.a_log[size_t(hv)]) * (f > 20.0f ? f : std::log1p(std::exp(f)));
      }
    }
  std::vector<float> conv(size_t(S * C));
  const std::vector<float> conv_before = st[StateSlot::Conv];
  causal_conv1d_silu(mixed.data(), S, C, w.conv.data(), K, st[StateSlot::Conv].data(), conv.data());

  // q, k per value head (each key head serves r value heads), L2-normalised; q scaled by dk^-0.5.
  std::vector<float> q(size_t(S * Hv * dk)), k(size_t(S * Hv * dk)), v(size_t(S * V));
  for (int64_t s = 0; s < S; ++s) {
    const float* m = conv.data() + s * C;
    for (int64_t hv = 0; hv < Hv; ++hv) {
      std::copy(m + (hv / r) * dk, m + (hv / r + 1) * dk, q.begin() + (s * Hv + hv) * dk);
      std::copy(m + QK + (hv / r) * dk, m + QK + (hv / r + 1) * dk, k.begin() + (s * Hv + hv) * dk);
    }
    std::copy(m + 2 * QK, m + 2 * QK + V, v.begin() + s * V);
  }
  l2_normalize_rows(q.data(), S * Hv, dk);
  l2_normalize_rows(k.data(), S * Hv, dk);
  const float qscale = 1.0f / std::sqrt(float(dk));
  for (float& e : q) e *= qscale;

  const DeltaRuleShape shape{Hv, dk, dv, /*per_channel_decay=*/false};
  delta_rule_layer(shape, S, q.data(), k.data(), v.data(), g.data(), beta.data(), conv_before, mixed.data(), C, st, o);

  rms_norm(o, w.norm.weight.data(), S * Hv, dv, c.rms_eps, o);
  for (size_t i = 0; i < size_t(S * V); ++i) o[i] *= z[i] / (1.0f + std::exp(-z[i]));
}

}  // namespace moesrv::cpu
