// `bench` end to end: loads the model (synthetic or a package) into the CPU engine, calibrates this host, measures
// the engine, projects the full model and reports; CUDA builds then measure the GPU engine on the same layers.
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "backend/cpu/cpu_engine.h"
#include "bench/bench.h"
#include "bench/calibration.h"
#include "bench/common.h"
#include "bench/measure.h"
#include "bench/projection.h"
#include "bench/report.h"

namespace moesrv {

void BenchResult::write(const std::string& json_path, const std::string& markdown_path) const {
  std::fputs(markdown.c_str(), stdout);
  auto save = [](const std::string& path, const std::string& text) {
    if (path.empty()) return;
    std::ofstream f(path);
    if (!(f << text)) fail("bench: cannot write {}", path);
  };
  save(json_path, json.dump(2) + "\n");
  save(markdown_path, markdown);
}

BenchResult run_bench(const BenchOptions& opt) {
  using namespace bench;
  auto t_load = Clock::now();
  std::shared_ptr<ModelPackage> pkg;
  std::string model_name;
  if (opt.model_dir.empty()) {
    nlohmann::json cfg = opt.synthetic_config.is_null() ? glm5_config(1) : opt.synthetic_config;
    pkg = make_synthetic_model(cfg, opt.synthetic);
    model_name = fmt::format("synthetic {} ({} layer(s), hidden {})", cfg.value("model_type", "?"),
                             cfg.value("num_hidden_layers", 0), cfg.value("hidden_size", 0));
  } else {
    pkg = ModelPackage::open(opt.model_dir);
    model_name = std::filesystem::path(opt.model_dir).filename().string();
  }
  // The CPU engine always runs (calibration, baseline); CUDA builds add measure_gpu() below.
  CpuEngine engine(pkg, "bench");
  const double load_s = since(t_load);
  const ModelSpec& c = engine.config();
  const ModelFootprint fp = footprint_from_weights(engine.weights());
  const Calibration cal = calibrate(engine.weights(), fp);

  // Measured: the engine end to end (the report extrapolates per-layer costs to the full layer count).
  std::vector<Measured> measured;
  if (opt.measure_engine)
    for (int64_t ctx : opt.contexts) measured.push_back(measure_engine(engine, ctx, opt.decode_tokens));
  // Projected: the full model under three placements, cost model calibrated by this run.
  const ProjectionSet ps = project_full_model(opt, pkg->config(), c, fp, cal);

  BenchResult r = report_bench(opt, {model_name, load_s, c, fp, cal, measured, ps});
  if (opt.measure_engine && !ps.rows.empty()) measure_gpu(opt, pkg, c, ps.rows[1].decode_plan, fp, r);
  return r;
}

}  // namespace moesrv
