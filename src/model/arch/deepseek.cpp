// MLA family: DeepSeek-V3 (+ V3.2 with the DSA indexer), GLM-4.7-Flash (glm4_moe_lite), GLM-5 (glm_moe_dsa).
#include <cmath>

#include "model/arch/arch.h"
#include "model/hf_config.h"

namespace moesrv::arch {

ModelSpec describe_deepseek(const nlohmann::json& j) {
  ModelSpec s;
  hf::read_common(j, s);
  hf::read_moe(j, s);
  hf::read_mla(j, s);
  hf::read_rope(j, s, s.qk_rope_dim);
  // These checkpoints interleave rope pairs unless the config says otherwise.
  s.rope.layout = hf::get_or<bool>(j, "rope_interleave", true) ? RopeLayout::Interleaved : RopeLayout::SplitHalf;
  if (s.rope.yarn && s.rope.mscale_all_dim != 0) {
    double m = 0.1 * s.rope.mscale_all_dim * std::log(s.rope.factor) + 1.0;
    if (s.rope.factor > 1) s.softmax_scale *= m * m;
  }
  const std::string type = hf::require<std::string>(j, "model_type");
  if (j.contains("index_topk") && (type == "glm_moe_dsa" || type == "deepseek_v32")) {
    hf::read_indexer(j, s);
    // GLM-5's indexer ropes interleaved pairs (checked against transformers' logits); DeepSeek-V3.2's split halves.
    s.index_rope_layout = type == "glm_moe_dsa" ? RopeLayout::Interleaved : RopeLayout::SplitHalf;
  }
  hf::finish(s, Mixer::Mla);
  return s;
}

}  // namespace moesrv::arch
