// Model weights, organised per layer, as views/loaders over a ModelPackage. Backends read these.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/cpu/linear.h"
#include "format/package.h"
#include "model/config.h"

namespace moesrv {

struct NormWeights {
  std::vector<float> weight, bias;  // bias only for LayerNorm
};

struct MlpWeights {  // SwiGLU: down(silu(gate x) * up x)
  std::unique_ptr<Linear> gate, up, down;
};

struct IndexerWeights {  // DSA lightning indexer
  std::unique_ptr<Linear> wq_b, wk, weights_proj;
  NormWeights k_norm;  // LayerNorm
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
  std::unique_ptr<Linear> q, k, v, o;
  NormWeights q_norm, k_norm;  // per-head RMSNorm when qk_norm
};

struct MoeWeights {
  std::vector<float> router;       // [E, hidden] fp32
  std::vector<float> router_bias;  // e_score_correction_bias [E]
  std::vector<MlpWeights> experts;
  std::optional<MlpWeights> shared;
};

struct LayerWeights {
  NormWeights input_norm, post_attention_norm;
  std::optional<MlaWeights> mla;
  std::optional<GqaWeights> gqa;
  std::optional<MlpWeights> mlp;  // dense layers
  std::optional<MoeWeights> moe;
};

struct ModelWeights {
  std::shared_ptr<ModelPackage> package;
  ModelConfig config;
  const TensorView* embed = nullptr;  // [vocab, hidden], any float dtype
  NormWeights final_norm;
  std::unique_ptr<Linear> lm_head;
  std::vector<LayerWeights> layers;

  // Loads every tensor the config needs; a missing tensor is an error naming it.
  static std::unique_ptr<ModelWeights> load(std::shared_ptr<ModelPackage> pkg);
};

}  // namespace moesrv
