// DraftPolicy (speculative decoding's drafts per step) against simulated steps (simulate_draft_policy: a step of k
// drafts costs cost(k) seconds, its drafts are accepted one after another with probability a, from a fixed
// pseudo-random stream), so tokens per second can be compared with what each fixed k would give.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>

#include "bench/speculative_projection.h"
#include "serving/draft_policy.h"

namespace moesrv {
namespace {

// Expected tokens per second of always drafting k.
double fixed_rate(int k, const std::function<double(int)>& cost, double a) {
  double tokens = 0, p = 1;
  for (int i = 0; i <= k; ++i, p *= a) tokens += p;
  return tokens / cost(k);
}

TEST(DraftPolicy, WarmsUpWithAllDraftsThenNone) {
  DraftPolicy p(3);
  EXPECT_EQ(p.next(), 3);
  p.record(3, 1, 0.020);  // not timed: the first step of a k captures its graphs
  EXPECT_LT(p.step_seconds(3), 0.0);
  EXPECT_EQ(p.next(), 3);
  p.record(3, 0, 0.016);
  EXPECT_DOUBLE_EQ(p.step_seconds(3), 0.016);
  EXPECT_EQ(p.next(), 0);
  p.record(0, 0, 0.015);
  EXPECT_EQ(p.next(), 0);
  p.record(0, 0, 0.010);
  EXPECT_DOUBLE_EQ(p.step_seconds(0), 0.010);
  // Between the measured ends, the cost of a step is interpolated.
  EXPECT_NEAR(p.step_seconds(1), 0.012, 1e-12);
  EXPECT_NEAR(p.step_seconds(2), 0.014, 1e-12);
  // Draft 1 was accepted once of twice; draft 2 rejected once (after an accept), draft 3 never reached: as likely as 2.
  EXPECT_NEAR(p.acceptance(1), (0.9 * 1 + 0) / (0.9 + 1), 1e-12);
  EXPECT_DOUBLE_EQ(p.acceptance(2), 0.0);
  EXPECT_DOUBLE_EQ(p.acceptance(3), 0.0);
}

// Nothing accepted, a verify of k + 1 tokens 0.6 decode steps dearer per draft (the measured GPU ratio): plain steps,
// one probe every kProbePeriod steps, within 10% of plain decoding's speed over 200 steps (warm-up included).
TEST(DraftPolicy, NothingAcceptedCostsAtMostTenPercent) {
  auto cost = [](int k) { return 0.010 * (1 + 0.6 * k); };
  DraftPolicy p(3);
  const DraftSimulation r = simulate_draft_policy(p, 200, cost, 0.0);
  EXPECT_EQ(p.choice(), 0);
  EXPECT_LE(r.drafting_steps, DraftPolicy::kWarmupSteps + 200 / DraftPolicy::kProbePeriod + 1);
  EXPECT_GE(r.tokens_per_second(), fixed_rate(0, cost, 0.0) / 1.10);
}

// Drafts that are usually accepted and cheap: all k of them.
TEST(DraftPolicy, HighAcceptanceDraftsAll) {
  auto cost = [](int k) { return 0.010 * (1 + 0.2 * k); };
  DraftPolicy p(3);
  const DraftSimulation r = simulate_draft_policy(p, 300, cost, 0.9);
  EXPECT_EQ(p.choice(), 3);
  EXPECT_GE(r.tokens_per_second(), 0.9 * fixed_rate(3, cost, 0.9));
}

// In between, the best fixed k is 1 (acceptance 0.5, 0.3 decode steps per draft); the policy's speed comes within
// 10% of it, and above both ends (always 0, always 3).
TEST(DraftPolicy, MiddleAcceptanceComesNearTheBestFixedK) {
  auto cost = [](int k) { return 0.010 * (1 + 0.3 * k); };
  const double a = 0.5;
  double best = 0;
  for (int k = 0; k <= 3; ++k) best = std::max(best, fixed_rate(k, cost, a));
  ASSERT_DOUBLE_EQ(best, fixed_rate(1, cost, a));
  DraftPolicy p(3);
  const DraftSimulation r = simulate_draft_policy(p, 400, cost, a);
  EXPECT_GE(r.tokens_per_second(), 0.9 * best);
  EXPECT_GT(r.tokens_per_second(), fixed_rate(0, cost, a));
  EXPECT_GT(r.tokens_per_second(), fixed_rate(3, cost, a));
}

// Acceptance that changes mid-stream: the probes find it.
TEST(DraftPolicy, ProbesFindAcceptanceThatRises) {
  auto cost = [](int k) { return 0.010 * (1 + 0.3 * k); };
  DraftPolicy p(2);
  simulate_draft_policy(p, 100, cost, 0.0);
  EXPECT_EQ(p.choice(), 0);
  simulate_draft_policy(p, 300, cost, 0.95);
  EXPECT_EQ(p.choice(), 2);
}

TEST(DraftPolicy, RejectsWhatCannotHappen) {
  EXPECT_THROW(DraftPolicy(0), std::exception);
  DraftPolicy p(2);
  EXPECT_THROW(p.record(3, 0, 0.01), std::exception);
  EXPECT_THROW(p.record(1, 2, 0.01), std::exception);
  EXPECT_THROW(p.record(-1, 0, 0.01), std::exception);
}

// The bench's projection from measured step costs: ~1 with nothing accepted, more than any fixed k's where one wins.
TEST(DraftPolicy, AdaptiveProjectionFromStepCosts) {
  const std::vector<double> cost{0.0100, 0.0110, 0.0120, 0.0130};  // decode 10 ms, +1 ms per draft
  const auto j = mtp_adaptive_json(cost);
  EXPECT_EQ(j["max_k"], 3);
  EXPECT_GE(j["speedup_at_0"].get<double>(), 1 / 1.10);
  EXPECT_LE(j["speedup_at_0"].get<double>(), 1.0);
  EXPECT_GT(j["speedup_at_0.9"].get<double>(), 1.4);
  EXPECT_THROW(mtp_adaptive_json({0.01}), std::exception);
}

}  // namespace
}  // namespace moesrv
