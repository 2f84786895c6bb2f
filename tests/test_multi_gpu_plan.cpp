// Layer split across GPUs: budgets respected, contiguous coverage, balance, uneven budgets, clear errors.
#include <gtest/gtest.h>

#include <fstream>

#include "runtime/multi_gpu_plan.h"

namespace moesrv {
namespace {

constexpr uint64_t kMiB = uint64_t(1) << 20;

LayerSplitCosts uniform(int64_t layers, uint64_t bytes, double read) {
  LayerSplitCosts c;
  c.vram_bytes.assign(size_t(layers), bytes);
  c.read_bytes.assign(size_t(layers), read);
  c.embed_bytes = 100 * kMiB;
  c.head_bytes = 100 * kMiB;
  c.head_read_bytes = 0;
  c.workspace_bytes = 50 * kMiB;
  return c;
}

void expect_valid(const MultiGpuPlan& p, const LayerSplitCosts& c, const std::vector<uint64_t>& budgets) {
  ASSERT_TRUE(p.fits) << p.error;
  ASSERT_EQ(p.gpus.size(), budgets.size());
  int64_t next = 0;
  for (size_t g = 0; g < p.gpus.size(); ++g) {
    const GpuShare& s = p.gpus[g];
    EXPECT_EQ(s.layer_begin, next) << "GPU " << g;
    EXPECT_LT(s.layer_begin, s.layer_end) << "GPU " << g;
    EXPECT_LE(s.total(), budgets[g]) << "GPU " << g;
    EXPECT_EQ(s.embed_bytes, g == 0 ? c.embed_bytes : 0);
    EXPECT_EQ(s.head_bytes, g + 1 == p.gpus.size() ? c.head_bytes : 0);
    next = s.layer_end;
  }
  EXPECT_EQ(next, int64_t(c.vram_bytes.size()));
}

TEST(MultiGpuPlan, EqualBudgetsBalanceWithinOneLayer) {
  for (int gpus : {1, 2, 3, 4}) {
    auto c = uniform(10, 200 * kMiB, 1.0);
    std::vector<uint64_t> budgets(size_t(gpus), 8 * kGiB);
    auto p = plan_layer_split(c, budgets);
    expect_valid(p, c, budgets);
    double lo = 1e30, hi = 0;
    for (const auto& g : p.gpus) lo = std::min(lo, g.read_bytes), hi = std::max(hi, g.read_bytes);
    EXPECT_LE(hi - lo, 1.0) << gpus << " GPUs\n" << p.summary();
  }
}

TEST(MultiGpuPlan, UnevenLayerCostsBalanceByTimeNotCount) {
  auto c = uniform(8, 100 * kMiB, 1.0);
  c.read_bytes = {8, 1, 1, 1, 1, 1, 1, 1};  // one heavy layer
  std::vector<uint64_t> budgets(2, 8 * kGiB);
  auto p = plan_layer_split(c, budgets);
  expect_valid(p, c, budgets);
  EXPECT_EQ(p.gpus[0].layer_end, 1) << p.summary();
  EXPECT_DOUBLE_EQ(p.max_read_bytes(), 8);
}

TEST(MultiGpuPlan, UnevenBudgetsShiftLayers) {
  auto c = uniform(20, 500 * kMiB, 1.0);
  // 20 layers x 0.5 GiB = 10 GiB; a 4 GiB GPU cannot take its balanced half.
  std::vector<uint64_t> budgets{4 * kGiB, 12 * kGiB};
  auto p = plan_layer_split(c, budgets);
  expect_valid(p, c, budgets);
  EXPECT_LT(p.gpus[0].layer_end, 10) << p.summary();
  // 4 GiB - 100 MiB embed - 50 MiB workspace leaves room for 7 layers.
  EXPECT_EQ(p.gpus[0].layer_end, 7) << p.summary();
  // Swapped budgets shift the other way.
  std::vector<uint64_t> swapped{12 * kGiB, 4 * kGiB};
  auto q = plan_layer_split(c, swapped);
  expect_valid(q, c, swapped);
  EXPECT_EQ(q.gpus[1].layer_end - q.gpus[1].layer_begin, 7) << q.summary();
}

TEST(MultiGpuPlan, ClearErrorWhenTooBig) {
  auto c = uniform(10, kGiB, 1.0);
  auto p = plan_layer_split(c, {4 * kGiB, 4 * kGiB});
  EXPECT_FALSE(p.fits);
  EXPECT_NE(p.error.find("needs"), std::string::npos) << p.error;
  EXPECT_NE(p.summary().find("does not fit"), std::string::npos);
}

TEST(MultiGpuPlan, ClearErrorWhenNoContiguousSplitFits) {
  // Total fits, but one layer is bigger than any single budget.
  auto c = uniform(4, 100 * kMiB, 1.0);
  c.vram_bytes[2] = 5 * kGiB;
  auto p = plan_layer_split(c, {4 * kGiB, 4 * kGiB});
  EXPECT_FALSE(p.fits);
  EXPECT_NE(p.error.find("contiguous"), std::string::npos) << p.error;
}

TEST(MultiGpuPlan, MoreGpusThanLayers) {
  auto c = uniform(2, kMiB, 1.0);
  auto p = plan_layer_split(c, {kGiB, kGiB, kGiB});
  EXPECT_FALSE(p.fits);
  EXPECT_NE(p.error.find("at least one layer"), std::string::npos);
}

TEST(MultiGpuPlan, BudgetListParsing) {
  EXPECT_EQ(vram_budgets_for({22}, 2), (std::vector<uint64_t>{22 * kGiB, 22 * kGiB}));
  EXPECT_EQ(vram_budgets_for({22, 10}, 2), (std::vector<uint64_t>{22 * kGiB, 10 * kGiB}));
  EXPECT_THROW(vram_budgets_for({22, 10, 5}, 2), std::exception);
  EXPECT_THROW(vram_budgets_for({0}, 1), std::exception);
}

TEST(MultiGpuPlan, CostsFromARealConfig) {
  std::ifstream f(std::string(MOESRV_TESTDATA) + "/hf-tiny/glm_moe_dsa/config.json");
  ASSERT_TRUE(f) << "missing test model";
  ModelSpec cfg = ModelSpec::from_json(nlohmann::json::parse(f));
  ModelFootprint fp = footprint_from_config(cfg);
  auto costs = layer_split_costs(cfg, fp, 1024, std::vector<int64_t>(size_t(cfg.num_layers), cfg.n_routed_experts));
  ASSERT_EQ(int64_t(costs.vram_bytes.size()), cfg.num_layers);
  uint64_t total = 0;
  for (auto b : costs.vram_bytes) total += b;
  EXPECT_EQ(total, fp.dense_total() - fp.head_bytes + fp.experts_total(cfg) + kv_cache_bytes(cfg, 1024));
  costs.workspace_bytes = 0;
  std::vector<uint64_t> budgets(2, kGiB);
  auto p = plan_layer_split(costs, budgets);
  expect_valid(p, costs, budgets);
}

}  // namespace
}  // namespace moesrv
