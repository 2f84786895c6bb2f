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
// Once a DSA selection was tied (see above), our cache may legitimately differ from the reference's, so the
// comparison covers the tokens generated before the first tie.
TEST_P(ModelReference, IncrementalDecodeReproducesGreedyGeneration) {
  auto engine = CpuEngine::open(hf_tiny(GetParam()));
  Reference ref = load_reference(GetParam());
  const int64_t V = engine->vocab_size(), prompt = 40, total = int64_t(ref.gen_ids.size());
  auto seq = engine->new_sequence();
  std::vector<int32_t> head(ref.gen_ids.begin(), ref.gen_ids.begin() + prompt);
  auto logits = engine->forward(*seq, head);
  auto any_tie = [&] {
    const auto& a = engine->last_ambiguous_selection();
    return std::find(a.begin(), a.end(), 1) != a.end();
  };
  bool tied = any_tie();
  int64_t compared = 0;
  for (int64_t i = prompt; i < total; ++i) {
    int32_t next = argmax(logits.data(), V);
    if (!tied) {
      EXPECT_EQ(next, ref.gen_ids[size_t(i)]) << "greedy token " << i;
      ++compared;
    }
    logits = engine->forward(*seq, {next});
    tied |= any_tie();
  }
  EXPECT_EQ(seq->length(), total);
  if (!engine->config().dsa) EXPECT_EQ(compared, total - prompt);
  if (compared < total - prompt) std::printf("[ note ] %s: %ld of %ld greedy tokens compared (tied DSA selection)\n",
                                             GetParam().c_str(), long(compared), long(total - prompt));
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
