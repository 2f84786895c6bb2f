#include "runtime/usage_placement.h"

#include <fmt/format.h>

namespace moesrv {

std::optional<UsageStats> load_model_usage(const std::string& model_dir, const ModelSpec& c) {
  if (c.n_routed_experts <= 0) return std::nullopt;
  return UsageStats::load(UsageStats::default_path(model_dir), c.num_layers, c.n_routed_experts);
}

namespace {

// save_model_usage for a model of `layers` x `experts` routed experts (0 experts: nothing stored).
void merge_and_save(const std::string& model_dir, int64_t layers, int64_t experts, const UsageStats& run,
                    const std::string& model_id) {
  bool any = false;
  for (int64_t l = 0; l < run.layers() && !any; ++l) any = !run.empty(l);
  if (!any) return;
  std::optional<UsageStats> stored;
  if (experts > 0) stored = UsageStats::load(UsageStats::default_path(model_dir), layers, experts);
  UsageStats merged = stored.value_or(UsageStats(run.layers(), run.experts(), run.experts_per_token()));
  merged.decay(0.5);
  merged.merge(run);
  merged.save(UsageStats::default_path(model_dir), model_id);
}

}  // namespace

void save_model_usage(const std::string& model_dir, const ModelSpec& c, const UsageStats& run,
                      const std::string& model_id) {
  merge_and_save(model_dir, c.num_layers, c.n_routed_experts, run, model_id);
}

void save_engine_usage(const std::string& model_dir, const Engine& engine) {
  const UsageStats* run = engine.expert_usage();
  if (!run) return;
  try {
    // The engine counted [layers][routed experts] of this model: the shape of the stored file, no config needed.
    merge_and_save(model_dir, run->layers(), run->experts(), *run, engine.name());
  } catch (const std::exception& e) {  // a read-only model folder must not fail the run
    fmt::print(stderr, "warning: expert usage statistics not saved: {}\n", e.what());
  }
}

}  // namespace moesrv
