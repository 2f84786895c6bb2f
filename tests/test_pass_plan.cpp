// The pass plan (backend/pass_plan.h: where a forward is cut, where fixed-size state is checkpointed) and the
// checkpoint list every sequence keeps (backend/checkpoint_list.h), checked against a direct enumeration; then the
// CPU engine and its pipeline stages following the same plan over a checkpoint cut.
#include <gtest/gtest.h>

#include <random>

#include "backend/checkpoint_list.h"
#include "backend/cpu/cpu_engine.h"
#include "backend/pass_plan.h"
#include "model/synthetic_model.h"
#include "runtime/pipeline_cpu_stage.h"

namespace moesrv {
namespace {

struct Cut {
  int64_t offset, rows;
  bool checkpoint;
  bool operator==(const Cut&) const = default;
};

std::vector<Cut> cuts(const PassPolicy& p, int64_t pos0, int64_t S, bool rollback = false) {
  std::vector<Cut> out;
  for (const Pass& pass : plan_passes(p, pos0, S, rollback)) out.push_back({pass.offset, pass.rows, pass.checkpoint});
  return out;
}

TEST(PassPlan, CpuPolicyCutsRecurrentPrefillAtCheckpointMultiples) {
  const PassPolicy cpu = pass_policy_for(true, 0, 16);  // the CPU engine's: no row limit
  EXPECT_EQ(cpu.checkpoint_interval, kDefaultCheckpointInterval);
  EXPECT_EQ(cuts(cpu, 100, 5000), (std::vector<Cut>{{0, 1948, true}, {1948, 2048, true}, {3996, 1004, true}}));
  EXPECT_EQ(cuts(cpu, 0, 4096), (std::vector<Cut>{{0, 2048, true}, {2048, 2048, true}}));
  EXPECT_EQ(cuts(cpu, 7, 1), (std::vector<Cut>{{0, 1, false}}));  // decode: no checkpoint
  // Without recurrent state: one pass, a checkpoint at its end (the open k-pool).
  EXPECT_EQ(cuts({0, 2048, 16, false}, 100, 5000), (std::vector<Cut>{{0, 5000, true}}));
}

TEST(PassPlan, RowLimitAndRollback) {
  const PassPolicy gpu = pass_policy_for(true, 8192, 4);  // a CUDA engine's: passes of its rows
  EXPECT_EQ(cuts(gpu, 37, 20000), (std::vector<Cut>{{0, 8155, true}, {8155, 8192, true}, {16347, 3653, true}}));
  // Rows relative to the call when passes are not cut at checkpoints.
  EXPECT_EQ(cuts({8192, 8192, 4, false}, 37, 20000),
            (std::vector<Cut>{{0, 8192, false}, {8192, 8192, false}, {16384, 3616, true}}));
  // A verify forward: no cut at checkpoints, no checkpoint (rollback points instead), but the row limit holds.
  EXPECT_EQ(cuts({0, 4, 16, true}, 3, 6, true), (std::vector<Cut>{{0, 6, false}}));
  EXPECT_EQ(cuts({4, 4, 16, true}, 3, 6, true), (std::vector<Cut>{{0, 4, false}, {4, 2, false}}));
}

// Prefill groups of 3 passes of 9 rows: groups cut and checkpointed at multiples of 27, each cut into passes of 9.
TEST(PassPlan, GroupsCutAndCheckpointAtTheirOwnSize) {
  const PassPolicy gpu = pass_policy_for(true, 9, 4), grouped = grouped_policy(gpu, 27);
  EXPECT_EQ(cuts(grouped, 0, 40), (std::vector<Cut>{{0, 27, true}, {27, 13, true}}));
  EXPECT_EQ(cuts(grouped, 5, 40), (std::vector<Cut>{{0, 22, true}, {22, 18, true}}));  // cut at position 27
  EXPECT_EQ(cuts(grouped_policy({9, 9, 4, false}, 27), 5, 40), (std::vector<Cut>{{0, 27, false}, {27, 13, true}}));
  EXPECT_EQ(cuts(grouped, 5, 1), (std::vector<Cut>{{0, 1, false}}));  // decode as before
  EXPECT_EQ(cuts(grouped_policy(gpu, 9), 0, 20), cuts(gpu, 0, 20));   // a group of one pass
  using Parts = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(group_parts(Pass{0, 22, 5, false, true}, 9), (Parts{{0, 9}, {9, 9}, {18, 4}}));
  EXPECT_EQ(group_parts(Pass{22, 18, 27, true, true}, 9), (Parts{{0, 9}, {9, 9}}));
  EXPECT_EQ(group_parts(Pass{0, 5, 0, true, true}, 9), (Parts{{0, 5}}));
}

TEST(PassPlan, OnlyCheckpointsTheSequenceKeeps) {
  const auto c = cuts({0, 2048, 16, true}, 0, 2048 * 20 + 5);
  ASSERT_EQ(c.size(), 21u);
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(c[i].checkpoint, i >= 5) << i;  // the last 16 of 21
}

// Random policies and calls against the rule read literally, one token at a time.
TEST(PassPlan, MatchesTokenByTokenRule) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    PassPolicy p{int64_t(rng() % 4) * int64_t(rng() % 9), int64_t(rng() % 3) * int64_t(1 + rng() % 7),
                 int64_t(1 + rng() % 5), bool(rng() % 2)};
    const int64_t pos0 = int64_t(rng() % 40), S = int64_t(1 + rng() % 60);
    const bool rollback = rng() % 4 == 0;
    const auto plan = plan_passes(p, pos0, S, rollback);
    std::vector<int64_t> ends;  // where the rule ends a pass, in call offsets
    int64_t run = 0;
    for (int64_t i = 0; i < S; ++i) {
      ++run;
      const int64_t pos = pos0 + i + 1;
      const bool at_step =
          !rollback && S > 1 && p.cut_at_checkpoints && p.checkpoint_interval > 0 && pos % p.checkpoint_interval == 0;
      if (i + 1 == S || at_step || (p.max_rows > 0 && run == p.max_rows)) ends.push_back(i + 1), run = 0;
    }
    ASSERT_EQ(plan.size(), ends.size());
    int64_t want_checkpoints = 0;
    for (size_t k = 0; k < plan.size(); ++k) {
      const int64_t begin = k ? ends[k - 1] : 0;
      EXPECT_EQ(plan[k].offset, begin);
      EXPECT_EQ(plan[k].rows, ends[k] - begin);
      EXPECT_EQ(plan[k].pos0, pos0 + begin);
      EXPECT_EQ(plan[k].last, k + 1 == plan.size());
      const int64_t end_pos = pos0 + ends[k];
      const bool candidate =
          S > 1 && !rollback &&
          (plan[k].last || (p.cut_at_checkpoints && p.checkpoint_interval > 0 && end_pos % p.checkpoint_interval == 0));
      want_checkpoints += candidate;
      EXPECT_TRUE(candidate || !plan[k].checkpoint) << k;
    }
    int64_t got = 0;
    for (const Pass& q : plan) got += q.checkpoint;
    EXPECT_EQ(got, std::min(want_checkpoints, p.max_checkpoints));
    EXPECT_TRUE(got == 0 || plan.back().checkpoint);
  }
}

