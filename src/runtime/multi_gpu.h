// --gpus N: plan a layer split of a model over N GPUs and build the pipeline that runs it.
#pragma once
#include <memory>
#include <string>

#include "backend/engine.h"
#include "runtime/engine_factory.h"
#include "runtime/multi_gpu_plan.h"

namespace moesrv {

struct ModelSplitRequest {
  std::vector<uint64_t> budgets;  // bytes per GPU
  int64_t context = 8192;         // KV cache tokens per sequence, per GPU for its layers
  int kv_elem_bytes = 2;
  uint64_t workspace_bytes = kGiB;
};

// Tries every routed expert resident in VRAM first; when that cannot fit, splits dense weights + KV only (each
// GPU's engine then places experts in its leftover VRAM or host RAM). `experts_resident` says which one held.
MultiGpuPlan plan_model_split(const ModelSpec& c, const ModelFootprint& fp, const ModelSplitRequest& req,
                              bool* experts_resident = nullptr);

// The engine for `--gpus N` (o.gpus >= 1): a PipelineEngine of one stage per planned GPU.
// --backend cpu runs the planned stages on the CPU (the same pipeline path, for testing without GPUs).
// CUDA: N = 1 is the plain CUDA engine; N > 1 is one CUDA stage per GPU (device g, budget g, the planned layers;
// runtime/pipeline_cuda_stage.h, docs/multi-gpu.md).
std::unique_ptr<Engine> open_multi_gpu_engine(const std::string& model_dir, const EngineOptions& o);

}  // namespace moesrv
