#include "runtime/multi_gpu.h"

#include <algorithm>

#include "backend/cpu/cpu_engine.h"
#include "backend/cuda/cuda_engine.h"
#include "format/package.h"
#include "runtime/cuda_placement.h"
#include "runtime/pipeline_cpu_stage.h"
#include "runtime/pipeline_cuda_stage.h"
#include "runtime/placement.h"
#include "util/error.h"

namespace moesrv {

MultiGpuPlan plan_model_split(const ModelSpec& c, const ModelFootprint& fp, const ModelSplitRequest& req,
                              bool* experts_resident) {
  auto with = [&](int64_t experts) {
    std::vector<int64_t> resident(size_t(c.num_layers), 0);
    for (int64_t l = 0; l < c.num_layers; ++l)
      if (size_t(l) < fp.expert_bytes.size() && fp.expert_bytes[size_t(l)] > 0) resident[size_t(l)] = experts;
    LayerSplitCosts costs = layer_split_costs(c, fp, req.context, resident, req.kv_elem_bytes);
    costs.workspace_bytes = req.workspace_bytes;
    return plan_layer_split(costs, req.budgets);
  };
  MultiGpuPlan all = with(c.n_routed_experts);
  if (experts_resident) *experts_resident = all.fits;
  if (all.fits || c.n_routed_experts == 0) return all;
  return with(0);
}

std::unique_ptr<Engine> open_multi_gpu_engine(const std::string& model_dir, const EngineOptions& o) {
  if (o.gpus < 1) fail("--gpus {}: expected at least 1", o.gpus);
  const bool cpu = o.backend == "cpu";
  if (!cpu && !cuda_available()) fail("--gpus {}: this build has no CUDA backend or no CUDA device is visible", o.gpus);
  if (!cpu && o.gpus == 1) {
    std::shared_ptr<ModelPackage> pkg = ModelPackage::open(model_dir);
    return open_single_gpu_engine(pkg, std::make_shared<const ModelSpec>(ModelSpec::from_json(pkg->config())), o);
  }
  std::vector<double> gib = o.vram_budgets_gib;
  if (gib.empty()) gib.push_back(o.vram_budget_gib);
  if (gib.size() == 1 && gib[0] <= 0) fail("--gpus {}: give --vram-budget (GiB, one for all or one per GPU)", o.gpus);
  // The package is opened once; the split is planned from its manifest (the sizes the CUDA engines upload: EXL3 as
  // stored, the rest bf16), before any weight is loaded.
  std::shared_ptr<ModelPackage> pkg = ModelPackage::open(model_dir);
  auto spec = std::make_shared<const ModelSpec>(ModelSpec::from_json(pkg->config()));
  const ModelSpec& c = *spec;
  ModelSplitRequest req;
  req.budgets = vram_budgets_for(gib, o.gpus);
  req.context = o.max_ctx > 0 ? o.max_ctx : std::min<int64_t>(c.max_position, 32768);
  req.kv_elem_bytes = o.kv_q8 ? 1 : 2;
  auto fp = std::make_shared<const ModelFootprint>(footprint_from_package(c, *pkg));
  MultiGpuPlan plan = plan_model_split(c, *fp, req);
  if (!plan.fits) fail("--gpus {}: {}", o.gpus, plan.error);
  std::vector<int64_t> splits;
  for (size_t g = 1; g < plan.gpus.size(); ++g) splits.push_back(plan.gpus[g].layer_begin);
  if (cpu) return make_cpu_pipeline(std::make_shared<CpuEngine>(pkg, o.served_name, spec.get()), splits);
  // One CUDA stage per planned GPU: device g, that GPU's budget and layers; the runtime planner places each stage's
  // experts in the VRAM its budget leaves (LRU slots, pinning, the cold split), as on one GPU.
  if (cuda_device_count() < int(plan.gpus.size()))
    fail("--gpus {}: {} CUDA devices are visible; planned split:\n{}", o.gpus, cuda_device_count(), plan.summary());
  std::vector<CudaEngineOptions> stages(plan.gpus.size());
  for (size_t g = 0; g < stages.size(); ++g) {
    CudaEngineOptions& s = stages[g];
    apply_gpu_options(o, s);
    s.spec = spec;
    s.device = int(g);
    s.vram_budget_gib = double(req.budgets[g]) / double(kGiB);
    s.max_ctx = req.context;
    const int64_t end = g + 1 < stages.size() ? splits[g] : c.num_layers;
    s.plan_placement = runtime_planner(spec, *pkg, req.context, s.zero_copy_cold, true, g ? splits[g - 1] : 0, end, fp);
  }
  return make_cuda_pipeline(pkg, stages, splits);
}

}  // namespace moesrv