TEST(CheckpointList, KeepsTheNewestAndResumesAtOrBefore) {
  CheckpointList<int> list(3);
  EXPECT_FALSE(list.wants(0));
  for (int64_t n : {10, 20, 30, 40}) {
    ASSERT_TRUE(list.wants(n));
    list.push(n, std::make_shared<const int>(int(n)));
    EXPECT_FALSE(list.wants(n));
  }
  EXPECT_EQ(list.size(), 3u);
  EXPECT_EQ(list.at(10), nullptr);  // the oldest went first
  ASSERT_NE(list.at(30), nullptr);
  EXPECT_EQ(*list.at(30), 30);
  EXPECT_EQ(list.latest_at_or_before(35), 30);
  EXPECT_EQ(list.latest_at_or_before(19), 0);
  CheckpointList<int> clone = list;  // clones share the saved copies
  list.drop_after(25);
  EXPECT_EQ(list.size(), 1u);
  EXPECT_EQ(list.latest_at_or_before(1000), 20);
  EXPECT_NE(clone.at(40), nullptr);
  EXPECT_EQ(clone.size(), 3u);
}

// One resume rule for the CPU and CUDA sequences: anywhere without fixed-size state; else the current length, 0,
// the last forward's rollback points, a checkpoint, and (only without a recurrence) a k-pool boundary.
TEST(PassPlan, OneResumeRule) {
  CheckpointList<int> cps(4);
  cps.push(40, std::make_shared<int>(40));
  const ResumeRule none, recurrent{true, true, 4}, pool_only{true, false, 4};
  EXPECT_EQ(none.point(37, 50, -1, -1, cps), 37);
  EXPECT_EQ(recurrent.point(50, 50, -1, -1, cps), 50);
  EXPECT_EQ(recurrent.point(70, 50, -1, -1, cps), 50);  // capped at the length
  EXPECT_EQ(recurrent.point(44, 50, -1, -1, cps), 40);  // no pool-boundary rule with a recurrence
  EXPECT_EQ(recurrent.point(30, 50, -1, -1, cps), 0);
  EXPECT_EQ(recurrent.point(47, 50, 45, 50, cps), 47);  // rollback points after tokens 46..49
  EXPECT_EQ(recurrent.point(45, 50, 45, 50, cps), 40);  // (the length before that forward is not one)
  EXPECT_EQ(pool_only.point(47, 50, -1, -1, cps), 44);
  EXPECT_EQ(pool_only.point(41, 50, -1, -1, cps), 40);
  EXPECT_EQ(pool_only.point(3, 50, -1, -1, cps), 0);
  EXPECT_TRUE(pool_only.resumable(36, 50, -1, -1, cps));
  EXPECT_FALSE(pool_only.resumable(37, 50, -1, -1, cps));
}

