// Routers: sigmoid, group-limited top-k with correction bias (DeepSeek-V3 / GLM-4.5+ "noaux_tc"), or softmax top-k.
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"

namespace moesrv {

struct RoutedExperts {
  std::vector<int32_t> ids;     // [k]
  std::vector<float> weights;   // [k], already normalised and scaled
};

// `logits`: router logits for one token [E] (fp32). `bias`: e_score_correction_bias [E].
RoutedExperts route_token(const float* logits, const float* bias, const ModelSpec& c);

}  // namespace moesrv
