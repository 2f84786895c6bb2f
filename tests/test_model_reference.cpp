// The CPU forward must reproduce Hugging Face transformers' fp32 logits and greedy generations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "backend/cpu/cpu_engine.h"
#include "reference_util.h"

namespace moesrv {
namespace {

using namespace moesrv::testing;

class ModelReference : public ::testing::TestWithParam<std::string> {};


// DSA layers keep the index_topk best keys by indexer score. ReLU scores tie at exactly zero often; when the
// top-k boundary falls inside such a tie, the reference's choice comes from its sort internals. We mimic
// PyTorch's CPU topk (nth_element over (score, index)) and agree on most such rows, but not all; a different
// choice also perturbs later rows through the cache. So: every row before the first tie must match, and most
// rows after it.
constexpr double kTolerance = 2e-3;
constexpr double kMinMatchedAfterTie = 0.75;

// Compares every row of a one-pass forward over `ids` with the reference logits.
void expect_forward_matches(CpuEngine& engine, const std::vector<int32_t>& ids, const std::vector<float>& ref_logits) {
  const int64_t V = engine.vocab_size(), n = int64_t(ids.size());
  auto seq = engine.new_sequence();
  auto logits = engine.forward(*seq, ids, /*all_logits=*/true);
  ASSERT_EQ(int64_t(logits.size()), n * V);
  const auto ambiguous = engine.last_ambiguous_selection();
  int64_t after_tie = 0, matched_after_tie = 0;
  bool tied = false;
  for (int64_t r = 0; r < n; ++r) {
    tied |= ambiguous[size_t(r)] != 0;
    double err = max_rel_row_error(logits.data() + r * V, ref_logits.data() + r * V, 1, V);
    if (!tied) {
      EXPECT_LE(err, kTolerance) << "row " << r;
    } else {
      ++after_tie;
      matched_after_tie += err <= kTolerance;
    }
  }
  if (!engine.config().dsa) EXPECT_EQ(after_tie, 0);
  if (after_tie) {
    EXPECT_GE(double(matched_after_tie), kMinMatchedAfterTie * double(after_tie));
    std::printf("[ note ] %ld of %ld rows after the first tied DSA selection match\n", long(matched_after_tie), long(after_tie));
  }
}

TEST_P(ModelReference, FullSequenceLogitsMatch) {
  auto engine = CpuEngine::open(hf_tiny(GetParam()));
  Reference ref = load_reference(GetParam());
  expect_forward_matches(*engine, ref.input_ids, ref.logits);
}

// gen_logits are one forward pass over prompt + generated ids.
TEST_P(ModelReference, GenerationLogitsMatch) {
  auto engine = CpuEngine::open(hf_tiny(GetParam()));
  Reference ref = load_reference(GetParam());
  expect_forward_matches(*engine, ref.gen_ids, ref.gen_logits);
}

// gen_ids came from greedy generate() with a KV cache: prefill the 40-token prompt, then one token a step.
// Free-running, our greedy tokens must equal the reference's exactly. For DSA models tied selections in the
// prompt (see above) legitimately perturb the cache, so there the check is teacher-forced: feed the
// reference's tokens and require that our argmax agrees on most steps.
TEST_P(ModelReference, IncrementalDecodeReproducesGreedyGeneration) {
  auto engine = CpuEngine::open(hf_tiny(GetParam()));
  Reference ref = load_reference(GetParam());
  const int64_t V = engine->vocab_size(), prompt = 40, total = int64_t(ref.gen_ids.size());
  const std::vector<int32_t> head(ref.gen_ids.begin(), ref.gen_ids.begin() + prompt);
  const std::vector<int32_t> expected(ref.gen_ids.begin() + prompt, ref.gen_ids.end());

  auto seq = engine->new_sequence();
  auto logits = engine->forward(*seq, head);
  std::vector<int32_t> free_running;
  for (int64_t i = prompt; i < total; ++i) {
    free_running.push_back(argmax(logits.data(), V));
    logits = engine->forward(*seq, {free_running.back()});
  }
  EXPECT_EQ(seq->length(), total);
  if (!engine->config().dsa) EXPECT_EQ(free_running, expected);

  auto forced = engine->new_sequence();
  logits = engine->forward(*forced, head);
  int64_t agree = 0;
  for (int64_t i = prompt; i < total; ++i) {
    agree += argmax(logits.data(), V) == ref.gen_ids[size_t(i)];
    logits = engine->forward(*forced, {ref.gen_ids[size_t(i)]});
  }
  if (engine->config().dsa) {
    EXPECT_GE(double(agree), kMinMatchedAfterTie * double(total - prompt));
    std::printf("[ note ] %s: teacher-forced greedy agrees on %ld of %ld steps\n", GetParam().c_str(), long(agree),
                long(total - prompt));
  } else {
    EXPECT_EQ(agree, total - prompt);
  }
}

TEST_P(ModelReference, TruncateAndCloneReplayIdentically) {
  auto engine = CpuEngine::open(hf_tiny(GetParam()));
  Reference ref = load_reference(GetParam());
  auto seq = engine->new_sequence();
  std::vector<int32_t> a(ref.input_ids.begin(), ref.input_ids.begin() + 20), b(ref.input_ids.begin() + 20, ref.input_ids.begin() + 30);
  engine->forward(*seq, a);
  auto snapshot = seq->clone();
  auto first = engine->forward(*seq, b);
  seq->truncate(20);
  auto again = engine->forward(*seq, b);
  auto from_clone = engine->forward(*snapshot, b);
  EXPECT_EQ(first, again);
  EXPECT_EQ(first, from_clone);
}

INSTANTIATE_TEST_SUITE_P(HfTiny, ModelReference,
                         ::testing::Values("deepseek_v3", "deepseek_v3_yarn", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa"));

}  // namespace
}  // namespace moesrv
