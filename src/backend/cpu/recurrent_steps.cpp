#include "backend/cpu/recurrent_steps.h"

#include <algorithm>

namespace moesrv::cpu {

void delta_rule_layer(const DeltaRuleShape& sh, int64_t S, const float* q, const float* k, const float* v,
                      const float* g, const float* beta, const std::vector<float>& conv_before, const float* conv_in,
                      int64_t C, LayerState& st, float* out) {
  if (!st.record_steps) {
    if (S == 1) delta_rule_recurrent(sh, S, q, k, v, g, beta, st[StateSlot::Recurrent].data(), out);
    else delta_rule_chunked(sh, S, q, k, v, g, beta, st[StateSlot::Recurrent].data(), out);
    return;
  }
  const int64_t H = sh.heads, qk = H * sh.dk, vs = H * sh.dv, gs = sh.per_channel_decay ? qk : H;
  const int64_t P = int64_t(conv_before.size()) / C;  // conv taps carried: kernel - 1
  for (int64_t s = 0; s < S; ++s) {
    delta_rule_recurrent(sh, 1, q + s * qk, k + s * qk, v + s * vs, g + s * gs, beta + s * H,
                         st[StateSlot::Recurrent].data(), out + s * vs);
    if (s + 1 == S) break;
    StateBuffers& f = st.steps.emplace_back();
    f[StateSlot::Recurrent] = st[StateSlot::Recurrent];
    f[StateSlot::Conv].resize(size_t(P * C));
    for (int64_t i = 0; i < P; ++i) {  // row i of the state after token s: input s - P + 1 + i (< 0: the old state)
      const int64_t r = s - P + 1 + i;
      const float* src = r < 0 ? conv_before.data() + (P + r) * C : conv_in + r * C;
      std::copy(src, src + C, f[StateSlot::Conv].begin() + i * C);
    }
  }
}

}  // namespace moesrv::cpu
