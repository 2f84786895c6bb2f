#include "model/hf_config.h"

#include <cmath>

#include "util/error.h"

namespace moesrv::hf {

const json& text_fields(const json& config) {
  auto it = config.find("text_config");
  return it != config.end() && it->is_object() ? *it : config;
}

std::vector<std::string> layer_list(const json& j, const char* key, int64_t n) {
  if (!j.contains(key) || j[key].is_null()) return {};
  auto v = get_or<std::vector<std::string>>(j, key, {});
  if (int64_t(v.size()) != n) fail("config.json: {} has {} entries for {} layers", key, v.size(), n);
  return v;
}

void read_common(const json& j, ModelSpec& s) {
  s.vocab_size = require<int64_t>(j, "vocab_size");
  s.hidden_size = require<int64_t>(j, "hidden_size");
  s.num_layers = require<int64_t>(j, "num_hidden_layers");
  s.max_position = get_or<int64_t>(j, "max_position_embeddings", 4096);
  s.num_heads = require<int64_t>(j, "num_attention_heads");
  s.num_kv_heads = get_or<int64_t>(j, "num_key_value_heads", s.num_heads);
  s.rms_eps = get_or<double>(j, "rms_norm_eps", 1e-6);
  s.tie_embeddings = get_or<bool>(j, "tie_word_embeddings", false);
  s.attention_bias = get_or<bool>(j, "attention_bias", false);
  s.intermediate_size = require<int64_t>(j, "intermediate_size");
  s.mtp_layers = get_or<int64_t>(j, "num_nextn_predict_layers", 0);
  if (s.vocab_size <= 0 || s.hidden_size <= 0 || s.num_layers <= 0 || s.num_heads <= 0)
    fail("config.json: vocab_size, hidden_size, num_hidden_layers and num_attention_heads must be positive");
  if (s.num_layers > kMaxLayers) fail("config.json: num_hidden_layers {} exceeds {}", s.num_layers, kMaxLayers);
}

void read_moe(const json& j, ModelSpec& s) {
  s.moe_intermediate_size = get_or<int64_t>(j, "moe_intermediate_size", 0);
  s.n_routed_experts = get_or<int64_t>(j, "n_routed_experts", get_or<int64_t>(j, "num_experts", 0));
  s.n_shared_experts = get_or<int64_t>(j, "n_shared_experts", 0);
  s.shared_intermediate_size = s.moe_intermediate_size * s.n_shared_experts;
  s.experts_per_token = get_or<int64_t>(j, "num_experts_per_tok", 0);
  s.n_group = get_or<int64_t>(j, "n_group", 1);
  s.topk_group = get_or<int64_t>(j, "topk_group", 1);
  s.norm_topk_prob = get_or<bool>(j, "norm_topk_prob", true);
  s.routed_scaling_factor = get_or<double>(j, "routed_scaling_factor", 1.0);
  s.layer_is_moe.assign(size_t(s.num_layers), true);
  auto types = layer_list(j, "mlp_layer_types", s.num_layers);
  if (!types.empty()) {
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i] != "sparse" && types[i] != "dense") fail("config.json: mlp_layer_types[{}] is {} (dense, sparse)", i, types[i]);
      s.layer_is_moe[i] = types[i] == "sparse";
    }
  } else {
    int64_t first_dense = get_or<int64_t>(j, "first_k_dense_replace", 0);
    int64_t freq = get_or<int64_t>(j, "moe_layer_freq", 1);
    if (freq < 1) fail("config.json: moe_layer_freq {} must be at least 1", freq);
    for (int64_t i = 0; i < s.num_layers; ++i) s.layer_is_moe[size_t(i)] = i >= first_dense && i % freq == 0;
  }
  bool any_moe = false;
  for (bool m : s.layer_is_moe) any_moe |= m;
  if (any_moe && (s.n_routed_experts <= 0 || s.experts_per_token <= 0 || s.moe_intermediate_size <= 0))
    fail("config.json: MoE layers need n_routed_experts, num_experts_per_tok and moe_intermediate_size");
  if (s.n_routed_experts > 0 && (s.n_group <= 0 || s.n_routed_experts % s.n_group != 0))
    fail("config.json: n_routed_experts {} is not divisible by n_group {}", s.n_routed_experts, s.n_group);
  if (s.topk_group > s.n_group) fail("config.json: topk_group {} exceeds n_group {}", s.topk_group, s.n_group);
  if (s.experts_per_token > s.n_routed_experts) fail("config.json: num_experts_per_tok exceeds n_routed_experts");
}

