// GLM-5.3-Flash (glm5_next): KDA linear attention + NoPE MLA with the k-pool DSA indexer, mHC residual streams,
// clamped SwiGLU. Layer kinds come from layer_types / mlp_layer_types (never from a layer-index pattern).
#include "model/arch/arch.h"
#include "model/hf_config.h"
#include "util/error.h"

namespace moesrv::arch {

ModelSpec describe_glm5_next(const nlohmann::json& j) {
  ModelSpec s;
  hf::read_common(j, s);
  hf::read_moe(j, s);
  hf::read_mla(j, s);
  if (s.q_lora_rank <= 0) fail("config.json: glm5_next needs q_lora_rank");
  hf::read_rope(j, s, s.qk_rope_dim);  // qk_rope_head_dim is 0: NoPE
  s.swiglu_limit = hf::get_or<double>(j, "swiglu_limit", 0.0);

  LinearAttnDims& la = s.linear;
  la.k_heads = la.v_heads = hf::require<int64_t>(j, "linear_num_heads");
  la.dk = la.dv = hf::require<int64_t>(j, "linear_head_dim");
  la.conv_kernel = hf::get_or<int64_t>(j, "linear_conv_kernel_dim", 4);
  la.lower_bound_set = j.contains("linear_lower_bound") && !j["linear_lower_bound"].is_null();
  la.lower_bound = hf::get_or<double>(j, "linear_lower_bound", 0.0);
  if (la.conv_kernel < 1) fail("config.json: linear_conv_kernel_dim must be >= 1");

  s.residual.streams = hf::get_or<int64_t>(j, "hc_mult", 1);
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
