// Several routed experts, each on its own few rows (decode: one token each), computed together on the CPU: EXL3
// experts share one parallel_for over the 16-column strips of every gate and up projection and one over every
// down strip, so the cores spread over all experts' weights at once instead of one expert's at a time.
#pragma once
#include <cstdint>
#include <vector>

#include "model/weights.h"

namespace moesrv::cpu {

struct ExpertRows {
  const MlpWeights* expert = nullptr;
  const float* x = nullptr;  // [n, hidden]
  int64_t n = 0;
  float* y = nullptr;  // [n, hidden], overwritten
};

// y = mlp_forward(expert, x) for every job, bit-identical to calling mlp_forward one job at a time. Jobs whose
// linears are not all EXL3, or with more rows than exl3_gemv_fast_rows, run through mlp_forward.
void experts_forward(const std::vector<ExpertRows>& jobs);

}  // namespace moesrv::cpu
