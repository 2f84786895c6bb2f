// GQA family: GLM-4.5 / 4.6 / 4.7 (glm4_moe): partial rotary, optional q/k RMSNorm and q/k/v bias.
#include <cmath>

#include "model/arch/arch.h"
#include "model/hf_config.h"
#include "util/error.h"

namespace moesrv::arch {

ModelSpec describe_glm4_moe(const nlohmann::json& j) {
  ModelSpec s;
  hf::read_common(j, s);
  hf::read_moe(j, s);
  s.attention = AttentionKind::GQA;
  s.head_dim = hf::get_or<int64_t>(j, "head_dim", s.hidden_size / s.num_heads);
  s.qk_norm = hf::get_or<bool>(j, "use_qk_norm", false);
  hf::read_rope(j, s, s.head_dim);
  s.rope.layout = RopeLayout::SplitHalf;
  s.softmax_scale = 1.0 / std::sqrt(double(s.head_dim));
  if (s.num_kv_heads <= 0 || s.num_heads % s.num_kv_heads != 0)
    fail("config.json: num_attention_heads not divisible by num_key_value_heads");
  hf::finish(s, Mixer::Gqa);
  return s;
}

}  // namespace moesrv::arch
