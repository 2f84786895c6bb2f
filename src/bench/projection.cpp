#include "bench/projection.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "backend/usage_stats.h"
#include "util/error.h"

namespace moesrv::bench {

using json = nlohmann::json;

namespace {

// The config of the projected model: `full_layers` layers, the first `dense` of them dense.
json full_config(json cfg, const BenchOptions& opt) {
  if (opt.full_layers > 0) {
    cfg["num_hidden_layers"] = opt.full_layers;
    cfg.erase("mlp_layer_types");
    cfg.erase("indexer_types");
    cfg.erase("layer_types");
  }
  if (opt.full_dense_layers >= 0) {
    cfg.erase("mlp_layer_types");
    cfg["first_k_dense_replace"] = opt.full_dense_layers;
  }
  return cfg;
}

// Skewed synthetic routing (Zipf exponent s, a different random hot set per layer) to model real traffic.
UsageStats zipf_usage(const ModelSpec& c, double s, uint64_t seed) {
  UsageStats u(c.num_layers, c.n_routed_experts, c.experts_per_token);
  const int64_t E = c.n_routed_experts;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    std::vector<int32_t> perm(static_cast<size_t>(E));
    for (int32_t e = 0; e < E; ++e) perm[size_t(e)] = e;
    uint64_t r = seed ^ (uint64_t(l) * 0x9e3779b97f4a7c15ull);
    for (int64_t i = E - 1; i > 0; --i) {
      r = r * 6364136223846793005ull + 1442695040888963407ull;
      std::swap(perm[size_t(i)], perm[size_t((r >> 33) % uint64_t(i + 1))]);
    }
    // Expected counts over 10^4 tokens, scaled so each token selects k experts.
    double norm = 0;
    for (int64_t i = 0; i < E; ++i) norm += std::pow(double(i + 1), -s);
    std::vector<int32_t> ids;
    for (int64_t i = 0; i < E; ++i) {
      int64_t n = int64_t(std::llround(1e4 * double(c.experts_per_token) * std::pow(double(i + 1), -s) / norm));
      ids.assign(size_t(std::min<int64_t>(n, 10000)), perm[size_t(i)]);
      if (!ids.empty()) u.record(l, ids);
    }
  }
  // record() counted one "token" per call; reset token totals to the 10^4 modelled tokens.
  json j = u.to_json();
  for (auto& L : j["layers"]) L["tokens"] = 1e4;
  return UsageStats::from_json(j);
}

double floor_seconds(const StepEstimate& e, const CostModel& m) {
  return std::max(
      {e.hbm_bytes / (m.hbm_gbps * 1e9), e.pcie_bytes / (m.pcie_gbps * 1e9), e.host_bytes / (m.host_mem_gbps * 1e9)});
}

Projection project(const std::string& name, const ModelSpec& c, const ModelFootprint& fp, PlacementRequest req,
                   int64_t context, int64_t chunk, const UsageStats* usage) {
  Projection p;
  p.placement = name;
  p.context = context;
  req.context = context;
  req.step_tokens = 1;
  p.decode_plan = plan_placement(c, fp, req, usage);
  StepEstimate d = estimate_step(c, fp, p.decode_plan, req.cost, 1, context, usage);
  p.decode_s = d.seconds;
  p.floor_s = floor_seconds(d, req.cost);
  req.step_tokens = chunk;
  PlacementPlan prefill = plan_placement(c, fp, req, usage);
  for (int64_t done = 0; done < context; done += chunk) {
    int64_t n = std::min(chunk, context - done);
    p.ttft_s += estimate_step(c, fp, prefill, req.cost, n, done + n, usage).seconds;
  }
  double hits = 0;
  int64_t moe = 0;
  for (const auto& L : p.decode_plan.layers)
    if (!L.home.empty()) hits += L.hit_rate, ++moe;
  p.hit_rate = moe ? hits / double(moe) : 1;
  return p;
}

}  // namespace

