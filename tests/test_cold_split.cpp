// The cold-expert split (backend/cold_split.h) against brute force over every subset, and its cost model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "backend/cold_split.h"

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

}  // namespace
}  // namespace moesrv
