#include "model/config.h"

#include <cmath>

#include "util/error.h"

namespace moesrv {

using json = nlohmann::json;

namespace {

template <typename T>
T get_or(const json& j, const char* key, T dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    fail("config.json: field {} has the wrong type ({})", key, it->dump());
  }
}

template <typename T>
T require(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) fail("config.json: required field {} is missing", key);
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    fail("config.json: field {} has the wrong type ({})", key, it->dump());
  }
}

double yarn_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

void read_rope(const json& j, ModelConfig& c, int64_t rope_head_dim) {
  json rp = j.contains("rope_parameters") ? j["rope_parameters"] : j.value("rope_scaling", json::object());
  if (rp.is_null()) rp = json::object();
  RopeConfig& r = c.rope;
  r.theta = get_or<double>(rp, "rope_theta", get_or<double>(j, "rope_theta", 10000.0));
  double partial = get_or<double>(rp, "partial_rotary_factor", get_or<double>(j, "partial_rotary_factor", 1.0));
  r.dim = int64_t(double(rope_head_dim) * partial);
  std::string type = get_or<std::string>(rp, "rope_type", get_or<std::string>(rp, "type", "default"));
  if (type == "yarn") {
    r.yarn = true;
    r.original_max_position = get_or<int64_t>(rp, "original_max_position_embeddings", c.max_position);
    r.factor = get_or<double>(rp, "factor", double(c.max_position) / double(r.original_max_position));
    r.beta_fast = get_or<double>(rp, "beta_fast", 32.0);
    r.beta_slow = get_or<double>(rp, "beta_slow", 1.0);
    r.mscale = get_or<double>(rp, "mscale", 0.0);
    r.mscale_all_dim = get_or<double>(rp, "mscale_all_dim", 0.0);
    r.truncate = get_or<bool>(rp, "truncate", true);
    if (rp.contains("attention_factor") && !rp["attention_factor"].is_null())
      r.attention_factor = rp["attention_factor"].get<double>();
    else if (r.mscale != 0 && r.mscale_all_dim != 0)
      r.attention_factor = yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim);
    else
      r.attention_factor = yarn_mscale(r.factor, 1.0);
  } else if (type != "default") {
    fail("config.json: rope type {} is not supported (default, yarn)", type);
  }
}

std::vector<bool> moe_layers(const json& j, int64_t n_layers) {
  std::vector<bool> out(static_cast<size_t>(n_layers), true);
  if (j.contains("mlp_layer_types")) {
    auto types = j["mlp_layer_types"].get<std::vector<std::string>>();
    if (int64_t(types.size()) != n_layers) fail("config.json: mlp_layer_types has {} entries for {} layers", types.size(), n_layers);
    for (size_t i = 0; i < types.size(); ++i) out[i] = types[i] == "sparse";
    return out;
  }
  int64_t first_dense = get_or<int64_t>(j, "first_k_dense_replace", 0);
  int64_t freq = get_or<int64_t>(j, "moe_layer_freq", 1);
  for (int64_t i = 0; i < n_layers; ++i) out[size_t(i)] = i >= first_dense && i % freq == 0;
  return out;
}

}  // namespace

int64_t ModelConfig::kv_elements_per_token_layer() const {
  int64_t n = attention == AttentionKind::MLA ? kv_lora_rank + qk_rope_dim : 2 * num_kv_heads * head_dim;
  if (dsa) n += index_head_dim;
  return n;
}

