// Engine measurements for `bench`: time to first token and decode seconds per token of an engine at a context, and
// (CUDA builds with a visible device) the CUDA engine under three expert placements on the loaded layers.
#pragma once
#include <memory>

#include "backend/engine.h"
#include "bench/bench.h"
#include "format/package.h"
#include "model/config.h"
#include "runtime/placement.h"

namespace moesrv::bench {

struct Measured {
  int64_t context = 0;
  double ttft_s = 0, decode_s = 0;  // decode: seconds per token
};

// Prefills `context` pseudo-random tokens, then decodes `decode_tokens` greedy tokens.
Measured measure_engine(Engine& engine, int64_t context, int64_t decode_tokens);

// Runs the CUDA engine on `pkg` all-in-VRAM, with the per-layer homes of `full_hybrid` (the full model's hybrid
// plan) and with every expert on the CPU; appends its table to r.markdown and r.json["measured_gpu"]. No-op
// without CUDA or a device.
void measure_gpu(const BenchOptions& opt, const std::shared_ptr<ModelPackage>& pkg, const ModelSpec& c,
                 const PlacementPlan& full_hybrid, const ModelFootprint& fp, BenchResult& r);

}  // namespace moesrv::bench
