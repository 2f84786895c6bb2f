// Placement: budgets respected, slot policies, pinning by usage, the CPU/PCIe split of cold experts; the device
// engine's placement arithmetic (backend/expert_plan.h): slot counts, the in-order fill, fitting a given plan.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "backend/cpu/cpu_engine.h"
#include "backend/cpu/linear.h"
#include "backend/expert_plan.h"
#include "backend/usage_stats.h"
#include "format/package.h"
#include "model/synthetic_model.h"
#include "model/weights.h"
#include "runtime/cuda_placement.h"
#include "runtime/engine_factory.h"
#include "runtime/placement.h"

namespace moesrv {
namespace {

ModelSpec glm5(int64_t layers, int64_t dense_layers = 3) {
  auto j = glm5_config(layers);
  j["first_k_dense_replace"] = dense_layers;
  return ModelSpec::from_json(j);
}

int64_t sum_homes(const LayerPlacement& L) {
  return L.count(ExpertHome::Pinned) + L.count(ExpertHome::Cached) + L.count(ExpertHome::Fetch) + L.count(ExpertHome::Cpu);
}

TEST(Placement, KvCacheBytesMlaPlusIndexer) {
  ModelSpec c = glm5(2, 0);
  // (512 + 64) * 2 bytes latent + rope key, 128 * 2 bytes indexer key, per token per layer.
  EXPECT_EQ(kv_cache_bytes(c, 1000), uint64_t(2 * 1000 * (576 * 2 + 128 * 2)));
  EXPECT_EQ(kv_cache_bytes(c, 1000, 2, 1), uint64_t(2 * 1000 * (576 * 2 + 128)));
}

TEST(Placement, FootprintMatchesLoadedWeights) {
  auto cfg = tiny_moe_config(2);
  auto w = ModelWeights::load(make_synthetic_model(cfg), load_linear);
  ModelFootprint a = footprint_from_config(w->config), b = footprint_from_weights(*w);
  ASSERT_EQ(a.expert_bytes.size(), 2u);
  for (size_t l = 0; l < 2; ++l) {
    EXPECT_EQ(a.expert_bytes[l], b.expert_bytes[l]);
    EXPECT_DOUBLE_EQ(a.expert_params[l], b.expert_params[l]);
    EXPECT_DOUBLE_EQ(a.dense_params[l], b.dense_params[l]);
    // Norms and the router are fp32 once loaded, bf16 in the config estimate.
    EXPECT_NEAR(double(a.dense_bytes[l]), double(b.dense_bytes[l]), 0.1 * double(b.dense_bytes[l]));
  }
  EXPECT_NEAR(double(a.head_bytes), double(b.head_bytes), 0.01 * double(b.head_bytes));
}

TEST(Placement, HybridRespectsBudgetWithEqualSlots) {
  ModelSpec c = glm5(78);
  ModelFootprint fp = footprint_from_config(c, /*expert_bits=*/2.0, /*dense_bits=*/4.0);
  PlacementRequest req;
  req.vram_budget = 22 * kGiB;
  req.context = 32768;
  PlacementPlan plan = plan_placement(c, fp, req);
  ASSERT_TRUE(plan.fits) << plan.note;
  EXPECT_FALSE(plan.all_experts_in_vram);
  EXPECT_LE(plan.vram_total(), req.vram_budget);
  EXPECT_GT(plan.vram_experts, 0u);
  // The leftover is smaller than one more slot.
  EXPECT_LT(req.vram_budget - plan.vram_total(), fp.expert_bytes[3]);
  int64_t lo = 1 << 30, hi = 0;
  for (int64_t l = 0; l < 78; ++l) {
    const LayerPlacement& L = plan.layers[size_t(l)];
    if (l < 3) {
      EXPECT_TRUE(L.home.empty());
      continue;
    }
    EXPECT_EQ(sum_homes(L), 256);
    EXPECT_EQ(L.pinned, 0);  // nothing pinned without usage statistics
    EXPECT_EQ(L.count(ExpertHome::Cached), L.slots);
    lo = std::min(lo, L.slots), hi = std::max(hi, L.slots);
  }
  EXPECT_LE(hi - lo, 1);
  EXPECT_GT(lo, 0);
  EXPECT_EQ(plan.slots_per_layer().size(), 78u);
  EXPECT_NE(plan.summary().find("hit-rate"), std::string::npos);
  auto j = plan.to_json();
  EXPECT_EQ(j["layers"][5]["homes"].get<std::string>().size(), 256u);
}

TEST(Placement, AllInVramAndTooSmall) {
  ModelSpec c = ModelSpec::from_json(tiny_moe_config(2));
  ModelFootprint fp = footprint_from_config(c);
  PlacementRequest req;
  req.vram_budget = 4 * kGiB;
  PlacementPlan plan = plan_placement(c, fp, req);
  EXPECT_TRUE(plan.all_experts_in_vram);
  for (const auto& L : plan.layers) EXPECT_EQ(L.count(ExpertHome::Pinned), c.n_routed_experts);
  EXPECT_EQ(plan.vram_experts, fp.experts_total(c));

  req.vram_budget = kGiB / 2;  // less than the workspace alone
  PlacementPlan tight = plan_placement(c, fp, req);
  EXPECT_FALSE(tight.fits);
  EXPECT_FALSE(tight.note.empty());
  for (const auto& L : tight.layers) {
    EXPECT_EQ(L.slots, 0);
    EXPECT_EQ(L.count(ExpertHome::Cpu), c.n_routed_experts);  // no slot to fetch into
  }
}

UsageStats skewed_usage(const ModelSpec& c, int64_t concentrated_layer) {
  UsageStats u(c.num_layers, c.n_routed_experts, c.experts_per_token);
  for (int64_t l = 0; l < c.num_layers; ++l)
    for (int t = 0; t < 400; ++t) {
      std::vector<int32_t> ids;
      for (int32_t k = 0; k < c.experts_per_token; ++k)
        ids.push_back(l == concentrated_layer ? int32_t((t % 3 == 0 ? t * 7 + k * 13 : k * 5 + 40) % c.n_routed_experts)
                                              : int32_t((t * 8 + k) % c.n_routed_experts));
      u.record(l, ids);
    }
  return u;
}

// Six MoE layers of GLM-5 with 2-bit experts, usage concentrated on layer 2, a budget for 64 experts per layer.
struct SixLayers {
  ModelSpec c = glm5(6, 0);
  ModelFootprint fp = footprint_from_config(c, 2.0, 4.0);
  UsageStats usage = skewed_usage(c, /*concentrated_layer=*/2);
  PlacementRequest req;
  SixLayers() {
    req.context = 4096;
    req.vram_budget =
        fp.dense_total() + kv_cache_bytes(c, req.context) + req.workspace_bytes + 6 * 64 * fp.expert_bytes[0];
  }
};

TEST(Placement, PinsHottestAndEntropyPolicyShiftsSlots) {
  SixLayers six;
  const ModelSpec& c = six.c;
  const ModelFootprint& fp = six.fp;
  const UsageStats& usage = six.usage;
  PlacementRequest& req = six.req;
  req.slot_policy = SlotPolicy::Entropy;
  PlacementPlan plan = plan_placement(c, fp, req, &usage);
  ASSERT_TRUE(plan.fits);
  EXPECT_LE(plan.vram_total(), req.vram_budget);
  EXPECT_LT(plan.layers[2].slots, plan.layers[0].slots);  // a concentrated layer needs fewer slots
  EXPECT_GT(plan.layers[2].hit_rate, plan.layers[0].hit_rate);
  for (int64_t l = 0; l < 6; ++l) {
    const LayerPlacement& L = plan.layers[size_t(l)];
    EXPECT_EQ(L.pinned, int64_t(std::floor(req.pin_fraction * double(L.slots))));
    // The pinned experts are the hottest ones.
    auto hot = usage.hottest(l, size_t(L.pinned));
    for (int32_t e : hot) EXPECT_EQ(L.home[size_t(e)], ExpertHome::Pinned);
    double min_pinned = 1e30, max_cold = 0;
    for (int32_t e = 0; e < 256; ++e) {
      if (L.home[size_t(e)] == ExpertHome::Pinned) min_pinned = std::min(min_pinned, usage.count(l, e));
      if (L.home[size_t(e)] == ExpertHome::Fetch || L.home[size_t(e)] == ExpertHome::Cpu) max_cold = std::max(max_cold, usage.count(l, e));
    }
    EXPECT_GE(min_pinned, max_cold);
  }
  req.slot_policy = SlotPolicy::Equal;
  PlacementPlan equal = plan_placement(c, fp, req, &usage);
  EXPECT_EQ(equal.layers[2].slots, equal.layers[0].slots);
}

// Decode that reads cold experts in place (lru_slots): every slot but lru_slots pinned, the hottest first with usage,
// the lowest ids without.
TEST(Placement, LruSlotsPinsTheRest) {
  SixLayers six;
  six.req.lru_slots = 4;
  const UsageStats* none = nullptr;
  for (const UsageStats* u : {static_cast<const UsageStats*>(&six.usage), none}) {
    const PlacementPlan plan = plan_placement(six.c, six.fp, six.req, u);
    ASSERT_TRUE(plan.fits);
    EXPECT_LE(plan.vram_total(), six.req.vram_budget);
    for (int64_t l = 0; l < 6; ++l) {
      const LayerPlacement& L = plan.layers[size_t(l)];
      ASSERT_GT(L.slots, 4);
      EXPECT_EQ(L.pinned, L.slots - 4);
      EXPECT_EQ(L.count(ExpertHome::Pinned), L.pinned);
      if (u) {
        for (int32_t e : six.usage.hottest(l, size_t(L.pinned))) EXPECT_EQ(L.home[size_t(e)], ExpertHome::Pinned);
      } else {
        for (int32_t e = 0; e < L.pinned; ++e) EXPECT_EQ(L.home[size_t(e)], ExpertHome::Pinned);
      }
    }
  }
}

TEST(Placement, ColdSplitFollowsCostModel) {
  ModelSpec c = glm5(4, 0);
  ModelFootprint fp = footprint_from_config(c, 4.0, 4.0);
  PlacementRequest req;
  req.context = 8192;
  req.vram_budget = fp.dense_total() + kv_cache_bytes(c, req.context) + req.workspace_bytes + 4 * 32 * fp.expert_bytes[0];
  req.cost.pcie_gbps = 25;
  req.cost.host_mem_gbps = 60;
  req.cost.cpu_gflops = 400;
  // Decode, batch 1: the CPU is faster per expert, but PCIe runs concurrently, so both paths get work and
  // finish close together.
  PlacementPlan decode = plan_placement(c, fp, req);
  const LayerPlacement& d = decode.layers[1];
  EXPECT_GT(d.count(ExpertHome::Cpu), d.count(ExpertHome::Fetch));
  EXPECT_GT(d.count(ExpertHome::Fetch), 0);
  EXPECT_NEAR(d.cold_fetch_s, d.cold_cpu_s, 0.1 * std::max(d.cold_fetch_s, d.cold_cpu_s));
  // One-token CPU work beats a fetch, many-token work does not.
  EXPECT_GT(d.fetch_min_tokens, 1);
  EXPECT_FALSE(decode.prefer_fetch(1, 1));
  EXPECT_TRUE(decode.prefer_fetch(1, d.fetch_min_tokens));
  EXPECT_FALSE(decode.prefer_fetch(1, d.fetch_min_tokens - 1));
  // Prefill chunks: every cold expert carries many tokens, so fetching wins (bounded by PCIe vs CPU balance).
  req.step_tokens = 2048;
  PlacementPlan prefill = plan_placement(c, fp, req);
  const LayerPlacement& p = prefill.layers[1];
  EXPECT_GT(p.count(ExpertHome::Fetch), p.count(ExpertHome::Cpu));
  // A slow link flips decode to the CPU entirely when the CPU alone is faster than the balanced split.
  req.step_tokens = 1;
  req.cost.pcie_gbps = 0.01;
  PlacementPlan slow = plan_placement(c, fp, req);
  EXPECT_EQ(slow.layers[1].count(ExpertHome::Fetch), 0);
}

TEST(Placement, EstimatesImproveWithVram) {
  ModelSpec c = glm5(78);
  ModelFootprint fp = footprint_from_config(c, 2.0, 4.0);
  PlacementRequest req;
  req.context = 8192;
  req.cost.pcie_gbps = 25, req.cost.host_mem_gbps = 60, req.cost.hbm_gbps = 1000;
  req.vram_budget = fp.dense_total() + kv_cache_bytes(c, req.context) + req.workspace_bytes;  // no expert slots
  PlacementPlan baseline = plan_placement(c, fp, req);
  req.vram_budget = 22 * kGiB;
  PlacementPlan hybrid = plan_placement(c, fp, req);
  req.vram_budget = uint64_t(1) << 62;
  PlacementPlan all = plan_placement(c, fp, req);
  auto t = [&](const PlacementPlan& p) { return estimate_step(c, fp, p, req.cost, 1, req.context).seconds; };
  EXPECT_GT(t(baseline), t(hybrid));
  EXPECT_GT(t(hybrid), t(all));
  StepEstimate e = estimate_step(c, fp, all, req.cost, 1, req.context);
  EXPECT_EQ(e.pcie_bytes, 0);
  EXPECT_EQ(e.host_bytes, 0);
  // Dense weights, the KV rows attention reads (DSA: top-2048 latents + every indexer key), and 8 experts per
  // token per MoE layer, all from VRAM.
  const double kv_read = 78.0 * (2048 * 576 * 2 + 8192 * 128 * 2);
  EXPECT_NEAR(e.hbm_bytes - double(fp.dense_total()) - kv_read, 75.0 * 8 * double(fp.expert_bytes[3]), 1e-6 * e.hbm_bytes);
}

// GLM-5.3-Flash: a decode step reads state by layer kind. The 34 KDA layers read and write back their fixed
// recurrent + conv state (no KV); the 11 NoPE MLA layers read at most index_topk latent rows and every pooled
// indexer key (one per index_kpool tokens): with the transformers default kpool 16 and the published 4.
TEST(Placement, Glm5NextStepReadsStateByLayerKind) {
  for (int64_t kpool : {16, 4}) {
    nlohmann::json j = read_json_file(std::string(MOESRV_TESTDATA) + "/hf-tiny/info/cfg_glm5_next.json");
    j["text_config"]["index_kpool"] = kpool;
    const ModelSpec c = ModelSpec::from_json(j);
    ModelFootprint fp = footprint_from_config(c, 2.0, 4.0);
    PlacementRequest req;
    req.vram_budget = uint64_t(1) << 62;
    for (int64_t ctx : {1024, 131072}) {
      req.context = ctx;
      const PlacementPlan all = plan_placement(c, fp, req);
      const StepEstimate e = estimate_step(c, fp, all, req.cost, 1, ctx);
      double experts = 0;
      for (int64_t l = 0; l < c.num_layers; ++l)
        if (c.layer_is_moe[size_t(l)]) experts += 8.0 * double(fp.expert_bytes[size_t(l)]);
      const double kda = 2.0 * 4 * (64 * 128 * 128 + 3 * 3 * 64 * 128);
      const double mla = double(std::min<int64_t>(ctx, 2048) * 512 * 2 + ctx / kpool * 128 * 2) +
                         2.0 * 4 * double(2 * kpool * 128);  // + the open pool's keys and gates (room for kpool)
      EXPECT_NEAR(e.hbm_bytes - double(fp.dense_total()) - experts, 34 * kda + 11 * mla, 1e-9 * e.hbm_bytes)
          << "kpool " << kpool << ", context " << ctx;
    }
  }
}

// A pipeline stage's plan: only its layers' dense weights, caches and experts count (the head on the last stage,
// the embedding's host bytes on the first); the stages of a split add up to the whole model's plan.
TEST(Placement, StagePlansCountTheirOwnLayers) {
  ModelSpec c = glm5(12);
  ModelFootprint fp = footprint_from_config(c, 2.0, 4.0);
  PlacementRequest req;
  req.vram_budget = 64 * kGiB;
  req.context = 8192;
  req.workspace_bytes = 0;
  const PlacementPlan whole = plan_placement(c, fp, req);
  req.layer_end = 5;
  const PlacementPlan a = plan_placement(c, fp, req);
  req.layer_begin = 5, req.layer_end = -1;
  const PlacementPlan b = plan_placement(c, fp, req);
  EXPECT_EQ(a.vram_dense + b.vram_dense, whole.vram_dense);
  EXPECT_EQ(a.vram_kv + b.vram_kv, whole.vram_kv);
  EXPECT_EQ(a.host_bytes + b.host_bytes, whole.host_bytes);
  EXPECT_EQ(a.vram_experts + b.vram_experts, whole.vram_experts);
  EXPECT_EQ(a.vram_kv, kv_cache_bytes(c, 8192) * 5 / 12);  // glm5: every layer MLA
  EXPECT_LT(a.vram_dense, b.vram_dense);                   // the head is the last stage's
  for (int64_t l = 0; l < c.num_layers; ++l)
    EXPECT_EQ(a.layers[size_t(l)].home.empty(), l >= 5 || !c.layer_is_moe[size_t(l)]) << l;
  req.layer_begin = 12;
  EXPECT_THROW(plan_placement(c, fp, req), Error);
}

// The runtime planner as the CUDA engine's plan_placement (what open_engine and every stage of --gpus install):
// homes for the MoE layers of its range only, from the engine's budget (the device's free memory without
// --vram-budget, then the options keep no budget), and a clear error when the dense part does not fit.
TEST(Placement, RuntimePlannerFillsTheEngineOptions) {
  auto cfg = tiny_glm5_next_config(4);
  std::shared_ptr<ModelPackage> pkg = make_synthetic_model(cfg);
  auto spec = std::make_shared<const ModelSpec>(ModelSpec::from_json(pkg->config()));
  const ModelFootprint fp = footprint_from_package(*spec, *pkg);
  const uint64_t dense = fp.dense_total() + kv_cache_bytes(*spec, 256);
  const uint64_t expert = fp.expert_bytes[3];
  ASSERT_GT(expert, 0u);
  CudaEngineOptions opt;
  runtime_planner(spec, *pkg, 256, false, false)(dense, dense + 4 * expert * 2, opt);  // room for 4 experts a layer
  ASSERT_EQ(opt.placement.size(), 4u);
  EXPECT_EQ(opt.vram_budget_gib, 0);  // no --vram-budget: the engine keeps the device's free memory
  int64_t slotted = 0;  // no usage statistics: nothing pinned, the slots are an LRU over the layer's experts
  for (int64_t l = 0; l < 4; ++l) {
    const auto& p = opt.placement[size_t(l)];
    EXPECT_EQ(p.size(), spec->layer_is_moe[size_t(l)] ? size_t(spec->n_routed_experts) : 0u);
    EXPECT_EQ(std::count(p.begin(), p.end(), ExpertPlacement::Vram), 0);
    slotted += std::count(p.begin(), p.end(), ExpertPlacement::Cache);
    if (!p.empty()) {
      EXPECT_GT(opt.cache_slots_per_layer[size_t(l)], 0);
    }
  }
  EXPECT_GT(slotted, 0);
  EXPECT_LT(slotted, 2 * spec->n_routed_experts);
  CudaEngineOptions stage;
  runtime_planner(spec, *pkg, 256, false, true, 0, 3)(dense, 64 * kGiB, stage);  // a stage of layers 0-2
  ASSERT_EQ(stage.placement.size(), 4u);
  EXPECT_TRUE(stage.placement[3].empty());
  EXPECT_GT(stage.vram_budget_gib, 0);
  CudaEngineOptions none;
  try {
    runtime_planner(spec, *pkg, 256, false, false)(dense, dense / 2, none);
    ADD_FAILURE() << "a budget below the dense weights planned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("free GPU memory"), std::string::npos) << e.what();
  }
}

// The bench's skewed routing: the synthetic router bias concentrates the selections the engine records on the
// hottest experts, in each layer's own order (measured through CpuEngine's usage statistics, not assumed).
TEST(SyntheticRouting, RouterSkewConcentratesRecordedSelections) {
  auto cfg = tiny_glm5_next_config(4);
  cfg["n_routed_experts"] = 32;
  auto top_half_share = [&](double skew, std::vector<std::vector<int32_t>>* hottest) {
    CpuEngine e(make_synthetic_model(cfg, {.seed = 3, .stddev = 0.05f, .router_skew = skew}));
    auto seq = e.new_sequence();
    std::vector<int32_t> prompt(256);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t((i * 7919) % 512);
    e.forward(*seq, prompt);
    const UsageStats& u = *e.expert_usage();
    double top = 0, all = 0;
    for (int64_t l = 0; l < u.layers(); ++l) {
      if (u.empty(l)) continue;
      auto c = u.counts(l);
      std::sort(c.rbegin(), c.rend());
      for (size_t i = 0; i < c.size(); ++i) (i < c.size() / 2 ? top : all) += c[i];
      if (hottest) hottest->push_back(u.hottest(l, 4));
    }
    return top / (top + all);
  };
  std::vector<std::vector<int32_t>> hot;
  const double uniform = top_half_share(0, nullptr), skewed = top_half_share(0.1, &hot);
  EXPECT_GT(skewed, uniform + 0.1) << "uniform " << uniform << ", skewed " << skewed;
  EXPECT_GT(skewed, 0.8);
  ASSERT_EQ(hot.size(), 4u);
  EXPECT_NE(hot[0], hot[1]);  // each layer has its own hot set
}

constexpr size_t kMiB = size_t(1) << 20;
using P = ExpertPlacement;

ExpertLayer experts(std::vector<size_t> mib, std::vector<ExpertPlacement> placement = {}, bool streams = false,
                    int64_t wanted_slots = 2) {
  for (size_t& b : mib) b *= kMiB;
  return {mib, placement, streams, wanted_slots};
}

TEST(ExpertPlan, SlotCount) {
  EXPECT_EQ(cache_slot_count(0, 5, 4), 2);  // nothing cached: 2 for streaming
  EXPECT_EQ(cache_slot_count(0, 1, 4), 1);  // never more than the experts
  EXPECT_EQ(cache_slot_count(0, 0, 4), 0);
  EXPECT_EQ(cache_slot_count(10, 0, 4), 4);  // as wanted
  EXPECT_EQ(cache_slot_count(3, 0, 4), 3);
  EXPECT_EQ(cache_slot_count(10, 5, 1), 2);  // at least 2 with streaming
  EXPECT_EQ(cache_slot_count(10, 0, 0), 1);
}

TEST(ExpertPlan, SlotUseCountsCacheAndStreamingExperts) {
  const std::vector<P> homes = {P::Vram, P::Cache, P::Cpu, P::Cpu};
  const ExpertLayer streaming = experts({4, 4, 6, 4}, homes, true, 4);
  const SlotUse u = streaming.slot_use();
  EXPECT_EQ(u.cached, 1);
  EXPECT_EQ(u.streamable, 2);
  EXPECT_EQ(u.slot_bytes, 6 * kMiB);
  EXPECT_EQ(u.slots, 3);
  EXPECT_EQ(streaming.device_bytes(), (4 + 3 * 6 + 1) * kMiB);  // VRAM expert + slots + tables
  const ExpertLayer cpu_only = experts({4, 4, 6, 4}, homes, false, 4);
  EXPECT_FALSE(cpu_only.uses_slots(2));
  EXPECT_EQ(cpu_only.slot_use().slots, 1);
  EXPECT_EQ(cpu_only.device_bytes(), (4 + 4 + 1) * kMiB);
}

TEST(ExpertPlan, FillInOrderReservesStreamingSlotsWhenNotAllFit) {
  auto layers = [] { return std::vector<ExpertLayer>{{}, experts({4, 4, 4, 4}), experts({4, 4, 4, 4}, {}, true)}; };
  std::vector<ExpertLayer> all = layers();  // 32 MiB of experts fit: every expert in VRAM, no slots set aside
  EXPECT_EQ(fill_in_order(all, 10 * kMiB, 42 * kMiB), 42 * kMiB);
  EXPECT_TRUE(all[0].placement.empty());
  EXPECT_EQ(all[1].placement, std::vector<P>(4, P::Vram));
  EXPECT_EQ(all[2].placement, std::vector<P>(4, P::Vram));
  // 24 MiB left: 2 streaming slots of layer 2 (8 MiB) first, then layer 1 fills the rest.
  std::vector<ExpertLayer> part = layers();
  EXPECT_EQ(fill_in_order(part, 10 * kMiB, 34 * kMiB), 34 * kMiB);
  EXPECT_EQ(part[1].placement, std::vector<P>(4, P::Vram));
  EXPECT_EQ(part[2].placement, std::vector<P>(4, P::Cpu));
}

TEST(ExpertPlan, FillInOrderSkipsWhatDoesNotFitAndKeepsGivenLayers) {
  std::vector<ExpertLayer> layers = {experts({2, 6, 2}), experts({2, 2}, {P::Cache, P::Cpu})};
  EXPECT_EQ(fill_in_order(layers, 0, 5 * kMiB), 4 * kMiB);
  EXPECT_EQ(layers[0].placement, (std::vector<P>{P::Vram, P::Cpu, P::Vram}));
  EXPECT_EQ(layers[1].placement, (std::vector<P>{P::Cache, P::Cpu}));
}

TEST(ExpertPlan, FitMovesVramExpertsFromTheLastLayerUntilItFits) {
  // 17 MiB each: layer 1's second Cache expert saves nothing (a second slot), its third does (2 slots at most).
  std::vector<ExpertLayer> layers = {experts({4, 4, 4, 4}, std::vector<P>(4, P::Vram)),
                                     experts({4, 4, 4, 4}, {P::Vram, P::Vram, P::Vram, P::Cache})};
  EXPECT_EQ(fit_to_budget(layers, 0, 26 * kMiB), 3);
  EXPECT_EQ(layers[0].placement, (std::vector<P>{P::Vram, P::Vram, P::Vram, P::Cpu}));
  EXPECT_EQ(layers[1].placement, (std::vector<P>{P::Vram, P::Cache, P::Cache, P::Cache}));
  EXPECT_EQ(layers[0].device_bytes() + layers[1].device_bytes(), 26 * kMiB);
  EXPECT_EQ(fit_to_budget(layers, 0, 26 * kMiB), 0);  // fits already
}

TEST(ExpertPlan, PlaceExpertsFitsOnlyGivenPlans) {
  const std::vector<P> vram(2, P::Vram);
  auto layers = [&] { return std::vector<ExpertLayer>{experts({4, 4}, vram), experts({4, 4}, vram)}; };
  std::vector<ExpertLayer> kept = layers();
  EXPECT_EQ(place_experts(kept, 0, 12 * kMiB, false), 0);
  EXPECT_EQ(kept[0].placement, vram);
  EXPECT_EQ(kept[1].placement, vram);
  std::vector<ExpertLayer> fitted = layers();  // 9 + 9 MiB over 12: one expert of each layer leaves
  EXPECT_EQ(place_experts(fitted, 0, 12 * kMiB, true), 2);
  EXPECT_EQ(fitted[0].placement, (std::vector<P>{P::Vram, P::Cpu}));
  EXPECT_EQ(fitted[1].placement, (std::vector<P>{P::Vram, P::Cpu}));
  std::vector<ExpertLayer> mixed = {experts({4, 4}, vram), experts({4, 4})};  // the filled layer counts once
  EXPECT_EQ(place_experts(mixed, 0, 12 * kMiB, true), 2);
  EXPECT_EQ(mixed[1].placement, (std::vector<P>{P::Vram, P::Cpu}));
}

}  // namespace
}  // namespace moesrv
