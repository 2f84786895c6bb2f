// The delta rule of a recurrent layer (KDA, Gated DeltaNet) over a batch, with the layer's state: the chunked form
// for a prefill, the recurrence for one token, and token by token with rollback points for a speculative verify.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/delta_rule.h"

namespace moesrv::cpu {

// q, k, v, g, beta as delta_rule.h lays them out for S tokens; st.recurrent in/out. When st.record_steps, the tokens
// run one at a time (bit for bit as S single-token forwards) and after each but the last the conv state (from
// conv_before [K-1, C], the conv state before the batch, and conv_in [S, C], the batch's conv inputs) and the
// recurrent state are appended to st.steps. out: [S, heads, dv].
void delta_rule_layer(const DeltaRuleShape& shape, int64_t S, const float* q, const float* k, const float* v,
                      const float* g, const float* beta, const std::vector<float>& conv_before, const float* conv_in,
                      int64_t C, LayerState& st, float* out);

}  // namespace moesrv::cpu
