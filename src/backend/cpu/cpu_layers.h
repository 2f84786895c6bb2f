// CPU forward passes of the model's layer types over a batch of S consecutive tokens.
#pragma once
#include <cstdint>
#include <vector>

#include "model/rope.h"
#include "model/weights.h"
#include "runtime/usage_stats.h"

namespace moesrv::cpu {

// Per-layer cache, fp32. MLA keeps only the normalised latent and the roped shared key (absorbed attention).
struct LayerCache {
  std::vector<float> latent, k_rope;  // MLA: [T, kv_lora_rank], [T, qk_rope_dim]
  std::vector<float> index_k;         // DSA indexer keys [T, index_head_dim]
  std::vector<float> k, v;            // GQA: [T, kv_heads * head_dim]
  size_t bytes() const {
    return (latent.size() + k_rope.size() + index_k.size() + k.size() + v.size()) * sizeof(float);
  }
};

// Key positions each query token may attend to (DSA top-k); empty = dense causal attention.
using TokenSelection = std::vector<std::vector<int32_t>>;

// MLA attention for S tokens at positions [pos0, pos0+S). Appends to `cache`. When the layer has an indexer,
// computes and returns the DSA selection in `selection`; for "shared" DSA layers `selection` is the input.
void mla_forward(const MlaWeights& w, const ModelConfig& c, const Rope& rope, const float* x, int64_t S, int64_t pos0,
                 LayerCache& cache, TokenSelection& selection, float* out, std::vector<uint8_t>* ambiguous = nullptr);

// DSA lightning indexer: top-k key positions for each of the S query tokens (appends indexer keys to cache).
// Tokens whose k-th best score ties with an unselected key get ambiguous[s] = 1 (when ambiguous is given).
TokenSelection dsa_select(const IndexerWeights& w, const ModelConfig& c, const Rope& rope, const float* x,
                          const float* q_latent, int64_t S, int64_t pos0, LayerCache& cache,
                          std::vector<uint8_t>* ambiguous = nullptr);

void gqa_forward(const GqaWeights& w, const ModelConfig& c, const Rope& rope, const float* x, int64_t S, int64_t pos0,
                 LayerCache& cache, float* out);

void mlp_forward(const MlpWeights& w, const float* x, int64_t S, float* out);
// Records each token's routed experts into `usage` (layer `layer`) when given.
void moe_forward(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t S, float* out,
                 UsageStats* usage = nullptr, int64_t layer = 0);

}  // namespace moesrv::cpu
