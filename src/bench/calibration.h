// Host calibration for `bench`: what the CPU path achieves on this machine (memcpy over all cores, one routed
// expert's GEMV and GEMM through CpuExpertPool, lm_head for one row). Feeds the cost model of the projection.
#pragma once
#include <cstdint>

#include "model/weights.h"
#include "runtime/placement.h"

namespace moesrv::bench {

struct Calibration {
  double memcpy_gbps = 0;
  double expert_1tok_s = 0, expert_gemv_gbps = 0;  // one routed expert, one token
  int64_t gemm_tokens = 0;
  double expert_gemm_s = 0, cpu_gflops = 0;  // one routed expert, gemm_tokens tokens
  double head_s = 0;                         // lm_head for one row
};

// Times the loaded weights `w` (footprint `fp`); the expert numbers come from the first MoE layer (0 without one).
Calibration calibrate(const ModelWeights& w, const ModelFootprint& fp);

}  // namespace moesrv::bench
