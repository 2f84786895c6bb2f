// What the network is: per-layer kinds (mixer, indexer, feed-forward), residual form and dimensions, read from
// config.json by one describe() per architecture (src/model/arch/). No compute, no devices.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moesrv {

// The attention family of a model's softmax-attention layers (MLA or GQA); linear layers are per LayerSpec.
enum class AttentionKind { MLA, GQA };
// How rotary pairs are laid out inside the rotated dims: (x[2i], x[2i+1]) or (x[i], x[i + d/2]).
enum class RopeLayout { Interleaved, SplitHalf };

// Token mixer of one layer: softmax attention (MLA, GQA) or a gated delta-rule recurrence with per-channel
// decay (KDA, GLM-5.3-Flash) or per-head decay (Gated DeltaNet, Qwen3-Next).
enum class Mixer { Mla, Gqa, Kda, GatedDelta };
// DSA lightning indexer of an MLA layer: none, its own, or the selection of an earlier layer (indexer_from).
enum class IndexerKind { None, Own, Shared };
enum class FfnKind { Dense, Moe };
// Router: sigmoid scores with correction bias and expert groups (DeepSeek-V3 "noaux_tc"), or softmax top-k.
enum class RouterKind { SigmoidGroup, Softmax };

struct LayerSpec {
  Mixer mixer = Mixer::Mla;
  IndexerKind indexer = IndexerKind::None;
  int64_t indexer_from = -1;  // the layer whose selection a Shared indexer reuses (the nearest Own before it)
  FfnKind ffn = FfnKind::Dense;
  bool recurrent() const { return mixer == Mixer::Kda || mixer == Mixer::GatedDelta; }
};

// hyper: manifold-constrained hyper-connections (mHC) with `streams` residual copies, mixed at every site with the
// layer's hc_{attn,ffn}_{fn,base,scale} (even one stream: its pre/post/comb weights still scale it). Else x += y.
struct ResidualSpec {
  bool hyper = false;
  int64_t streams = 1;
  int64_t sinkhorn_iters = 0;
  double eps = 0;
};

// Linear-attention (delta rule) dims: k_heads query/key heads, v_heads value heads (KDA: equal).
struct LinearAttnDims {
  int64_t k_heads = 0, v_heads = 0, dk = 0, dv = 0, conv_kernel = 4;
  bool lower_bound_set = false;  // KDA: g = lower_bound * sigmoid(exp(A_log) * f); else -exp(A_log) * softplus(f)
  double lower_bound = 0;
  int64_t conv_channels() const { return 2 * k_heads * dk + v_heads * dv; }
  // A layer's fixed-size state (model/state.cpp's StateSpec and every engine size it from these): the conv inputs
  // of the last conv_kernel - 1 tokens, and the recurrence [v_heads, dk, dv].
  int64_t conv_state_floats() const { return (conv_kernel - 1) * conv_channels(); }
  int64_t state_floats() const { return v_heads * dk * dv; }
};

struct RopeConfig {
  double theta = 10000.0;
  int64_t dim = 0;  // rotated dims per head (0: NoPE)
  RopeLayout layout = RopeLayout::SplitHalf;
  bool yarn = false;
  double factor = 1.0, beta_fast = 32, beta_slow = 1, mscale = 0, mscale_all_dim = 0;
  int64_t original_max_position = 0;
  bool truncate = true;
  double attention_factor = 1.0;  // multiplies cos/sin (derived)
};

struct ModelSpec {
  std::string model_type;
  AttentionKind attention = AttentionKind::MLA;
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, max_position = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double rms_eps = 1e-6;
  double norm_weight_offset = 0;  // RMSNorm scales by (offset + w): 1 for Qwen3-Next's zero-centred norms
  bool tie_embeddings = false;
  // MLA
  int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_nope_dim = 0, qk_rope_dim = 0, v_head_dim = 0;
  // GQA
  bool attention_bias = false, qk_norm = false;
  bool attn_output_gate = false;  // q_proj also yields a per-head sigmoid gate on the attention output
  RopeConfig rope;
  double softmax_scale = 0;  // derived: head_dim^-0.5 (x yarn mscale^2 for MLA)
  // MLP / MoE
  int64_t intermediate_size = 0, moe_intermediate_size = 0, shared_intermediate_size = 0;
  int64_t n_routed_experts = 0, n_shared_experts = 0, experts_per_token = 0, n_group = 1, topk_group = 1;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  RouterKind router = RouterKind::SigmoidGroup;
  bool shared_expert_gate = false;  // shared expert output scaled by sigmoid(x . w)
  double swiglu_limit = 0;          // > 0: gate <= limit, |up| <= limit before SiLU(gate) * up
  std::vector<bool> layer_is_moe;   // derived from layers
  // DeepSeek sparse attention (lightning indexer)
  bool dsa = false;
  int64_t index_n_heads = 0, index_head_dim = 0, index_topk = 0;
  int64_t index_kpool = 1;          // > 1: keys pooled over index_kpool tokens (GLM-5.3-Flash)
  bool index_select_tail = false;   // k-pool: also attend the open pool's visible tokens
  std::vector<bool> layer_has_indexer;  // derived: false = reuses an earlier layer's top-k ("shared")
  RopeLayout index_rope_layout = RopeLayout::SplitHalf;
  // Linear attention, residual streams
  LinearAttnDims linear;
  ResidualSpec residual;
  std::vector<LayerSpec> layers;
  int64_t mtp_layers = 0;  // num_nextn_predict_layers: MTP blocks from layer index num_layers on
  // The MTP block's decoder layer (checkpoint layer num_layers): the model's softmax attention with its own DSA
  // indexer, the last layer's feed-forward kind, a plain residual (vLLM's deepseek_mtp / glm5next mtp).
  LayerSpec mtp_layer;

  int64_t qk_head_dim() const { return qk_nope_dim + qk_rope_dim; }
  int64_t stream_width() const { return hidden_size * residual.streams; }  // floats per token between layers
  bool has_recurrent_layers() const;
  // The MTP block's decoder layer as a one-layer model of its own (plain residual).
  ModelSpec mtp_block() const;

  // Parses config.json (flat or nested text_config) with the architecture's describe().
  static ModelSpec from_json(const nlohmann::json& j);
};

// A mixer kind's name in reports, and its FLOPs for one token that attends `attended` positions (the planner's
// cost model; recurrent kinds ignore it). A new mixer kind adds a case to each (model/registry.cpp).
const char* mixer_name(Mixer m);
double mixer_flops_per_token(const ModelSpec& s, Mixer m, double attended);

}  // namespace moesrv
