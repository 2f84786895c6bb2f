// Routed-expert usage recorded by the engine, persisted next to the model, and used to pin hot experts.
#include <gtest/gtest.h>

#include <filesystem>

#include "backend/cpu/cpu_engine.h"
#include "runtime/usage_placement.h"

namespace moesrv {
namespace {

namespace fs = std::filesystem;

TEST(UsagePlacement, EngineRecordsPersistsMergesAndPins) {
  const std::string src = std::string(MOESRV_TESTDATA) + "/hf-tiny/deepseek_v3";
  fs::path dir = fs::temp_directory_path() / "moesrv-usage-placement";
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(fs::path(src) / f, dir / f);

  auto engine = CpuEngine::open(dir.string());
  const ModelSpec& c = engine->config();
  auto seq = engine->new_sequence();
  std::vector<int32_t> prompt;
  for (int i = 0; i < 48; ++i) prompt.push_back((i * 37) % 1000);
  engine->forward(*seq, prompt);
  const UsageStats& run = *engine->expert_usage();
  EXPECT_TRUE(run.empty(0));                        // layer 0 is dense
  EXPECT_DOUBLE_EQ(run.tokens(1), 48.0);            // every token routed once per MoE layer
  double selections = 0;
  for (double n : run.counts(1)) selections += n;
  EXPECT_DOUBLE_EQ(selections, 48.0 * double(c.experts_per_token));

  EXPECT_FALSE(load_model_usage(dir.string(), c));  // nothing stored yet
  save_model_usage(dir.string(), c, run, "tiny");
  auto stored = load_model_usage(dir.string(), c);
  ASSERT_TRUE(stored);
  EXPECT_EQ(stored->counts(2), run.counts(2));
  save_model_usage(dir.string(), c, run, "tiny");  // old halved + new: 1.5x
  auto twice = load_model_usage(dir.string(), c);
  ASSERT_TRUE(twice);
  EXPECT_DOUBLE_EQ(twice->tokens(2), 1.5 * run.tokens(2));

  // A budget that holds the dense part and a few slots per layer pins the most used experts.
  PlacementRequest req;
  req.vram_budget = uint64_t(0.0015 * double(kGiB));
  req.context = 128;
  req.workspace_bytes = 0;
  PlacementPlan plan = plan_placement(c, footprint_from_config(c), req, &*twice);
  ASSERT_TRUE(plan.fits) << plan.note;
  const LayerPlacement& lp = plan.layers[2];
  ASSERT_GT(lp.pinned, 0) << plan.summary();
  ASSERT_LT(lp.pinned, c.n_routed_experts) << "budget must force a choice: " << plan.summary();
  auto hottest = twice->hottest(2, size_t(lp.pinned));
  for (int32_t e : hottest) EXPECT_EQ(lp.home[size_t(e)], ExpertHome::Pinned) << "expert " << e;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moesrv
