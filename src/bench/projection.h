// Projection for `bench`: the full-size model (BenchOptions: layer count, storage bits, KV element size) under
// three expert placements (all in VRAM, hybrid under the VRAM budget, GPU dense + CPU experts), timed by the cost
// model whose CPU rates come from this host's calibration, each next to its physical floor.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "bench/calibration.h"
#include "model/config.h"
#include "runtime/placement.h"

namespace moesrv::bench {

struct Projection {
  std::string placement;
  int64_t context = 0;
  PlacementPlan decode_plan;
  double ttft_s = 0, decode_s = 0, floor_s = 0, hit_rate = 0;
};

// The projected model and what its rows assumed.
struct ProjectionSet {
  ModelSpec model;
  ModelFootprint footprint;
  double expert_bits = 16, dense_bits = 16;
  std::string usage_source;  // where the routing skew came from ("uniform routing", a file, Zipf)
  CostModel cost;
  // Per model context, three rows: all-in-VRAM, hybrid, baseline (GPU dense, CPU experts).
  std::vector<Projection> rows;
};

// The first MoE layer of `c` (num_layers when none).
int64_t first_moe_layer(const ModelSpec& c);

// Projects the model whose config is `config` (loaded as `loaded`, footprint `fp`) to opt's full size.
ProjectionSet project_full_model(const BenchOptions& opt, const nlohmann::json& config, const ModelSpec& loaded,
                                 const ModelFootprint& fp, const Calibration& cal);

}  // namespace moesrv::bench
