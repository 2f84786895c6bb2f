// Expert usage persisted next to the model (<model>/.moesrv/expert_usage.json), which the runtime planner
// (runtime_planner in engine_factory.h) pins the hottest experts from at the next start.
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

}  // namespace moesrv