namespace {
double yarn_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }
}  // namespace

void read_rope(const json& j, ModelSpec& s, int64_t rope_head_dim) {
  json rp = j.contains("rope_parameters") ? j["rope_parameters"] : j.value("rope_scaling", json::object());
  if (rp.is_null()) rp = json::object();
  RopeConfig& r = s.rope;
  r.theta = get_or<double>(rp, "rope_theta", get_or<double>(j, "rope_theta", 10000.0));
  double partial = get_or<double>(rp, "partial_rotary_factor", get_or<double>(j, "partial_rotary_factor", 1.0));
  if (!(partial > 0 && partial <= 1)) fail("config.json: partial_rotary_factor {} is outside (0, 1]", partial);
  r.dim = int64_t(double(rope_head_dim) * partial);
  std::string type = get_or<std::string>(rp, "rope_type", get_or<std::string>(rp, "type", "default"));
  if (type == "yarn") {
    r.yarn = true;
    r.original_max_position = get_or<int64_t>(rp, "original_max_position_embeddings", s.max_position);
    if (r.original_max_position < 1)
      fail("config.json: original_max_position_embeddings {} must be positive", r.original_max_position);
    r.factor = get_or<double>(rp, "factor", double(s.max_position) / double(r.original_max_position));
    r.beta_fast = get_or<double>(rp, "beta_fast", 32.0);
    r.beta_slow = get_or<double>(rp, "beta_slow", 1.0);
    r.mscale = get_or<double>(rp, "mscale", 0.0);
    r.mscale_all_dim = get_or<double>(rp, "mscale_all_dim", 0.0);
    r.truncate = get_or<bool>(rp, "truncate", true);
    if (rp.contains("attention_factor") && !rp["attention_factor"].is_null())
      r.attention_factor = get_or<double>(rp, "attention_factor", 1.0);
    else if (r.mscale != 0 && r.mscale_all_dim != 0)
      r.attention_factor = yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim);
    else
      r.attention_factor = yarn_mscale(r.factor, 1.0);
  } else if (type != "default") {
    fail("config.json: rope type {} is not supported (default, yarn)", type);
  }
}

void read_mla(const json& j, ModelSpec& s) {
  s.attention = AttentionKind::MLA;
  s.q_lora_rank = get_or<int64_t>(j, "q_lora_rank", 0);
  s.kv_lora_rank = require<int64_t>(j, "kv_lora_rank");
  s.qk_nope_dim = require<int64_t>(j, "qk_nope_head_dim");
  s.qk_rope_dim = require<int64_t>(j, "qk_rope_head_dim");
  s.v_head_dim = require<int64_t>(j, "v_head_dim");
  s.head_dim = s.qk_head_dim();
  s.softmax_scale = 1.0 / std::sqrt(double(s.qk_head_dim()));
}

void read_indexer(const json& j, ModelSpec& s) {
  s.dsa = true;
  s.index_n_heads = require<int64_t>(j, "index_n_heads");
  s.index_head_dim = require<int64_t>(j, "index_head_dim");
  s.index_topk = require<int64_t>(j, "index_topk");
  if (s.q_lora_rank == 0) fail("config.json: a DSA indexer needs q_lora_rank");
  s.layer_has_indexer.assign(size_t(s.num_layers), true);
  auto types = layer_list(j, "indexer_types", s.num_layers);
  if (!types.empty()) {
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i] != "full" && types[i] != "shared") fail("config.json: indexer_types[{}] is {} (full, shared)", i, types[i]);
      s.layer_has_indexer[i] = types[i] == "full";
    }
  } else if (j.contains("index_topk_freq")) {
    int64_t freq = require<int64_t>(j, "index_topk_freq"), offset = get_or<int64_t>(j, "index_topk_offset", 0);
    if (freq < 1) fail("config.json: index_topk_freq {} must be at least 1", freq);
    for (int64_t i = 0; i < s.num_layers; ++i)
      s.layer_has_indexer[size_t(i)] = std::max<int64_t>(i - offset + 1, 0) % freq == 0 || i == 0;
  }
}

