// model_type -> describe(): one explicit table, a line per architecture.
#include <algorithm>
#include <string>

#include "model/arch/arch.h"
#include "model/hf_config.h"
#include "util/error.h"

namespace moesrv {

namespace {

struct Arch {
  const char* model_type;
  ModelSpec (*describe)(const nlohmann::json&);
};

constexpr Arch kArchitectures[] = {
    {"deepseek_v3", arch::describe_deepseek},   {"deepseek_v32", arch::describe_deepseek},
    {"glm4_moe_lite", arch::describe_deepseek}, {"glm_moe_dsa", arch::describe_deepseek},
    {"glm4_moe", arch::describe_glm4_moe},      {"glm5_next", arch::describe_glm5_next},
    {"qwen3_next", arch::describe_qwen3_next},
};

}  // namespace

bool ModelSpec::has_recurrent_layers() const {
  return std::any_of(layers.begin(), layers.end(), [](const LayerSpec& l) { return l.recurrent(); });
}

ModelSpec ModelSpec::mtp_block() const {
  ModelSpec m = *this;
  m.num_layers = 1;
  m.layers = {mtp_layer};
  m.layer_is_moe = {mtp_layer.ffn == FfnKind::Moe};
  if (dsa) m.layer_has_indexer = {mtp_layer.indexer == IndexerKind::Own};
  m.residual = ResidualSpec{};
  m.mtp_layers = 0;
  return m;
}

const char* mixer_name(Mixer m) {
  switch (m) {
    case Mixer::Mla: return "MLA";
    case Mixer::Gqa: return "GQA";
    case Mixer::Kda: return "KDA";
    case Mixer::GatedDelta: return "GatedDeltaNet";
  }
  return "?";
}

double mixer_flops_per_token(const ModelSpec& s, Mixer m, double attended) {
  const double H = double(s.num_heads);
  switch (m) {
    case Mixer::Mla: return attended * H * (4.0 * double(s.kv_lora_rank) + 2.0 * double(s.qk_rope_dim));
    case Mixer::Gqa: return attended * H * 4.0 * double(s.head_dim);
    case Mixer::Kda:
    case Mixer::GatedDelta: return 6.0 * double(s.linear.state_floats());  // decay, k^T S, update, q S
  }
  return 0.0;
}

ModelSpec ModelSpec::from_json(const nlohmann::json& config) {
  if (!config.is_object()) fail("config.json: not a JSON object");
  const std::string type = hf::require<std::string>(config, "model_type");
  std::string names;
  for (const Arch& a : kArchitectures) {
    if (type != a.model_type) {
      names += names.empty() ? a.model_type : std::string(", ") + a.model_type;
      continue;
    }
    nlohmann::json text = hf::text_fields(config);
    text["model_type"] = type;  // nested text configs carry their own sub-type name
    ModelSpec s = a.describe(text);
    s.model_type = type;
    hf::check_ranges(s);
    return s;
  }
  fail("config.json: model_type {} is not supported ({})", type, names);
}

}  // namespace moesrv