// A k-pool model without recurrent layers (glm5_next with every layer MLA): the CPU sequence cut back to a pool
// boundary that has no checkpoint continues exactly as a fresh sequence that stopped there (the open pool is empty).
// tests/test_cuda_engine.cpp checks the CUDA sequence the same way.
TEST(PassPlan, KpoolOnlySequenceResumesAtPoolBoundaries) {
  nlohmann::json cfg = tiny_glm5_next_config(4);
  cfg["layer_types"] = std::vector<std::string>(4, "deepseek_sparse_attention");
  CpuEngine e(make_synthetic_model(cfg, {.seed = 5, .stddev = 0.05f}));
  ASSERT_FALSE(e.config().has_recurrent_layers());
  std::vector<int32_t> in;
  for (int32_t i = 0; i < 30; ++i) in.push_back((i * 37 + 11) % int32_t(e.vocab_size()));
  auto cut = e.new_sequence(), fresh = e.new_sequence();
  e.forward(*cut, in);
  EXPECT_EQ(cut->resume_point(27), 24);
  cut->truncate(24);
  e.forward(*fresh, std::vector<int32_t>(in.begin(), in.begin() + 24));
  const std::vector<int32_t> tail(in.begin() + 24, in.end());
  EXPECT_EQ(e.forward(*cut, tail, true), e.forward(*fresh, tail, true));
}

// A prompt across two checkpoint cuts: the single CPU engine and a CPU pipeline over three stages run the same
// passes, so they give the same logits bit for bit and resume at the same checkpoints.
TEST(PassPlan, CpuEngineAndPipelineStagesShareThePlan) {
  nlohmann::json cfg = tiny_glm5_next_config(4);
  auto engine = std::make_shared<CpuEngine>(make_synthetic_model(cfg, {.seed = 3, .stddev = 0.05f}));
  ASSERT_TRUE(engine->config().has_recurrent_layers());
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < 2 * CpuEngine::kCheckpointInterval + 150; ++i)
    ids.push_back(int32_t((i * 7919 + 13) % engine->vocab_size()));
  auto pipe = make_cpu_pipeline(engine, {1, 3});
  auto a = engine->new_sequence();
  auto b = pipe->new_sequence();
  const std::vector<int32_t> head(ids.begin(), ids.begin() + 100), rest(ids.begin() + 100, ids.end());
  EXPECT_EQ(engine->forward(*a, head), pipe->forward(*b, head));
  EXPECT_EQ(engine->forward(*a, rest, true), pipe->forward(*b, rest, true));
  for (int64_t n : {int64_t(100), CpuEngine::kCheckpointInterval, 2 * CpuEngine::kCheckpointInterval})
    EXPECT_EQ(b->resume_point(n), n) << n;
  EXPECT_EQ(a->resume_point(2 * CpuEngine::kCheckpointInterval + 10), 2 * CpuEngine::kCheckpointInterval);
  EXPECT_EQ(b->resume_point(2 * CpuEngine::kCheckpointInterval + 10), 2 * CpuEngine::kCheckpointInterval);
  // Both resume from the middle checkpoint and continue identically.
  a->truncate(CpuEngine::kCheckpointInterval);
  b->truncate(CpuEngine::kCheckpointInterval);
  const std::vector<int32_t> again(ids.begin() + CpuEngine::kCheckpointInterval, ids.begin() + 2100);
  EXPECT_EQ(engine->forward(*a, again), pipe->forward(*b, again));
}

}  // namespace
}  // namespace moesrv