void check_ranges(const ModelSpec& s) {
  auto in = [](const char* name, int64_t v, int64_t lo, int64_t hi) {
    if (v < lo || v > hi) fail("config.json: {} = {} is outside [{}, {}]", name, v, lo, hi);
  };
  constexpr int64_t k12 = int64_t(1) << 12, k14 = int64_t(1) << 14, k16 = int64_t(1) << 16, k20 = int64_t(1) << 20,
                    k22 = int64_t(1) << 22, k24 = int64_t(1) << 24;
  in("vocab_size", s.vocab_size, 1, k24);
  in("hidden_size", s.hidden_size, 1, k20);
  in("num_hidden_layers", s.num_layers, 1, kMaxLayers);
  in("max_position_embeddings", s.max_position, 1, k24);
  in("num_attention_heads", s.num_heads, 1, k12);
  in("num_key_value_heads", s.num_kv_heads, 1, k12);
  in("head_dim", s.head_dim, 0, k14);
  in("intermediate_size", s.intermediate_size, 0, k22);
  in("moe_intermediate_size", s.moe_intermediate_size, 0, k22);
  in("shared expert intermediate size", s.shared_intermediate_size, 0, k22);
  in("n_routed_experts", s.n_routed_experts, 0, k16);
  in("n_shared_experts", s.n_shared_experts, 0, k12);
  in("q_lora_rank", s.q_lora_rank, 0, k16);
  in("kv_lora_rank", s.kv_lora_rank, 0, k16);
  in("qk_nope_head_dim", s.qk_nope_dim, 0, k14);
  in("qk_rope_head_dim", s.qk_rope_dim, 0, k14);
  in("v_head_dim", s.v_head_dim, 0, k14);
  in("index_n_heads", s.index_n_heads, 0, k12);
  in("index_head_dim", s.index_head_dim, 0, k14);
  in("index_topk", s.index_topk, 0, k24);
  in("index_kpool", s.index_kpool, 1, k16);
  in("linear key heads", s.linear.k_heads, 0, k12);
  in("linear value heads", s.linear.v_heads, 0, k12);
  in("linear key head dim", s.linear.dk, 0, k14);
  in("linear value head dim", s.linear.dv, 0, k14);
  in("linear_conv_kernel_dim", s.linear.conv_kernel, 0, 64);
  in("hc_mult", s.residual.streams, 1, 64);
  in("hc_sinkhorn_iters", s.residual.sinkhorn_iters, 0, 1000);
  in("num_nextn_predict_layers", s.mtp_layers, 0, 64);
  if (!(s.rms_eps >= 0)) fail("config.json: rms_norm_eps {} must be >= 0", s.rms_eps);
  if (s.rope.yarn && !(s.rope.factor > 0 && std::isfinite(s.rope.factor)))
    fail("config.json: rope factor {} must be positive and finite", s.rope.factor);
}

void finish(ModelSpec& s, Mixer mixer) {
  if (s.layers.empty()) s.layers.assign(size_t(s.num_layers), LayerSpec{mixer});
  int64_t last_own = -1;
  for (int64_t i = 0; i < s.num_layers; ++i) {
    LayerSpec& L = s.layers[size_t(i)];
    L.ffn = s.layer_is_moe[size_t(i)] ? FfnKind::Moe : FfnKind::Dense;
    if (L.mixer != Mixer::Mla || !s.dsa) continue;
    if (s.layer_has_indexer[size_t(i)]) {
      L.indexer = IndexerKind::Own;
      last_own = i;
    } else {
      if (last_own < 0) fail("config.json: layer {} shares the indexer of an earlier layer, but none has one", i);
      L.indexer = IndexerKind::Shared;
      L.indexer_from = last_own;
    }
  }
  if (s.dsa)
    for (int64_t i = 0; i < s.num_layers; ++i) s.layer_has_indexer[size_t(i)] = s.layers[size_t(i)].indexer == IndexerKind::Own;
  s.mtp_layer = {s.attention == AttentionKind::MLA ? Mixer::Mla : Mixer::Gqa,
                 s.dsa ? IndexerKind::Own : IndexerKind::None, -1, s.layers.back().ffn};
}

}  // namespace moesrv::hf
