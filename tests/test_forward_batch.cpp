// Engine::forward_batch on the CPU engine: one decode step of several sequences, each at its own length, gives every
// row exactly (bit for bit) the logits its sequence gets from a forward of that token alone.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "backend/cpu/cpu_engine.h"
#include "engine_test_util.h"
#include "model/synthetic_model.h"
#include "reference_util.h"

using namespace moesrv;
namespace mt = moesrv::testing;

namespace {

// Prompt i: `len` tokens of the reference input from offset 3 * i (different contents and lengths per sequence).
std::vector<int32_t> prompt_of(const std::vector<int32_t>& ids, size_t i, size_t len) {
  return std::vector<int32_t>(ids.begin() + 3 * i, ids.begin() + 3 * i + len);
}

class ForwardBatch : public ::testing::TestWithParam<std::string> {};

// B = 1..4 sequences of different lengths decode greedily together; a twin of each decodes alone. Sequences join
// the batch at different steps, so the batch's composition (and each row's place in it) changes over the run.
TEST_P(ForwardBatch, RowsMatchTheirSequenceAlone) {
  if (!std::filesystem::exists(mt::hf_tiny(GetParam()) + "/reference.safetensors")) GTEST_SKIP() << "no hf-tiny";
  auto engine = CpuEngine::open(mt::hf_tiny(GetParam()));
  const mt::Reference ref = mt::load_reference(GetParam());
  constexpr size_t kSeqs = 4;
  constexpr int kSteps = 6;
  std::vector<std::unique_ptr<SequenceState>> batched, alone;
  std::vector<int32_t> next_batched, next_alone;
  std::vector<std::vector<int32_t>> tokens_batched(kSeqs), tokens_alone(kSeqs);
  for (size_t i = 0; i < kSeqs; ++i) {
    const auto prompt = prompt_of(ref.input_ids, i, 9 + 5 * i);
    batched.push_back(engine->new_sequence());
    alone.push_back(engine->new_sequence());
    next_batched.push_back(moesrv::test::greedy(engine->forward(*batched.back(), prompt)));
    next_alone.push_back(moesrv::test::greedy(engine->forward(*alone.back(), prompt)));
  }
  for (int step = 0; step < kSteps + int(kSeqs); ++step) {
    // Sequence i is in the batch for steps [i, i + kSteps): B grows 1 -> 4, then shrinks.
    std::vector<SequenceState*> seqs;
    std::vector<int32_t> toks;
    std::vector<size_t> members;
    for (size_t i = 0; i < kSeqs; ++i)
      if (step >= int(i) && step < int(i) + kSteps) {
        members.push_back(i);
        seqs.push_back(batched[i].get());
        toks.push_back(next_batched[i]);
      }
    if (members.empty()) continue;
    const auto rows = engine->forward_batch(seqs, toks);
    ASSERT_EQ(rows.size(), members.size());
    for (size_t m = 0; m < members.size(); ++m) {
      const size_t i = members[m];
      const auto want = engine->forward(*alone[i], {next_alone[i]});
      ASSERT_EQ(rows[m], want) << "sequence " << i << " at step " << step << " (batch of " << members.size() << ")";
      EXPECT_EQ(batched[i]->length(), alone[i]->length());
      tokens_batched[i].push_back(next_batched[i] = moesrv::test::greedy(rows[m]));
      tokens_alone[i].push_back(next_alone[i] = moesrv::test::greedy(want));
    }
  }
  EXPECT_EQ(tokens_batched, tokens_alone);
}

// The sequences keep working alone afterwards: their state after batched steps is the state of single steps.
TEST_P(ForwardBatch, StateAfterBatchedStepsContinuesAlone) {
  if (!std::filesystem::exists(mt::hf_tiny(GetParam()) + "/reference.safetensors")) GTEST_SKIP() << "no hf-tiny";
  auto engine = CpuEngine::open(mt::hf_tiny(GetParam()));
  const mt::Reference ref = mt::load_reference(GetParam());
  auto a = engine->new_sequence(), b = engine->new_sequence(), solo = engine->new_sequence();
  const auto pa = prompt_of(ref.input_ids, 0, 12), pb = prompt_of(ref.input_ids, 1, 20);
  engine->forward(*a, pa);
  engine->forward(*b, pb);
  engine->forward(*solo, pa);
  for (int32_t t : {5, 7, 11}) {
    engine->forward_batch({a.get(), b.get()}, {t, t + 1});
    engine->forward(*solo, {t});
  }
  const std::vector<int32_t> tail(ref.input_ids.begin() + 30, ref.input_ids.begin() + 36);
  EXPECT_EQ(engine->forward(*a, tail, true), engine->forward(*solo, tail, true));
}

TEST(ForwardBatchChecks, RejectsARepeatedSequenceAndMismatchedSizes) {
  if (!std::filesystem::exists(mt::hf_tiny("deepseek_v3") + "/config.json")) GTEST_SKIP() << "no hf-tiny";
  auto engine = CpuEngine::open(mt::hf_tiny("deepseek_v3"));
  auto a = engine->new_sequence();
  EXPECT_THROW(engine->forward_batch({a.get(), a.get()}, {1, 2}), Error);
  EXPECT_THROW(engine->forward_batch({a.get()}, {1, 2}), Error);
  EXPECT_TRUE(engine->forward_batch({}, {}).empty());
}

// Opt-in (MOESRV_CPU_BENCH=1): decode tokens per second of B = 4 sequences stepped one by one and together, on a
// 2-layer GLM-5-width synthetic model (16 distinct expert weight sets behind its 256 experts).
TEST(ForwardBatchBench, DecodeTokensPerSecond) {
  if (!std::getenv("MOESRV_CPU_BENCH")) GTEST_SKIP() << "set MOESRV_CPU_BENCH=1";
  CpuEngine engine(make_synthetic_model(glm5_config(2, 16384), {.seed = 5, .distinct_experts = 16}));
  constexpr int kSeqs = 4, kSteps = 8;
  std::vector<std::unique_ptr<SequenceState>> seqs;
  std::vector<SequenceState*> ptrs;
  std::vector<int32_t> toks;
  for (int i = 0; i < kSeqs; ++i) {
    seqs.push_back(engine.new_sequence());
    ptrs.push_back(seqs.back().get());
    std::vector<int32_t> prompt = moesrv::test::bench_prompt(32 + 8 * size_t(i));
    for (int32_t& t : prompt) t %= 16384;
    toks.push_back(moesrv::test::greedy(engine.forward(*seqs.back(), prompt)));
  }
  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  for (int s = 0; s < kSteps; ++s)
    for (int i = 0; i < kSeqs; ++i) engine.forward(*seqs[size_t(i)], {toks[size_t(i)]});
  const double alone = kSeqs * kSteps / std::chrono::duration<double>(Clock::now() - t0).count();
  t0 = Clock::now();
  for (int s = 0; s < kSteps; ++s) engine.forward_batch(ptrs, toks);
  const double together = kSeqs * kSteps / std::chrono::duration<double>(Clock::now() - t0).count();
  std::cout << "decode tok/s, " << kSeqs << " sequences: one by one " << alone << ", forward_batch " << together
            << " (x" << together / alone << ")\n";
  RecordProperty("one_by_one_tok_s", std::to_string(alone));
  RecordProperty("batched_tok_s", std::to_string(together));
}

INSTANTIATE_TEST_SUITE_P(Models, ForwardBatch,
                         ::testing::Values("deepseek_v3", "glm_moe_dsa", "glm4_moe", "glm5_next", "qwen3_next"));

}  // namespace