ModelConfig ModelConfig::from_json(const json& j) {
  if (!j.is_object()) fail("config.json: not a JSON object");
  ModelConfig c;
  c.model_type = require<std::string>(j, "model_type");
  const std::string& t = c.model_type;
  bool mla = t == "deepseek_v3" || t == "deepseek_v32" || t == "glm4_moe_lite" || t == "glm_moe_dsa";
  if (!mla && t != "glm4_moe") fail("config.json: model_type {} is not supported (deepseek_v3, deepseek_v32, glm4_moe, glm4_moe_lite, glm_moe_dsa)", t);
  c.attention = mla ? AttentionKind::MLA : AttentionKind::GQA;
  c.vocab_size = require<int64_t>(j, "vocab_size");
  c.hidden_size = require<int64_t>(j, "hidden_size");
  c.num_layers = require<int64_t>(j, "num_hidden_layers");
  c.max_position = get_or<int64_t>(j, "max_position_embeddings", 4096);
  c.num_heads = require<int64_t>(j, "num_attention_heads");
  c.num_kv_heads = get_or<int64_t>(j, "num_key_value_heads", c.num_heads);
  c.rms_eps = get_or<double>(j, "rms_norm_eps", 1e-6);
  c.tie_embeddings = get_or<bool>(j, "tie_word_embeddings", false);
  c.attention_bias = get_or<bool>(j, "attention_bias", false);
  c.intermediate_size = require<int64_t>(j, "intermediate_size");
  c.moe_intermediate_size = get_or<int64_t>(j, "moe_intermediate_size", 0);
  c.n_routed_experts = get_or<int64_t>(j, "n_routed_experts", 0);
  c.n_shared_experts = get_or<int64_t>(j, "n_shared_experts", 0);
  c.experts_per_token = get_or<int64_t>(j, "num_experts_per_tok", 0);
  c.n_group = get_or<int64_t>(j, "n_group", 1);
  c.topk_group = get_or<int64_t>(j, "topk_group", 1);
  c.norm_topk_prob = get_or<bool>(j, "norm_topk_prob", true);
  c.routed_scaling_factor = get_or<double>(j, "routed_scaling_factor", 1.0);
  c.mtp_layers = get_or<int64_t>(j, "num_nextn_predict_layers", 0);
  c.layer_is_moe = moe_layers(j, c.num_layers);
  if (c.n_routed_experts > 0 && (c.n_group <= 0 || c.n_routed_experts % c.n_group != 0))
    fail("config.json: n_routed_experts {} is not divisible by n_group {}", c.n_routed_experts, c.n_group);
  if (c.experts_per_token > c.n_routed_experts) fail("config.json: num_experts_per_tok exceeds n_routed_experts");

  if (mla) {
    c.q_lora_rank = get_or<int64_t>(j, "q_lora_rank", 0);
    c.kv_lora_rank = require<int64_t>(j, "kv_lora_rank");
    c.qk_nope_dim = require<int64_t>(j, "qk_nope_head_dim");
    c.qk_rope_dim = require<int64_t>(j, "qk_rope_head_dim");
    c.v_head_dim = require<int64_t>(j, "v_head_dim");
    c.head_dim = c.qk_head_dim();
    read_rope(j, c, c.qk_rope_dim);
    // MLA checkpoints (DeepSeek-V3, GLM-4.7-Flash, GLM-5) interleave rope pairs unless the config says otherwise.
    bool interleave = get_or<bool>(j, "rope_interleave", true);
    c.rope.layout = interleave ? RopeLayout::Interleaved : RopeLayout::SplitHalf;
    c.softmax_scale = 1.0 / std::sqrt(double(c.qk_head_dim()));
    if (c.rope.yarn && c.rope.mscale_all_dim != 0) {
      double m = yarn_mscale(c.rope.factor, c.rope.mscale_all_dim);
      c.softmax_scale *= m * m;
    }
  } else {
    c.head_dim = get_or<int64_t>(j, "head_dim", c.hidden_size / c.num_heads);
    c.qk_norm = get_or<bool>(j, "use_qk_norm", false);
    read_rope(j, c, c.head_dim);
    c.rope.layout = RopeLayout::SplitHalf;
    c.softmax_scale = 1.0 / std::sqrt(double(c.head_dim));
    if (c.num_heads % c.num_kv_heads != 0) fail("config.json: num_attention_heads not divisible by num_key_value_heads");
  }

  c.dsa = j.contains("index_topk") && (t == "glm_moe_dsa" || t == "deepseek_v32");
  if (c.dsa) {
    c.index_n_heads = require<int64_t>(j, "index_n_heads");
    c.index_head_dim = require<int64_t>(j, "index_head_dim");
    c.index_topk = require<int64_t>(j, "index_topk");
    c.layer_has_indexer.assign(size_t(c.num_layers), true);
    if (j.contains("indexer_types")) {
      auto types = j["indexer_types"].get<std::vector<std::string>>();
      if (int64_t(types.size()) != c.num_layers) fail("config.json: indexer_types has {} entries for {} layers", types.size(), c.num_layers);
      for (size_t i = 0; i < types.size(); ++i) c.layer_has_indexer[i] = types[i] != "shared";
    } else if (j.contains("index_topk_freq")) {
      int64_t freq = j["index_topk_freq"].get<int64_t>(), offset = get_or<int64_t>(j, "index_topk_offset", 0);
      for (int64_t i = 0; i < c.num_layers; ++i) c.layer_has_indexer[size_t(i)] = std::max<int64_t>(i - offset + 1, 0) % freq == 0 || i == 0;
    }
    if (!c.layer_has_indexer.empty() && !c.layer_has_indexer[0]) fail("config.json: layer 0 cannot share a previous layer's indexer");
    // GLM-5's indexer ropes interleaved pairs (checked against transformers' logits); DeepSeek-V3.2's split halves.
    c.index_rope_layout = t == "glm_moe_dsa" ? RopeLayout::Interleaved : RopeLayout::SplitHalf;
  }
  return c;
}

}  // namespace moesrv
