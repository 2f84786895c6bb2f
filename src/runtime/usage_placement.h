// Expert usage persisted next to the model (<model>/.moesrv/expert_usage.json) and the placement plan that
// pins its hottest experts at the next start.
#pragma once
#include <optional>
#include <string>

#include "backend/engine.h"
#include "backend/usage_stats.h"
#include "model/config.h"
#include "runtime/placement.h"

namespace moesrv {

// The stored statistics for this model's shape, or nullopt (absent, unreadable or from another shape).
std::optional<UsageStats> load_model_usage(const std::string& model_dir, const ModelSpec& c);

// Folds a run's recording into the stored file: old counts are halved, so recent use dominates.
// Does nothing when the run routed no tokens.
void save_model_usage(const std::string& model_dir, const ModelSpec& c, const UsageStats& run,
                      const std::string& model_id = "");

// Saves what `engine` recorded (if it records usage) for the model in `model_dir`; warns, never throws.
void save_engine_usage(const std::string& model_dir, const Engine& engine);

// Plan for a VRAM budget, pinning from usage. Sizes: `footprint` when given (footprint_from_package: what the
// CUDA engine uploads, EXL3 as stored), else the config's shapes at bf16.
// lru_slots: PlacementRequest::lru_slots.
PlacementPlan plan_with_usage(const ModelSpec& c, double vram_budget_gib, int64_t context,
                              const std::optional<UsageStats>& usage, double workspace_gib = 1.0,
                              const ModelFootprint* footprint = nullptr, int64_t lru_slots = -1);

}  // namespace moesrv
