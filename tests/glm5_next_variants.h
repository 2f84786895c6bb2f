// glm5_next configs beyond the two transformers reference files, as deltas on the tiny synthetic config. One list for
// the self-consistency tests (test_glm5_next.cpp) and the check against the naive reference
// (test_glm5_next_independent.cpp).
#pragma once
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/synthetic_model.h"

namespace moesrv::testing {

struct Glm5NextConfigVariant {
  const char* name;
  nlohmann::json patch;              // merged into tiny_glm5_next_config(8)
  std::vector<const char*> erase{};  // then these fields are left out (transformers' defaults apply)
};

inline std::vector<std::string> glm5_layer_list(std::initializer_list<const char*> t) { return {t.begin(), t.end()}; }

inline const std::vector<Glm5NextConfigVariant>& glm5_next_variants() {
  using json = nlohmann::json;
  static const std::vector<Glm5NextConfigVariant> v = {
      {"base", json::object()},
      {"hc2", {{"hc_mult", 2}}},
      {"hc1", {{"hc_mult", 1}}},
      {"sinkhorn1", {{"hc_sinkhorn_iters", 1}}},
      {"sinkhorn7", {{"hc_sinkhorn_iters", 7}}},
      {"hc_eps", {{"hc_eps", 1e-3}}},
      {"kpool2", {{"index_kpool", 2}}},
      {"kpool8_topk32", {{"index_kpool", 8}, {"index_topk", 32}}},
      {"index_heads32", {{"index_n_heads", 32}}},
      {"groups", {{"n_group", 4}, {"topk_group", 2}}},
      {"no_tail", {{"index_kpool_always_select_tail", false}}},
      {"no_lower_bound", {{"linear_lower_bound", nullptr}}},
      {"tight_clamp", {{"swiglu_limit", 0.05}}},
      {"shared_indexer",
       {{"indexer_types", glm5_layer_list({"full", "full", "full", "full", "full", "full", "full", "shared"})}}},
      // A shared layer right after the full one it reuses (the only placement transformers' code passes the selection
      // through).
      {"shared_adjacent",
       {{"layer_types", glm5_layer_list({"linear_attention", "linear_attention", "linear_attention",
                                         "deepseek_sparse_attention", "deepseek_sparse_attention", "linear_attention",
                                         "linear_attention", "deepseek_sparse_attention"})},
        {"indexer_types", glm5_layer_list({"full", "full", "full", "full", "shared", "full", "full", "full"})}}},
      {"layer_pattern",
       {{"layer_types", glm5_layer_list({"deepseek_sparse_attention", "linear_attention", "linear_attention",
                                         "linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                                         "linear_attention", "linear_attention"})},
        {"mlp_layer_types",
         glm5_layer_list({"dense", "sparse", "dense", "sparse", "sparse", "sparse", "sparse", "sparse"})}}},
      // Every optional field left out: Glm5NextTextConfig's defaults (rms_norm_eps 1e-5, swiglu_limit 10, decay
      // bound -5, hc_mult 4, 20 Sinkhorn iterations, hc_eps 1e-6, k-pool 16 with the tail, conv kernel 4, one group,
      // 1 shared expert, routed scale 2.5, first 3 layers dense, every 4th layer MLA, every indexer full).
      {"defaults",
       json::object(),
       {"rms_norm_eps", "swiglu_limit", "linear_lower_bound", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "index_kpool",
        "index_kpool_always_select_tail", "linear_conv_kernel_dim", "n_group", "topk_group", "norm_topk_prob",
        "n_shared_experts", "routed_scaling_factor", "qk_rope_head_dim", "layer_types", "mlp_layer_types",
        "indexer_types"}},
  };
  return v;
}

inline nlohmann::json glm5_next_variant_config(const Glm5NextConfigVariant& v) {
  nlohmann::json c = tiny_glm5_next_config(8);
  c.update(v.patch);
  for (const char* key : v.erase) c.erase(key);
  return c;
}

}  // namespace moesrv::testing
