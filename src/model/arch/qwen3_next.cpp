// Qwen3-Next: Gated DeltaNet linear attention + gated GQA (partial rotary, q/k norm), softmax-routed MoE with a
// sigmoid-gated shared expert; every RMSNorm but the delta net's output norm scales by (1 + w).
#include <algorithm>
#include <cmath>

#include "model/arch/arch.h"
#include "model/hf_config.h"
#include "util/error.h"

namespace moesrv::arch {

ModelSpec describe_qwen3_next(const nlohmann::json& j) {
  ModelSpec s;
  hf::read_common(j, s);
  s.attention = AttentionKind::GQA;
  s.head_dim = hf::get_or<int64_t>(j, "head_dim", s.hidden_size / s.num_heads);
  s.qk_norm = true;
  s.attn_output_gate = true;
  s.norm_weight_offset = 1.0;
  hf::read_rope(j, s, s.head_dim);
  s.rope.layout = RopeLayout::SplitHalf;
  s.softmax_scale = 1.0 / std::sqrt(double(s.head_dim));
  if (s.num_kv_heads <= 0 || s.num_heads % s.num_kv_heads != 0)
    fail("config.json: num_attention_heads not divisible by num_key_value_heads");

  s.router = RouterKind::Softmax;
  s.n_routed_experts = hf::require<int64_t>(j, "num_experts");
  s.experts_per_token = hf::require<int64_t>(j, "num_experts_per_tok");
  s.moe_intermediate_size = hf::require<int64_t>(j, "moe_intermediate_size");
  s.shared_intermediate_size = hf::get_or<int64_t>(j, "shared_expert_intermediate_size", 0);
  s.n_shared_experts = s.shared_intermediate_size > 0 ? 1 : 0;
  s.shared_expert_gate = s.n_shared_experts > 0;
  s.norm_topk_prob = hf::get_or<bool>(j, "norm_topk_prob", true);
  if (s.experts_per_token > s.n_routed_experts) fail("config.json: num_experts_per_tok exceeds num_experts");
  const int64_t step = hf::get_or<int64_t>(j, "decoder_sparse_step", 1);
  auto dense_only = hf::get_or<std::vector<int64_t>>(j, "mlp_only_layers", {});
  s.layer_is_moe.assign(size_t(s.num_layers), false);
  for (int64_t i = 0; i < s.num_layers; ++i)
    s.layer_is_moe[size_t(i)] = s.n_routed_experts > 0 && step > 0 && (i + 1) % step == 0 &&
                                std::find(dense_only.begin(), dense_only.end(), i) == dense_only.end();

  LinearAttnDims& la = s.linear;
  la.k_heads = hf::require<int64_t>(j, "linear_num_key_heads");
  la.v_heads = hf::require<int64_t>(j, "linear_num_value_heads");
  la.dk = hf::require<int64_t>(j, "linear_key_head_dim");
  la.dv = hf::require<int64_t>(j, "linear_value_head_dim");
  la.conv_kernel = hf::get_or<int64_t>(j, "linear_conv_kernel_dim", 4);
  if (la.k_heads <= 0 || la.v_heads % la.k_heads != 0) fail("config.json: linear_num_value_heads not divisible by linear_num_key_heads");

  auto types = hf::layer_list(j, "layer_types", s.num_layers);
  if (types.empty()) fail("config.json: qwen3_next needs layer_types");
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string& t = types[size_t(i)];
    if (t == "linear_attention") s.layers.push_back({Mixer::GatedDelta});
    else if (t == "full_attention") s.layers.push_back({Mixer::Gqa});
    else fail("config.json: layer_types[{}] is {} (linear_attention, full_attention)", i, t);
  }
  hf::finish(s, Mixer::Gqa);
  return s;
}

}  // namespace moesrv::arch
