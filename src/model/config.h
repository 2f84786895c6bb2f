// Model hyper-parameters read from a Hugging Face config.json; one struct for every supported architecture.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moesrv {

enum class AttentionKind { MLA, GQA };
// How rotary pairs are laid out inside the rotated dims: (x[2i], x[2i+1]) or (x[i], x[i + d/2]).
enum class RopeLayout { Interleaved, SplitHalf };

struct RopeConfig {
  double theta = 10000.0;
  int64_t dim = 0;  // rotated dims per head
  RopeLayout layout = RopeLayout::SplitHalf;
  bool yarn = false;
  double factor = 1.0, beta_fast = 32, beta_slow = 1, mscale = 0, mscale_all_dim = 0;
  int64_t original_max_position = 0;
  bool truncate = true;
  double attention_factor = 1.0;  // multiplies cos/sin (derived)
};

struct ModelConfig {
  std::string model_type;
  AttentionKind attention = AttentionKind::MLA;
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, max_position = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double rms_eps = 1e-6;
  bool tie_embeddings = false;
  // MLA
  int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_nope_dim = 0, qk_rope_dim = 0, v_head_dim = 0;
  // GQA
  bool attention_bias = false, qk_norm = false;
  RopeConfig rope;
  double softmax_scale = 0;  // derived: head_dim^-0.5 (x yarn mscale^2 for MLA)
  // MLP / MoE
  int64_t intermediate_size = 0, moe_intermediate_size = 0;
  int64_t n_routed_experts = 0, n_shared_experts = 0, experts_per_token = 0, n_group = 1, topk_group = 1;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  std::vector<bool> layer_is_moe;
  // DeepSeek sparse attention (lightning indexer)
  bool dsa = false;
  int64_t index_n_heads = 0, index_head_dim = 0, index_topk = 0;
  std::vector<bool> layer_has_indexer;  // false: reuse the previous layer's top-k ("shared")
  RopeLayout index_rope_layout = RopeLayout::SplitHalf;
  int64_t mtp_layers = 0;

  int64_t qk_head_dim() const { return qk_nope_dim + qk_rope_dim; }
  // Bytes of KV cache per token per layer at fp32 (the CPU cache) or a given element size.
  int64_t kv_elements_per_token_layer() const;

  static ModelConfig from_json(const nlohmann::json& j);
};

}  // namespace moesrv
