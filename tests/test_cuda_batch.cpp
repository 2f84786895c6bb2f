// Several sequences on one CUDA engine: forward_batch (one pass for up to 4 sequences' decode steps) against each
// sequence alone, and the server's --max-batch (serving/batch_runner.h): members generating on their own threads give
// exactly the tokens each gives alone, while other threads create, clone, truncate and free sequences of the same
// engine (the prefix cache's work). Skipped without CUDA or a device.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "backend/cuda/cuda_engine.h"
#include "cuda_test_util.h"
#include "engine_test_util.h"
#include "reference_util.h"
#include "serving/batch_runner.h"
#include "serving/sampler.h"

namespace moesrv {
namespace {

#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA

class CudaBatch : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaBatch, ConcurrentMembersMatchEachAloneWhileOthersTouchSequences) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA backend or device";
  CudaEngineOptions opt;
  opt.max_ctx = 256;
  CudaEngine engine(ModelPackage::open(testing::hf_tiny(GetParam())), opt);
  ASSERT_TRUE(engine.concurrent_sequence_ops());
  const auto ids = testing::load_reference(GetParam()).input_ids;
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < 4; ++i)
    prompts.emplace_back(ids.begin() + long(i), ids.begin() + long(std::min(ids.size(), 9 + 5 * i)));
  std::vector<std::vector<int32_t>> alone;
  for (const auto& p : prompts) alone.push_back(test::greedy_tokens(engine, p, 14));

  BatchRunner runner(engine, 4, std::chrono::microseconds(2000));
  std::vector<std::vector<int32_t>> together(prompts.size());
  std::atomic<bool> stop{false};
  std::thread toucher([&] {  // sequence operations of other requests (prefix cache snapshots) meanwhile
    auto base = engine.new_sequence();
    engine.forward(*base, prompts[0]);
    while (!stop) {
      auto copy = base->clone();
      copy->truncate(copy->resume_point(3));
      copy->checkpoint();
      auto fresh = engine.new_sequence();
    }
  });
  std::vector<std::thread> members;
  for (size_t i = 0; i < prompts.size(); ++i)
    members.emplace_back([&, i] {
      auto m = runner.join();
      together[i] = test::greedy_tokens(*m, prompts[i], 14);
    });
  for (auto& t : members) t.join();
  stop = true;
  toucher.join();
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(together[i], alone[i]) << "request " << i;
  EXPECT_GT(runner.stats().decode_steps, 0u);
}

// One decode step of B sequences at different lengths (B = 2..6: one pass of up to 4 rows, then the rest) gives each
// sequence the logits its own forward gives, and leaves each state where that forward leaves it (the next steps
// agree too); with graphs (per set of sequences) and without. Then the same with every expert in host memory and
// lent slots, a 40-token prompt between two steps taking the lent arena back.
TEST_P(CudaBatch, ForwardBatchMatchesEachSequenceAlone) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA backend or device";
  const std::string dir = testing::hf_tiny(GetParam());
  CudaEngineOptions plain;
  plain.max_ctx = 256;
  for (bool lent : {false, true}) {
    CudaEngine engine(ModelPackage::open(dir), lent ? test::with_lent_slots(dir, plain) : plain);
    const auto ids = testing::load_reference(GetParam()).input_ids;
    for (bool graphs : {true, false}) {
      engine.set_use_graph(graphs);
      for (size_t B : {2, 3, 4, 6}) {
        std::vector<std::unique_ptr<SequenceState>> seqs, alone;
        std::vector<int32_t> next;
        for (size_t i = 0; i < B; ++i) {
          seqs.push_back(engine.new_sequence());
          engine.forward(*seqs.back(), std::vector<int32_t>(ids.begin() + long(i), ids.begin() + long(5 + 3 * i)));
          alone.push_back(seqs.back()->clone());
          next.push_back(int32_t((7 + 13 * i) % 200));
        }
        std::vector<SequenceState*> ptrs;
        for (auto& q : seqs) ptrs.push_back(q.get());
        for (int step = 0; step < 3; ++step) {
          if (lent && step == 1) {  // a prompt between the steps: the lent slots go and come back
            auto other = engine.new_sequence();
            engine.forward(*other, std::vector<int32_t>(ids.begin(), ids.begin() + 40));
          }
          auto out = engine.forward_batch(ptrs, next);
          ASSERT_EQ(out.size(), B);
          for (size_t i = 0; i < B; ++i) {
            auto ref = engine.forward(*alone[i], {next[i]});
            EXPECT_LT(testing::rel_l2_diff(out[i], ref), 1e-4)
                << "graphs " << graphs << " B " << B << " row " << i << " step " << step;
            EXPECT_EQ(seqs[i]->length(), alone[i]->length());
            next[i] = argmax(ref);
          }
        }
      }
    }
    if (lent) {
      EXPECT_GT(engine.stats().lent_slots, 0);
      EXPECT_GT(engine.stats().arena_switches, 0);
      continue;
    }
    std::vector<std::unique_ptr<SequenceState>> two;
    two.push_back(engine.new_sequence());
    engine.forward(*two[0], {1, 2, 3});
    EXPECT_THROW(engine.forward_batch({two[0].get(), two[0].get()}, {4, 5}),
                 std::exception);                          // the same sequence twice
    EXPECT_GE(engine.sequence_bytes(1), two[0]->bytes());  // what admission reserves covers a sequence's device bytes
  }
}

INSTANTIATE_TEST_SUITE_P(TinyModels, CudaBatch,
                         ::testing::Values("glm5_next", "glm5_next_clamp", "deepseek_v3", "glm4_moe", "glm_moe_dsa",
                                           "qwen3_next"));

#else

TEST(CudaBatch, SkippedWithoutCudaBuild) {
  EXPECT_FALSE(cuda_available());
  GTEST_SKIP() << "built without MOESRV_CUDA";
}

#endif

}  // namespace
}  // namespace moesrv