int64_t first_moe_layer(const ModelSpec& c) {
  int64_t l = 0;
  while (l < c.num_layers && !c.layer_is_moe[size_t(l)]) ++l;
  return l;
}

ProjectionSet project_full_model(const BenchOptions& opt, const json& config, const ModelSpec& c,
                                 const ModelFootprint& fp, const Calibration& cal) {
  ProjectionSet ps;
  ps.model = ModelSpec::from_json(full_config(config, opt));
  const ModelSpec& fc = ps.model;
  const int64_t moe_layer = first_moe_layer(c);
  double loaded_expert_bits =
      moe_layer < c.num_layers && fp.expert_params[size_t(moe_layer)] > 0
          ? 8.0 * double(fp.expert_bytes[size_t(moe_layer)]) / fp.expert_params[size_t(moe_layer)]
          : 16;
  ps.expert_bits = opt.expert_bits > 0 ? opt.expert_bits : loaded_expert_bits;
  ps.dense_bits = opt.dense_bits > 0 ? opt.dense_bits : 16;
  ps.footprint = footprint_from_config(fc, ps.expert_bits, ps.dense_bits);
  const ModelFootprint& ffp = ps.footprint;
  std::optional<UsageStats> usage;
  ps.usage_source = "uniform routing";
  if (!opt.usage_path.empty()) {
    usage = UsageStats::load(opt.usage_path, fc.num_layers, fc.n_routed_experts);
    if (!usage)
      fail("{}: no usable expert usage for {} layers x {} experts", opt.usage_path, fc.num_layers, fc.n_routed_experts);
    ps.usage_source = opt.usage_path;
  } else if (opt.usage_zipf > 0) {
    usage = zipf_usage(fc, opt.usage_zipf, opt.synthetic.seed);
    ps.usage_source = fmt::format("synthetic Zipf s={}", opt.usage_zipf);
  } else if (!opt.model_dir.empty()) {
    usage = UsageStats::load(UsageStats::default_path(opt.model_dir), fc.num_layers, fc.n_routed_experts);
    if (usage) ps.usage_source = UsageStats::default_path(opt.model_dir);
  }
  const UsageStats* up = usage ? &*usage : nullptr;
  PlacementRequest base;
  base.workspace_bytes = uint64_t(opt.workspace_gib * double(kGiB));
  base.kv_elem_bytes = base.index_elem_bytes = opt.kv_elem_bytes;
  base.cost.hbm_gbps = opt.hbm_gbps;
  base.cost.pcie_gbps = opt.pcie_gbps;
  base.cost.gpu_tflops = opt.gpu_tflops;
  base.cost.host_mem_gbps = opt.host_mem_gbps > 0 ? opt.host_mem_gbps : cal.expert_gemv_gbps;
  base.cost.cpu_gflops = opt.cpu_gflops > 0 ? opt.cpu_gflops : cal.cpu_gflops;
  base.slot_policy = up ? SlotPolicy::Entropy : SlotPolicy::Equal;
  ps.cost = base.cost;
  for (int64_t ctx : opt.model_contexts) {
    PlacementRequest all = base, hybrid = base, cpu_experts = base;
    all.vram_budget = uint64_t(1) << 62;
    hybrid.vram_budget = uint64_t(opt.vram_budget_gib * double(kGiB));
    cpu_experts.vram_budget = ffp.dense_total() + kv_cache_bytes(fc, ctx, opt.kv_elem_bytes, opt.kv_elem_bytes) +
                              base.workspace_bytes;  // no expert slots
    ps.rows.push_back(project("all-in-VRAM", fc, ffp, all, ctx, opt.prefill_chunk, up));
    ps.rows.push_back(
        project(fmt::format("hybrid {:g} GiB", opt.vram_budget_gib), fc, ffp, hybrid, ctx, opt.prefill_chunk, up));
    ps.rows.push_back(project("baseline: GPU dense, CPU experts", fc, ffp, cpu_experts, ctx, opt.prefill_chunk, up));
  }
  return ps;
}

}  // namespace moesrv::bench
