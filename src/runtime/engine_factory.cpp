#include "runtime/engine_factory.h"

#include <fmt/format.h>

#include <algorithm>

#include "backend/cpu/cpu_engine.h"
#include "backend/cuda/cuda_engine.h"
#include "runtime/cuda_placement.h"
#include "runtime/multi_gpu.h"
#include "runtime/usage_placement.h"
#include "util/error.h"

namespace moesrv {

std::unique_ptr<Engine> open_engine(const std::string& model_dir, const EngineOptions& o) {
  if (o.backend != "auto" && o.backend != "cpu" && o.backend != "cuda")
    fail("--backend {}: expected auto, cpu or cuda", o.backend);
  if (o.gpus > 0) return open_multi_gpu_engine(model_dir, o);
  if (o.vram_budgets_gib.size() > 1) fail("--vram-budget: {} values need --gpus {}", o.vram_budgets_gib.size(), o.vram_budgets_gib.size());
  bool gpu = cuda_available();
  if (o.backend == "cuda" && !gpu)
    fail("--backend cuda: this build has no CUDA backend or no CUDA device is visible");
  std::shared_ptr<ModelPackage> pkg = ModelPackage::open(model_dir);
  if (o.backend == "cpu" || !gpu) return std::make_unique<CpuEngine>(pkg, o.served_name);
  // The CUDA engine runs every layer kind: MLA/GQA (with the gated output), KDA and Gated DeltaNet, plain or mHC
  // residuals, the DSA and k-pool indexers, sigmoid-group and softmax routers, gated shared experts. Its delta-rule
  // kernel takes key heads of 32, 64, 96, 128, 192 or 256 values; a linear-attention model with others runs on the CPU.
  auto spec = std::make_shared<const ModelSpec>(ModelSpec::from_json(pkg->config()));
  const bool cuda_ready = !spec->has_recurrent_layers() || cuda_delta_rule_supports(spec->linear.dk);
  if (!cuda_ready) {
    if (o.backend == "cuda")
      fail("--backend cuda: {} is not supported by the CUDA engine yet (use --backend cpu)", spec->model_type);
    return std::make_unique<CpuEngine>(pkg, o.served_name, spec.get());
  }
  return open_single_gpu_engine(pkg, spec, o);
}

PlanPlacement runtime_planner(std::shared_ptr<const ModelSpec> spec, const ModelPackage& pkg, int64_t ctx,
                              bool zero_copy_cold, bool given_budget, int64_t layer_begin, int64_t layer_end,
                              std::shared_ptr<const ModelFootprint> fp) {
  // Sized as the engine uploads them (EXL3 as stored, the rest bf16); pinning from persisted usage.
  if (!fp) fp = std::make_shared<const ModelFootprint>(footprint_from_package(*spec, pkg));
  auto usage = std::make_shared<const std::optional<UsageStats>>(load_model_usage(pkg.dir(), *spec));
  // Decode that reads cold experts in place keeps only the LRU slots prefill streams through; the rest is pinned.
  const int64_t lru_slots = zero_copy_cold ? kPrefillStreamSlots : -1;
  return [spec, ctx, fp, usage, lru_slots, given_budget, layer_begin, layer_end](
             size_t engine_bytes, size_t budget_bytes, CudaEngineOptions& opt) {
    PlacementRequest req;
    req.lru_slots = lru_slots;
    req.vram_budget = budget_bytes;
    req.context = ctx;
    req.layer_begin = layer_begin, req.layer_end = layer_end;
    const std::optional<UsageStats>& u = *usage;
    // Its workspace is what the engine holds beyond the dense weights and caches the plan counts (the activations
    // of a prefill pass are GiBs at real width).
    req.workspace_bytes = 0;
    const PlacementPlan first = plan_placement(*spec, *fp, req, u ? &*u : nullptr);
    req.workspace_bytes =
        engine_bytes > first.vram_dense + first.vram_kv ? engine_bytes - first.vram_dense - first.vram_kv : 0;
    PlacementPlan plan = plan_placement(*spec, *fp, req, u ? &*u : nullptr);
    if (!plan.fits) {
      const double gib = double(budget_bytes) / double(kGiB);
      if (given_budget) fail("--vram-budget {} GiB: {}", gib, plan.note);
      fail("{:.2f} GiB of free GPU memory: {} (a smaller --max-ctx or --prefill-pass needs less)", gib, plan.note);
    }
    apply_placement_plan(plan, opt);
    if (!given_budget) opt.vram_budget_gib = 0;  // (the engine's budget stays the device's free memory)
  };
}

std::unique_ptr<Engine> open_single_gpu_engine(std::shared_ptr<ModelPackage> pkg, std::shared_ptr<const ModelSpec> spec,
                                               const EngineOptions& o) {
#ifdef MOESRV_HAS_CUDA
  CudaEngineOptions c;
  apply_gpu_options(o, c);
  c.vram_budget_gib = o.vram_budgets_gib.empty() ? o.vram_budget_gib : o.vram_budgets_gib[0];
  c.max_ctx = o.max_ctx;
  c.prefill_group = o.prefill_group > 0 ? o.prefill_group : EngineOptions::default_prefill_group(c.vram_budget_gib);
  c.mtp = o.mtp;
  c.spec = spec;
  // The runtime planner decides expert homes (LRU slots, pinning from persisted usage, PCIe/CPU split of cold
  // experts) under the budget, or in the device's free memory without one (a 24 GB card that cannot hold every
  // expert gets the same plan as --vram-budget 24). It runs inside the engine once the engine's own memory is
  // allocated.
  const int64_t ctx = c.max_ctx > 0 ? c.max_ctx : std::min<int64_t>(spec->max_position, 32768);
  c.plan_placement = runtime_planner(spec, *pkg, ctx, c.zero_copy_cold, c.vram_budget_gib > 0);
  return make_cuda_engine(pkg, c);
#else
  (void)spec;
  fail("{}: this build has no CUDA backend", pkg->dir());
#endif
}

void add_engine_options(CLI::App* cmd, EngineOptions& o, bool with_ctx) {
  cmd->add_option("--backend", o.backend, "auto | cpu | cuda")->capture_default_str();
  cmd->add_option("--vram-budget", o.vram_budgets_gib, "GiB of GPU memory to use (0: all free memory); with --gpus: one "
                  "value for all or one per GPU, e.g. 22,22")->delimiter(',')->allow_extra_args(false);
  cmd->add_option("--gpus", o.gpus, "split layers over N GPUs (pipeline; see docs/multi-gpu.md)");
  cmd->add_flag("--kv-q8", o.kv_q8, "GPU attention cache as int8 with per-token scales");
  cmd->add_option("--cold-experts", o.cold_experts,
                  "experts not in VRAM: auto (split each step between PCIe and the CPU from measured rates), cpu "
                  "(compute on the CPU), gpu (stream over PCIe, run on the GPU), read (as gpu, but decode reads "
                  "EXL3 experts in place over PCIe, one CUDA graph per step; docs/perf-cuda.md)")
      ->check(CLI::IsMember({"auto", "cpu", "gpu", "read"}))
      ->capture_default_str();
  cmd->add_option("--prefetch-experts", o.prefetch_experts,
                  "GPU decode under --vram-budget: each MoE layer routes its input through the next layer's router "
                  "and starts copying up to N of those experts over PCIe while it computes (0: off; -1: the engine's "
                  "default)")
      ->check(CLI::Range(-1, 64))
      ->capture_default_str();
  cmd->add_option("--cache-policy", o.cache_policy,
                  "GPU decode under --vram-budget, the experts' cache slots: lfu (evict the least routed of the 16 "
                  "least recently used: +12% decode at 22 GiB in the bench's skewed routing; docs/perf-cuda.md) or "
                  "lru (the least recently used)")
      ->check(CLI::IsMember({"lru", "lfu"}))
      ->capture_default_str();
  if (with_ctx) cmd->add_option("--max-ctx", o.max_ctx, "GPU KV cache tokens per sequence (0: default)");
  cmd->add_option("--prefill-pass", o.prefill_chunk,
                  "GPU: prompt tokens per prefill pass. Under --vram-budget each pass moves the cold experts over "
                  "PCIe once, so larger passes prefill faster but hold more activations in VRAM (GLM-5.3-Flash: "
                  "~0.7 MB per token; docs/perf.md)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20))
      ->capture_default_str();
  cmd->add_option("--prefill-group", o.prefill_group,
                  "GPU: prefill passes run layer by layer in groups of this many, so the MoE streams (under "
                  "--vram-budget) or dequantizes each expert once per group instead of once per pass; costs ~105 KB "
                  "of VRAM per token of a group (GLM-5.3-Flash; docs/perf-cuda.md); 0: 4 under a --vram-budget "
                  "of 20 GiB or more (measured best at 22 GiB), else 1")
      ->check(CLI::Range(int64_t(0), int64_t(64)))
      ->capture_default_str();
}

}  // namespace moesrv
