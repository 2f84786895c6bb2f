// Opens a model with the best available backend: CUDA (GPU, hybrid expert placement) when built with it and a
// device is visible, else the CPU engine. Shared by every CLI command that runs a model.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/engine.h"
#include "format/package.h"
#include "model/spec.h"
#include "runtime/placement.h"

namespace moesrv {

struct EngineOptions {
  std::string backend = "auto";  // auto | cpu | cuda
  std::string served_name;
  double vram_budget_gib = 0;    // CUDA: act as a GPU with this much memory (0: the device's free memory)
  std::vector<double> vram_budgets_gib;  // --vram-budget 22,22: per GPU (one value: all); overrides the above
  int gpus = 0;                  // --gpus N: split layers over N GPUs (0: one GPU, no pipeline)
  int64_t max_ctx = 0;           // CUDA: KV cache tokens per sequence (0: engine default)
  int64_t prefill_chunk = 8192;  // CUDA: tokens per prefill pass (--prefill-pass)
  // CUDA: passes per prefill group (--prefill-group); 0: kBudgetPrefillGroup under a VRAM budget of at least
  // kGroupMinBudgetGib (the group's ~2.5 GiB of activations must not crowd out a small card's experts), else 1.
  int64_t prefill_group = 0;
  static constexpr int64_t kBudgetPrefillGroup = 4;  // 22 GiB, 131K, H100: TTFT 74 -> 48 s (docs/perf-cuda.md)
  static constexpr double kGroupMinBudgetGib = 20;
  static int64_t default_prefill_group(double vram_budget_gib) {
    return vram_budget_gib >= kGroupMinBudgetGib ? kBudgetPrefillGroup : 1;
  }
  bool kv_q8 = false;
  std::string cold_experts = "auto";  // CUDA, cold (non-VRAM) experts: auto | cpu | gpu | read (apply_cold_experts)
  bool mtp = false;  // CUDA: load the checkpoint's MTP block (speculative decoding); the CPU engine always maps it
  int prefetch_experts = -1;  // CUDA: --prefetch-experts (CudaEngineOptions::prefetch_experts); -1: its default
  std::string cache_policy = "lfu";  // CUDA: --cache-policy lfu | lru (CudaEngineOptions::cache_victim_window 16 | 1)
};

// Opens the package once and parses its config once; the engine reuses both.
std::unique_ptr<Engine> open_engine(const std::string& model_dir, const EngineOptions& options);
// The CUDA engine on one GPU (throws in CPU builds) for an opened package and its parsed config; expert homes come
// from the runtime planner (runtime_planner).
std::unique_ptr<Engine> open_single_gpu_engine(std::shared_ptr<ModelPackage> pkg, std::shared_ptr<const ModelSpec> spec,
                                               const EngineOptions& options);
struct CudaEngineOptions;
using PlanPlacement = std::function<void(size_t engine_bytes, size_t budget_bytes, CudaEngineOptions& options)>;
// The runtime planner (runtime/placement.h) as a CUDA engine's plan_placement, for layers [layer_begin, layer_end)
// (a pipeline stage's; -1: to the last) at `ctx` tokens: expert homes in the engine's budget (`given_budget`: a
// --vram-budget, else the device's free memory) after the engine's own memory, pinning from persisted usage. `fp`:
// the package's footprint_from_package when the caller has it (else read here).
PlanPlacement runtime_planner(std::shared_ptr<const ModelSpec> spec, const ModelPackage& pkg, int64_t ctx,
                              bool zero_copy_cold, bool given_budget, int64_t layer_begin = 0, int64_t layer_end = -1,
                              std::shared_ptr<const ModelFootprint> fp = nullptr);
// Adds --backend, --vram-budget, --gpus, --kv-q8, --cold-experts, --prefetch-experts, --cache-policy, --prefill-pass
// and --prefill-group to a command (and --max-ctx when `with_ctx`).
void add_engine_options(CLI::App* cmd, EngineOptions& options, bool with_ctx = true);

}  // namespace moesrv
