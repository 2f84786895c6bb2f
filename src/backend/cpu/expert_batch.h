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
  // A slice [inter0, inter1) of the intermediate range (inter1 = 0: the whole expert): y = down[:, slice] applied to
  // the clamped SwiGLU of gate's and up's slice rows, the slice's share of the expert's output (the shares of
  // slices that cover the range add up to it, without the down bias). Only where expert_slices_supported says so.
  int64_t inter0 = 0, inter1 = 0;
};

constexpr int64_t kExpertSliceAlign = 128;  // slice bounds: multiples of the Hadamard block
// Whether an expert can be computed in slices for n rows: EXL3 gate/up/down on the batched path (n rows at most
// exl3_gemv_fast_rows), no down bias; `inter` is then its padded intermediate size (slice bounds up to it).
bool expert_slices_supported(const MlpWeights& expert, int64_t n, int64_t* inter = nullptr);

// y = mlp_forward(expert, x) for every job, bit-identical to calling mlp_forward one job at a time. Jobs whose
// linears are not all EXL3, or with more rows than exl3_gemv_fast_rows, run through mlp_forward. A sliced job
// gets its slice's share (throws where the slice is not supported or its bounds are not aligned).
void experts_forward(const std::vector<ExpertRows>& jobs);

// A routed expert's share of a batch: rows tokens[i] of x, their outputs scaled by weights[i].
struct RoutedRows {
  const MlpWeights* expert = nullptr;
  std::vector<int32_t> tokens;  // rows of x routed to this expert
  std::vector<float> weights;   // routing weight of each of those rows
  int64_t inter0 = 0, inter1 = 0;  // as ExpertRows: a slice's share only
};

// out[t] += w * expert(x[t]) for every job row, x and out [*, D]; the outputs are added job after job, as one expert
// at a time would add them. Jobs of few rows (decode) run together through experts_forward; the others one at a
// time, so the scratch holds the few-row jobs' rows and one larger job's. Throws on a malformed job (no expert,
// tokens and weights of different lengths, an output width other than D).
void add_routed_experts(const std::vector<RoutedRows>& jobs, const float* x, int64_t D, float* out);

}  // namespace moesrv::cpu
