// --gpus N through the engine factory: planned split -> PipelineEngine (CPU stages here), same logits as CpuEngine.
#include <gtest/gtest.h>

#include <algorithm>

#include "backend/cpu/cpu_engine.h"
#include "format/package.h"
#include "reference_util.h"
#include "runtime/engine_factory.h"
#include "runtime/multi_gpu.h"
#include "runtime/pipeline.h"

namespace moesrv {
namespace {

using namespace moesrv::testing;

EngineOptions parse(std::vector<std::string> args) {
  CLI::App app;
  EngineOptions o;
  add_engine_options(&app, o);
  std::reverse(args.begin(), args.end());
  app.parse(args);
  return o;
}

TEST(MultiGpuFactory, ParsesGpusAndBudgetList) {
  EngineOptions o = parse({"--gpus", "2", "--vram-budget", "22,10.5", "--backend", "cpu"});
  EXPECT_EQ(o.gpus, 2);
  EXPECT_EQ(o.vram_budgets_gib, (std::vector<double>{22, 10.5}));
  EXPECT_EQ(parse({"--vram-budget", "8"}).vram_budgets_gib, (std::vector<double>{8}));
  EXPECT_EQ(parse({}).gpus, 0);
  EXPECT_THROW(parse({"--vram-budget", "2", "3"}), CLI::ParseError);  // one token per flag: "2,3"
}

// --prefill-group: 0 (the default) is 4 passes per group under a budget of 20 GiB or more, else 1; N is N.
TEST(MultiGpuFactory, PrefillGroupDefaultsFromTheBudget) {
  EXPECT_EQ(parse({}).prefill_group, 0);
  EXPECT_EQ(parse({"--prefill-group", "2"}).prefill_group, 2);
  EXPECT_THROW(parse({"--prefill-group", "-1"}), CLI::ParseError);
  EXPECT_EQ(EngineOptions::default_prefill_group(0), 1);  // no budget
  EXPECT_EQ(EngineOptions::default_prefill_group(12), 1);
  EXPECT_EQ(EngineOptions::default_prefill_group(22), EngineOptions::kBudgetPrefillGroup);
  EXPECT_EQ(EngineOptions::default_prefill_group(44), EngineOptions::kBudgetPrefillGroup);
}

TEST(MultiGpuFactory, PrefetchExpertsOption) {
  EXPECT_EQ(parse({}).prefetch_experts, -1);  // the engine's default
  EXPECT_EQ(parse({"--prefetch-experts", "0"}).prefetch_experts, 0);
  EXPECT_EQ(parse({"--prefetch-experts", "2"}).prefetch_experts, 2);
  EXPECT_THROW(parse({"--prefetch-experts", "-2"}), CLI::ParseError);
  EXPECT_THROW(parse({"--prefetch-experts", "65"}), CLI::ParseError);
}

TEST(MultiGpuFactory, CachePolicyOption) {
  EXPECT_EQ(parse({}).cache_policy, "lfu");
  EXPECT_EQ(parse({"--cache-policy", "lru"}).cache_policy, "lru");
  EXPECT_THROW(parse({"--cache-policy", "mru"}), CLI::ParseError);
}

void expect_same_as_cpu(const std::string& model, Engine& e) {
  auto cpu = CpuEngine::open(hf_tiny(model));
  Reference ref = load_reference(model);
  auto a = cpu->new_sequence();
  auto b = e.new_sequence();
  EXPECT_EQ(e.forward(*b, ref.input_ids, true), cpu->forward(*a, ref.input_ids, true));
  EXPECT_EQ(e.forward(*b, {ref.gen_ids.back()}), cpu->forward(*a, {ref.gen_ids.back()}));
}

TEST(MultiGpuFactory, CpuBackendRunsThePlannedPipeline) {
  for (int gpus : {1, 2, 3}) {
    EngineOptions o = parse({"--backend", "cpu", "--gpus", std::to_string(gpus), "--vram-budget", "2"});
    auto e = open_engine(hf_tiny("glm_moe_dsa"), o);
    auto* p = dynamic_cast<PipelineEngine*>(e.get());
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(int(p->stages().size()), gpus);
    expect_same_as_cpu("glm_moe_dsa", *e);
  }
}

TEST(MultiGpuFactory, UnevenBudgetsMoveLayers) {
  auto cpu = CpuEngine::open(hf_tiny("deepseek_v3"));
  const ModelFootprint fp = footprint_from_weights(cpu->weights());
  ModelSplitRequest req{.budgets = {kGiB, kGiB}, .context = 4096, .workspace_bytes = 0};
  bool resident = false;
  auto even = plan_model_split(cpu->config(), fp, req, &resident);
  ASSERT_TRUE(even.fits) << even.error;
  EXPECT_TRUE(resident);
  ASSERT_GT(even.gpus[0].layer_end, 1) << even.summary();
  req.budgets = {even.gpus[0].total() - 1, 4 * kGiB};  // GPU 0 can no longer hold its balanced share
  auto uneven = plan_model_split(cpu->config(), fp, req);
  ASSERT_TRUE(uneven.fits) << uneven.error;
  EXPECT_LT(uneven.gpus[0].layer_end, even.gpus[0].layer_end) << uneven.summary();
  EXPECT_LE(uneven.gpus[0].total(), req.budgets[0]);
}

// The factory plans from the package manifest (no weights loaded): for bf16 packages the same split as the weights'
// footprint gives.
TEST(MultiGpuFactory, ManifestPlanMatchesTheWeights) {
  for (const char* model : {"glm_moe_dsa", "deepseek_v3", "glm5_next"}) {
    auto cpu = CpuEngine::open(hf_tiny(model));
    auto pkg = ModelPackage::open(hf_tiny(model));
    const ModelSpec c = ModelSpec::from_json(pkg->config());
    for (uint64_t mib : {64, 128, 1024}) {
      ModelSplitRequest req{.budgets = {mib << 20, mib << 20, mib << 20}, .context = 4096, .workspace_bytes = 0};
      auto from_weights = plan_model_split(cpu->config(), footprint_from_weights(cpu->weights()), req);
      auto from_package = plan_model_split(c, footprint_from_package(c, *pkg), req);
      ASSERT_EQ(from_weights.fits, from_package.fits) << model << " " << mib;
      ASSERT_EQ(from_weights.gpus.size(), from_package.gpus.size()) << model << " " << mib;
      for (size_t g = 0; g < from_weights.gpus.size(); ++g)
        EXPECT_EQ(from_weights.gpus[g].layer_begin, from_package.gpus[g].layer_begin)
            << model << " " << mib << " MiB: " << from_weights.summary() << " vs " << from_package.summary();
      if (from_package.fits) {  // a real split
        EXPECT_GT(from_package.gpus.back().layer_begin, 0) << from_package.summary();
      }
    }
  }
}

TEST(MultiGpuFactory, ClearErrorWhenTheModelCannotFit) {
  EngineOptions o = parse({"--backend", "cpu", "--gpus", "2", "--vram-budget", "0.5,0.5"});
  try {
    open_engine(hf_tiny("glm4_moe"), o);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("--gpus 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("needs"), std::string::npos) << e.what();
  }
  EXPECT_THROW(open_engine(hf_tiny("glm4_moe"), parse({"--backend", "cpu", "--gpus", "2", "--vram-budget", "2,2,2"})), std::exception);
  EXPECT_THROW(open_engine(hf_tiny("glm4_moe"), parse({"--backend", "cpu", "--vram-budget", "2,2"})), std::exception);
}

}  // namespace
}  // namespace moesrv
