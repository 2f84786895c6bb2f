// Reporting for `bench`: the JSON and markdown of the host calibration, the CPU engine's measurements extrapolated
// to the full layer count (next to the CPU decode floor) and the projected placements.
#pragma once
#include <string>
#include <vector>

#include "bench/bench.h"
#include "bench/calibration.h"
#include "bench/measure.h"
#include "bench/projection.h"

namespace moesrv::bench {

struct BenchFacts {
  const std::string& model_name;
  double load_s;
  const ModelSpec& loaded;          // the model the engine ran
  const ModelFootprint& footprint;  // its loaded weights
  const Calibration& cal;
  const std::vector<Measured>& measured;  // CPU engine, one per BenchOptions::contexts (empty: not measured)
  const ProjectionSet& projection;
};

BenchResult report_bench(const BenchOptions& opt, const BenchFacts& f);

}  // namespace moesrv::bench
