// Turns the runtime's placement plan (runtime/placement.h) into CUDA engine options: pinned experts stay in
// VRAM, cached and fetched ones live in host memory behind the layer's LRU slots, cold CPU experts run on the host
// (or stream through the slots when the engine's per-pass split says the link is cheaper).
// Header-only so CPU builds can use it too.
#pragma once
#include <algorithm>
#include <string>

#include "backend/cuda/cuda_engine.h"
#include "runtime/engine_factory.h"
#include "runtime/placement.h"
#include "util/error.h"

namespace moesrv {

// --cold-experts: "auto" splits each pass's cold experts between the PCIe link and the CPU from measured rates;
// "cpu" computes every CPU-placed expert on the CPU (no streaming slots); "gpu" streams every cold expert over
// PCIe and runs it on the GPU (the CPU computes none); "read" is "gpu" where decode reads the cold EXL3 experts in
// place over PCIe instead of copying them (CudaEngineOptions::zero_copy_cold). Throws on anything else.
inline void apply_cold_experts(const std::string& mode, CudaEngineOptions& opt) {
  if (mode == "read") {
    apply_cold_experts("gpu", opt);
    opt.zero_copy_cold = true;
  } else if (mode == "auto") {
    opt.stream_cold = true;
  } else if (mode == "cpu") {
    opt.stream_cold = false;
  } else if (mode == "gpu") {
    opt.stream_cold = true;
    opt.cpu_expert_ms = 1e9;  // a CPU expert never beats a copy
  } else {
    fail("--cold-experts {}: expected auto, cpu, gpu or read", mode);
  }
}

// What every CUDA engine the factory opens (one GPU, or each stage of a split) takes from the command line: the
// served name, --prefill-pass, --kv-q8, --cold-experts, --prefetch-experts and --cache-policy.
inline void apply_gpu_options(const EngineOptions& o, CudaEngineOptions& c) {
  c.served_name = o.served_name;
  c.prefill_chunk = o.prefill_chunk;
  c.kv_q8 = o.kv_q8;
  apply_cold_experts(o.cold_experts, c);
  if (o.prefetch_experts >= 0) c.prefetch_experts = o.prefetch_experts;
  c.cache_victim_window = o.cache_policy == "lru" ? 1 : CudaEngineOptions::kLfuVictimWindow;
}

// A planned home as the engine places it: pinned in VRAM, cached and fetched behind the LRU slots, cold on the CPU.
inline ExpertPlacement engine_placement(ExpertHome h) {
  return h == ExpertHome::Pinned ? ExpertPlacement::Vram
         : h == ExpertHome::Cpu  ? ExpertPlacement::Cpu
                                 : ExpertPlacement::Cache;
}

inline void apply_placement_plan(const PlacementPlan& plan, CudaEngineOptions& opt) {
  opt.placement.assign(plan.layers.size(), {});
  opt.cache_slots_per_layer.assign(plan.layers.size(), 0);
  opt.vram_budget_gib = double(plan.vram_budget) / double(kGiB);
  if (plan.context > 0) opt.max_ctx = plan.context;
  for (size_t l = 0; l < plan.layers.size(); ++l) {
    const LayerPlacement& lp = plan.layers[l];
    auto& out = opt.placement[l];
    for (ExpertHome h : lp.home) out.push_back(engine_placement(h));
    opt.cache_slots_per_layer[l] = int(std::max<int64_t>(1, lp.slots - lp.pinned));
  }
}

}  // namespace moesrv
