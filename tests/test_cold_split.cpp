// The cold-expert split (backend/cold_split.h) against brute force over every subset, its cost model, and the
// host plan of one MoE pass built on it (backend/expert_pass.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "backend/cold_split.h"
#include "backend/expert_pass.h"
#include "util/error.h"

namespace moesrv {
namespace {

// max(fetch, cpu) of the best subset (any subset, not only a prefix of the ratio order).
double brute_force(const std::vector<ColdCost>& cold) {
  double best = 1e300;
  for (uint32_t mask = 0; mask < (1u << cold.size()); ++mask) {
    double f = 0, c = 0;
    for (size_t i = 0; i < cold.size(); ++i)
      ((mask >> i) & 1 ? f : c) += (mask >> i) & 1 ? cold[i].fetch_s : cold[i].cpu_s;
    best = std::min(best, std::max(f, c));
  }
  return best;
}

double cost_of(const std::vector<ColdCost>& cold, size_t k) {
  double f = 0, c = 0;
  for (size_t i = 0; i < cold.size(); ++i) (i < k ? f : c) += i < k ? cold[i].fetch_s : cold[i].cpu_s;
  return std::max(f, c);
}

TEST(ColdSplit, ManyTokensFavourTheGpuAndNoSlotMeansCpu) {
  // Equal fetch costs; CPU cost grows with tokens: the 3 experts with most tokens go over PCIe first.
  ColdRates r{1e9, 1e-3, 1e-3};
  std::vector<ColdCost> cold;
  for (int32_t e = 0; e < 6; ++e) cold.push_back({e, r.fetch_s(1e6), r.cpu_s(1 + e)});  // fetch 1 ms; CPU 1..6 ms
  std::vector<ColdCost> again = cold;
  const size_t k = split_cold(cold);
  ASSERT_GT(k, 0u);
  for (size_t i = 0; i < k; ++i) EXPECT_GE(cold[i].id, 6 - int32_t(k));  // the heavy ones
  EXPECT_NEAR(cost_of(cold, k), brute_force(again), 1.01e-3);
  EXPECT_EQ(split_cold(again, false), 0u);
  // A slow link: nothing is worth fetching; a slow CPU: everything is.
  std::vector<ColdCost> slow_link = {{0, 10, 1}, {1, 10, 2}}, slow_cpu = {{0, 1e-3, 5}, {1, 1e-3, 5}};
  EXPECT_EQ(split_cold(slow_link), 0u);
  EXPECT_EQ(split_cold(slow_cpu), 2u);
}

TEST(ColdSplit, PrefixIsWithinOneExpertOfTheBestSubset) {
  uint64_t s = 12345;
  auto rnd = [&] { return double((s = s * 6364136223846793005ull + 1442695040888963407ull) >> 40) / double(1 << 24); };
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<ColdCost> cold;
    double largest = 0;
    for (int32_t e = 0; e < 9; ++e) {
      cold.push_back({e, 0.5 + rnd(), 0.2 + 3 * rnd()});
      largest = std::max({largest, cold.back().fetch_s, cold.back().cpu_s});
    }
    const double best = brute_force(cold);
    const size_t k = split_cold(cold);
    EXPECT_LE(cost_of(cold, k), best + largest) << "trial " << trial;
    EXPECT_GE(cost_of(cold, k), best - 1e-12);
  }
}

TEST(ColdRates, CostsFromRates) {
  ColdRates r{2e9, 0.004, 0.0005};
  EXPECT_DOUBLE_EQ(r.fetch_s(4e6), 0.002);
  EXPECT_DOUBLE_EQ(r.cpu_s(1), 0.004);
  EXPECT_DOUBLE_EQ(r.cpu_s(9), 0.008);
  EXPECT_GT(ColdRates{}.fetch_s(1), 1e29);  // unknown link: never fetch
}

// Every selection lands once: GPU experts' selections as consecutive sorted rows (expert order), CPU ones at -1.
void expect_consistent(const ExpertPass& p, const std::vector<int32_t>& ids, int64_t k) {
  std::vector<int> seen(ids.size(), 0);
  int32_t next_row = 0;
  for (auto [e, row0] : p.gpu_runs) {
    EXPECT_EQ(row0, next_row);
    for (int32_t i : p.by_expert[size_t(e)]) {
      EXPECT_EQ(ids[size_t(i)], e);
      EXPECT_EQ(p.rowmap[size_t(i)], next_row);
      EXPECT_EQ(p.sorted_tok[size_t(next_row)], i / int32_t(k));
      ++next_row;
      ++seen[size_t(i)];
    }
  }
  EXPECT_EQ(size_t(next_row), p.sorted_tok.size());
  for (int32_t e : p.cpu_experts)
    for (int32_t i : p.by_expert[size_t(e)]) {
      EXPECT_EQ(p.rowmap[size_t(i)], -1);
      ++seen[size_t(i)];
    }
  for (int v : seen) EXPECT_EQ(v, 1);
}

TEST(ExpertPass, PlacementsAndTheColdSplit) {
  const int64_t E = 12, k = 3, T = 40;
  std::vector<int32_t> ids(size_t(T * k));
  uint64_t s = 7;
  for (auto& v : ids) v = int32_t((s = s * 6364136223846793005ull + 1442695040888963407ull) >> 33) % int32_t(E);
  ids[0] = 11, ids[1] = 10;  // experts 10, 11 routed at least once
  std::vector<ExpertWhere> where(size_t(E), ExpertWhere::Gpu);
  for (int64_t e = 4; e < 8; ++e) where[size_t(e)] = ExpertWhere::Cpu;
  for (int64_t e = 8; e < E; ++e) where[size_t(e)] = ExpertWhere::Cold;
  // A CPU that costs a second per token: every cold expert is fetched.
  auto slow_cpu = [](int32_t e, int64_t n) { return ColdCost{e, 1e-3, double(n)}; };
  ExpertPass p = plan_expert_pass(ids.data(), T, k, where, slow_cpu, true);
  expect_consistent(p, ids, k);
  EXPECT_EQ(p.streamed.size(), 4u);
  for (int32_t e : p.cpu_experts) EXPECT_TRUE(e >= 4 && e < 8) << e;
  // No slot to fetch into: cold experts stay on the CPU.
  p = plan_expert_pass(ids.data(), T, k, where, slow_cpu, false);
  expect_consistent(p, ids, k);
  EXPECT_TRUE(p.streamed.empty());
  EXPECT_EQ(p.cpu_experts.size(), 8u);
  // A slow link, a CPU cheap for one token and dear for more: only multi-selection cold experts are fetched.
  std::vector<int32_t> one = {8, 9, 9, 0, 1, 2};  // expert 8 once, expert 9 twice
  p = plan_expert_pass(
      one.data(), 2, k, where,
      [](int32_t e, int64_t n) {
        return ColdCost{e, 1.0, n > 1 ? 1e3 : 1e-6};
      },
      true);
  expect_consistent(p, one, k);
  EXPECT_EQ(p.streamed, std::vector<int32_t>{9});
  EXPECT_EQ(p.cpu_experts, std::vector<int32_t>{8});
  // A selection outside the layer's experts is an error, not a crash.
  std::vector<int32_t> bad = {0, 1, 12};
  EXPECT_THROW(plan_expert_pass(bad.data(), 1, k, where, slow_cpu, true), Error);
}

TEST(ExpertPass, GpuRunsReorderedByRank) {
  const int64_t k = 2;
  const std::vector<int32_t> ids = {3, 1, 2, 3, 0, 1};  // tokens 0..2
  std::vector<ExpertWhere> where(4, ExpertWhere::Gpu);
  auto none = [](int32_t e, int64_t) { return ColdCost{e, 0, 0}; };
  ExpertPass p = plan_expert_pass(ids.data(), 3, k, where, none, true);
  // Expert 2 first, then 0 and 3 (rank 1, in expert order), then 1.
  order_gpu_runs(p, k, [](int32_t e) { return e == 2 ? 0 : e == 1 ? 2 : 1; });
  expect_consistent(p, ids, k);
  std::vector<int32_t> order;
  for (const auto& [e, row0] : p.gpu_runs) order.push_back(e);
  EXPECT_EQ(order, (std::vector<int32_t>{2, 0, 3, 1}));
  EXPECT_EQ(p.sorted_tok, (std::vector<int32_t>{1, 2, 0, 1, 0, 2}));
}

TEST(ExpertPass, PrefetchTakesTheMostPickedFetchableExperts) {
  const int64_t k = 4;
  // Token 0 picks 7, 3, 5, 1 (best first), token 1 picks 5, 2, 7, 9: 5 and 7 twice, each ranked first once (by id).
  const std::vector<int32_t> picks = {7, 3, 5, 1, 5, 2, 7, 9};
  auto all = [](int32_t) { return true; };
  EXPECT_EQ(plan_prefetch(picks.data(), 2, k, 8, all), (std::vector<int32_t>{5, 7, 2, 3, 1, 9}));
  EXPECT_EQ(plan_prefetch(picks.data(), 2, k, 3, all), (std::vector<int32_t>{5, 7, 2}));
  // Experts already resident (or not copyable) are skipped; the limit counts the experts taken.
  auto not_resident = [](int32_t e) { return e != 5 && e != 2; };
  EXPECT_EQ(plan_prefetch(picks.data(), 2, k, 3, not_resident), (std::vector<int32_t>{7, 3, 1}));
  // One token: its picks in rank order; no limit, nothing.
  EXPECT_EQ(plan_prefetch(picks.data(), 1, k, 2, all), (std::vector<int32_t>{7, 3}));
  EXPECT_TRUE(plan_prefetch(picks.data(), 2, k, 0, all).empty());
  const std::vector<int32_t> bad = {0, -1, 2, 3};
  EXPECT_THROW(plan_prefetch(bad.data(), 1, k, 4, all), Error);
}

}  // namespace
}  // namespace moesrv
