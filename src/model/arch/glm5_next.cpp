// GLM-5.3-Flash (glm5_next): KDA linear attention + NoPE MLA with the k-pool DSA indexer, mHC residual streams,
// clamped SwiGLU. Layer kinds come from layer_types / mlp_layer_types (transformers' default pattern when absent).
#include "model/arch/arch.h"
#include "model/hf_config.h"
#include "util/error.h"

namespace moesrv::arch {

namespace {

// A field the config leaves out takes transformers' Glm5NextTextConfig default, not the generic readers' one (which
// would silently drop the clamp, the decay bound, the shared expert or the mHC streams). A null swiglu_limit or
// linear_lower_bound stays null: no clamp, the softplus decay.
nlohmann::json with_defaults(const nlohmann::json& text) {
  nlohmann::json j = {{"rms_norm_eps", 1e-5}, {"n_shared_experts", 1},      {"routed_scaling_factor", 2.5},
                      {"swiglu_limit", 10.0}, {"linear_lower_bound", -5.0}, {"hc_mult", 4},
                      {"qk_rope_head_dim", 0}};
  j.update(text);
  const auto absent = [&](const char* key) { return !j.contains(key) || j[key].is_null(); };
  const int64_t L = hf::get_or<int64_t>(j, "num_hidden_layers", 0);
  if (L < 1 || L > hf::kMaxLayers) return j;  // read_common names the problem
  // layer_types: every 4th layer (i % 4 == 3) MLA, the rest KDA; mlp_layer_types: the first 3 dense, the rest MoE.
  if (absent("layer_types")) {
    j["layer_types"] = nlohmann::json::array();
    for (int64_t i = 0; i < L; ++i)
      j["layer_types"].push_back(i % 4 == 3 ? "deepseek_sparse_attention" : "linear_attention");
  }
  if (absent("mlp_layer_types")) {
    j["mlp_layer_types"] = nlohmann::json::array();
    for (int64_t i = 0; i < L; ++i) j["mlp_layer_types"].push_back(i < 3 ? "dense" : "sparse");
  }
  return j;
}

}  // namespace

ModelSpec describe_glm5_next(const nlohmann::json& text) {
  const nlohmann::json j = with_defaults(text);
  ModelSpec s;
  hf::read_common(j, s);
  hf::read_moe(j, s);
  hf::read_mla(j, s);
  if (s.q_lora_rank <= 0) fail("config.json: glm5_next needs q_lora_rank");
  hf::read_rope(j, s, s.qk_rope_dim);  // qk_rope_head_dim is 0: NoPE
  s.swiglu_limit = hf::get_or<double>(j, "swiglu_limit", 0.0);  // null: no clamp

  LinearAttnDims& la = s.linear;
  la.k_heads = la.v_heads = hf::require<int64_t>(j, "linear_num_heads");
  la.dk = la.dv = hf::require<int64_t>(j, "linear_head_dim");
  la.conv_kernel = hf::get_or<int64_t>(j, "linear_conv_kernel_dim", 4);
  la.lower_bound_set = j.contains("linear_lower_bound") && !j["linear_lower_bound"].is_null();
  la.lower_bound = hf::get_or<double>(j, "linear_lower_bound", 0.0);
  if (la.conv_kernel < 1) fail("config.json: linear_conv_kernel_dim must be >= 1");

  s.residual.hyper = true;  // transformers builds the mHC sites for any hc_mult, 1 included
  s.residual.streams = hf::get_or<int64_t>(j, "hc_mult", 4);
  s.residual.sinkhorn_iters = hf::get_or<int64_t>(j, "hc_sinkhorn_iters", 20);
  s.residual.eps = hf::get_or<double>(j, "hc_eps", 1e-6);
  if (s.residual.streams < 1 || s.residual.sinkhorn_iters < 1) fail("config.json: hc_mult and hc_sinkhorn_iters must be >= 1");

  const bool indexed = j.contains("index_topk");
  if (indexed) {
    hf::read_indexer(j, s);
    s.index_kpool = hf::get_or<int64_t>(j, "index_kpool", 16);
    s.index_select_tail = hf::get_or<bool>(j, "index_kpool_always_select_tail", true);
    if (s.index_kpool < 1 || s.index_topk < s.index_kpool) fail("config.json: index_kpool must be in [1, index_topk]");
  }
  auto types = hf::layer_list(j, "layer_types", s.num_layers);
  if (types.empty()) fail("config.json: glm5_next needs layer_types");
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string& t = types[size_t(i)];
    if (t == "linear_attention") s.layers.push_back({Mixer::Kda});
    else if (t == "deepseek_sparse_attention" || t == "full_attention") s.layers.push_back({Mixer::Mla});
    else fail("config.json: layer_types[{}] is {} (linear_attention, deepseek_sparse_attention, full_attention)", i, t);
  }
  hf::finish(s, Mixer::Mla);
  return s;
}

}  // namespace moesrv::arch
