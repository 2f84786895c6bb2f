// Random-weight models built in memory (no files): real layer widths with few layers, for benchmarks and tests.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>

#include "format/package.h"

namespace moesrv {

struct SyntheticOptions {
  uint64_t seed = 1;
  float stddev = 0.02f;          // matrices ~ N(0, stddev) in bf16; norms 1, biases 0
  int64_t distinct_experts = 0;  // 0: each routed expert owns its weights; N: experts alias N weight sets (saves RAM)
  // > 0: skewed routing like real MoE traffic. Each MoE layer ranks its experts in its own random order and its
  // router bias (e_score_correction_bias) is -router_skew * ln(1 + rank). 0.05 makes the hottest half of 288
  // experts take ~89% of top-8 selections (hottest 20%: ~65%) for sigmoid scores of logit spread 0.5-1.3.
  double router_skew = 0;
};

// GLM-5 shapes (hidden 6144, MLA 2048/512/64+192/256, DSA 32x128 top-2048, 256 experts top-8, inter 2048,
// 1 shared expert, vocab 154880) with `layers` layers, every one MoE with its own indexer.
nlohmann::json glm5_config(int64_t layers, int64_t vocab = 154880);
// The same structure at reduced width (hidden 256, 32 experts top-4): for tests.
nlohmann::json tiny_moe_config(int64_t layers);

// GLM-5.3-Flash (glm5_next) shapes (hidden 4096, KDA 64x128, NoPE MLA 256/512, indexer 32x128 k-pool 4 top-2048,
// 288 experts top-8 + 1 shared, mHC 4 streams) with `layers` layers (i % 4 == 3 MLA, the rest KDA; all MoE).
nlohmann::json glm5_next_config(int64_t layers, int64_t vocab = 154880);
// The same structure at test width (hidden 64, 16 experts top-4, KDA 4x16, indexer 8x16 top-16).
nlohmann::json tiny_glm5_next_config(int64_t layers);

// Builds every tensor ModelWeights::load needs for `config` (an HF config.json object).
std::shared_ptr<ModelPackage> make_synthetic_model(const nlohmann::json& config, const SyntheticOptions& opt = {});

}  // namespace moesrv
