// Per-layer timing of the CPU engine for `bench_glm5_next_cpu`: CpuEngine::forward with its step timer on
// (CpuEngine::time_steps), its self-check against forward, layer kinds and the weight bytes a decode token reads
// per layer.
#pragma once
#include <string>
#include <vector>

#include "backend/cpu/cpu_engine.h"

namespace moesrv::bench {

// "KDA+MoE", "MLA+dense", ...
std::string layer_kind(const LayerSpec& L);

using StepTimes = CpuEngine::StepTimes;

// CpuEngine::forward with each step timed into `t` (adds to it: CpuEngine::time_steps); the logits of the last row.
std::vector<float> timed_forward(CpuEngine& engine, SequenceState& seq, const std::vector<int32_t>& tokens,
                                 StepTimes& t);

// Checks on a tiny model that timing the steps keeps CpuEngine::forward's logits exactly (throws if not); returns
// the largest difference (0).
double self_check();

// Bytes of weights one decode token reads in layer L.
double decode_weight_bytes(const LayerWeights& L, const ModelSpec& c);

}  // namespace moesrv::bench
