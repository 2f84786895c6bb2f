// Model weights, organised per layer, as views/loaders over a ModelPackage. Backends read these.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "format/package.h"
#include "model/config.h"
#include "model/linear.h"

namespace moesrv {

struct NormWeights {
  std::vector<float> weight, bias;  // bias only for LayerNorm
};

struct MlpWeights {  // SwiGLU: down(silu(gate x) * up x); limit > 0 clamps gate <= limit and |up| <= limit first
  std::unique_ptr<Linear> gate, up, down;
  float limit = 0;
};

struct IndexerWeights {  // DSA lightning indexer
  std::unique_ptr<Linear> wq_b, wk, weights_proj;
  NormWeights k_norm;  // LayerNorm
  // k-pool (index_kpool > 1): per-token gate logits x . pool_gate^T, plus pool_ape[t % kpool], softmax per pool.
  std::unique_ptr<Linear> pool_gate;  // [index_head_dim, hidden]
  std::vector<float> pool_ape;        // [kpool, index_head_dim]
};

struct MlaWeights {
  std::unique_ptr<Linear> q_a, q_b, q;  // q only when q_lora_rank == 0
  NormWeights q_a_norm, kv_a_norm;
  std::unique_ptr<Linear> kv_a, kv_b, o;
  // kv_b split per head for absorbed attention, fp32: w_uk [H][dn][r], w_uv [H][dv][r].
  std::vector<float> w_uk, w_uv;
  std::optional<IndexerWeights> indexer;  // DSA layers with their own indexer
};

struct GqaWeights {
  std::unique_ptr<Linear> q, k, v, o;  // q yields [H, 2 * head_dim] (query, gate) when attn_output_gate
  NormWeights q_norm, k_norm;  // per-head RMSNorm when qk_norm
};

// KDA (GLM-5.3-Flash): q/k/v projections + short convs, per-channel decay f_b(f_a x) + dt_bias with A_log,
// beta = sigmoid(b x), output gate g_b(g_a x) through a sigmoid-gated RMSNorm, o_proj.
struct KdaWeights {
  std::unique_ptr<Linear> q, k, v, f_a, f_b, b, g_a, g_b, o;
  std::vector<float> conv;  // [3 * H * d, kernel] over the channels q | k | v
  std::vector<float> dt_bias, a_log;
  NormWeights o_norm;  // [d]
};

// Gated DeltaNet (Qwen3-Next): in_proj_qkvz and in_proj_ba grouped per key head, per-head decay.
struct GatedDeltaWeights {
  std::unique_ptr<Linear> qkvz, ba, out;
  std::vector<float> conv;  // [2 * Hk * dk + Hv * dv, kernel]
  std::vector<float> dt_bias, a_log;  // [Hv]
  NormWeights norm;  // [dv], SiLU-gated by z
};

// mHC site: fn [(2 + hc) * hc, hc * D], base [(2 + hc) * hc], scale [3], fp32.
struct HyperWeights {
  std::vector<float> fn, base, scale;
};

struct MoeWeights {
  std::vector<float> router;       // [E, hidden] fp32
  std::vector<float> router_bias;  // e_score_correction_bias [E]
  std::vector<MlpWeights> experts;
  std::optional<MlpWeights> shared;
  std::vector<float> shared_gate;  // [hidden]: shared output scaled by sigmoid(x . shared_gate) when present
};

struct LayerWeights {
  NormWeights input_norm, post_attention_norm;
  std::optional<MlaWeights> mla;
  std::optional<GqaWeights> gqa;
  std::optional<KdaWeights> kda;
  std::optional<GatedDeltaWeights> gated_delta;
  HyperWeights attn_hc, ffn_hc;   // residual.hyper
  std::optional<MlpWeights> mlp;  // dense layers
  std::optional<MoeWeights> moe;
};

// The linears a token passes through in a layer's mixer, null ones left out (MLA: not kv_b, which runs absorbed as
// w_uk / w_uv), those of its own DSA indexer apart, and the count of fp32 values its mixer reads per token (MLA's
// absorbed w_uk / w_uv, the linear-attention convs). A new mixer kind adds its weights to these (model/weights.cpp).
std::vector<const Linear*> mixer_linears(const LayerWeights& L);
std::vector<const Linear*> indexer_linears(const LayerWeights& L);
size_t mixer_floats(const LayerWeights& L);

// The multi-token-prediction block at layer num_hidden_layers (DeepSeek-V3 layout): x = eh_proj(concat(enorm(embed(t)),
// hnorm(h))), one decoder layer (plain residual), then shared_head.norm and the head.
struct MtpWeights {
  NormWeights enorm, hnorm, head_norm;
  std::unique_ptr<Linear> eh_proj;  // [hidden, 2 * hidden]
  std::unique_ptr<Linear> head;     // shared_head.head; null: the model's lm_head
  LayerWeights layer;
};

struct ModelWeights {
  std::shared_ptr<ModelPackage> package;
  ModelSpec config;
  const TensorView* embed = nullptr;  // [vocab, hidden], any float dtype
  NormWeights final_norm;
  std::unique_ptr<Linear> lm_head;
  std::vector<LayerWeights> layers;
  std::string root;          // tensor name prefix of the text model: "model." or "model.language_model."
  // The MTP block at layer num_hidden_layers, when the package has one: kept (memory-mapped views) for
  // speculative decoding; the forward pass never reads it.
  std::vector<const TensorView*> mtp;
  // The same block loaded for speculative decoding, when the config declares it (num_nextn_predict_layers) and the
  // package has its eh_proj; null otherwise.
  std::unique_ptr<MtpWeights> mtp_block;

  // Loads every tensor the config needs; a missing tensor is an error naming it.
  // Every matrix through `make_linear` (the CPU's load_linear keeps each as stored).
  static std::unique_ptr<ModelWeights> load(std::shared_ptr<ModelPackage> pkg, const LinearLoader& make_linear);
  // The same with the package's config already parsed (`spec` = ModelSpec::from_json(pkg->config())).
  static std::unique_ptr<ModelWeights> load(std::shared_ptr<ModelPackage> pkg, ModelSpec spec,
                                            const LinearLoader& make_linear);
};

}  // namespace moesrv
