#include <gtest/gtest.h>

#include <filesystem>

#include "backend/cpu/cpu_engine.h"
#include "reference_util.h"
#include "server/generator.h"
#include "server_test_doubles.h"
#include "serving/prefix_cache.h"

using namespace moesrv;
using moesrv::testing::ScriptedSequence;

namespace {
std::unique_ptr<SequenceState> seq_of(const std::vector<int32_t>& t) {
  auto s = std::make_unique<ScriptedSequence>();
  s->tokens = t;
  return s;
}
const std::vector<int32_t>& tokens_of(const SequenceState& s) { return static_cast<const ScriptedSequence&>(s).tokens; }
}  // namespace

TEST(PrefixCache, FullMatchMovesPartialMatchClones) {
  PrefixCache cache(1 << 20);
  cache.insert({1, 2, 3, 4}, seq_of({1, 2, 3, 4}));
  auto partial = cache.acquire({1, 2, 9, 9}, 3);
  EXPECT_EQ(partial.reused, 2);
  EXPECT_EQ(tokens_of(*partial.state), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(cache.entries(), 1u);  // the original stays
  auto full = cache.acquire({1, 2, 3, 4, 5}, 4);
  EXPECT_EQ(full.reused, 4);
  EXPECT_EQ(cache.entries(), 0u);  // handed over
  auto miss = cache.acquire({7}, 0);
  EXPECT_EQ(miss.reused, 0);
  EXPECT_FALSE(miss.state);
}

TEST(PrefixCache, MaxReuseLeavesATokenToCompute) {
  PrefixCache cache(1 << 20);
  cache.insert({1, 2, 3}, seq_of({1, 2, 3}));
  auto hit = cache.acquire({1, 2, 3}, 2);  // same prompt again: reuse 2, recompute the last
  EXPECT_EQ(hit.reused, 2);
  EXPECT_EQ(hit.state->length(), 2);
}

TEST(PrefixCache, LongestPrefixWinsAndRedundantEntriesAreDropped) {
  PrefixCache cache(1 << 20);
  cache.insert({1, 2}, seq_of({1, 2}));
  cache.insert({5, 6, 7}, seq_of({5, 6, 7}));
  cache.insert({1, 2, 3, 4}, seq_of({1, 2, 3, 4}));  // supersedes {1,2}
  EXPECT_EQ(cache.entries(), 2u);
  EXPECT_EQ(cache.acquire({1, 2, 3, 8}, 3).reused, 3);
  EXPECT_EQ(cache.acquire({5, 6, 0}, 2).reused, 2);
}

TEST(PrefixCache, LruEvictionUnderTheByteBound) {
  PrefixCache cache(10000);  // ScriptedSequence: 1000 bytes per token
  cache.insert({1, 1, 1, 1}, seq_of({1, 1, 1, 1}));
  cache.insert({2, 2, 2, 2}, seq_of({2, 2, 2, 2}));
  EXPECT_EQ(cache.acquire({1, 1, 9}, 2).reused, 2);  // touch {1..}: {2..} is now least recent
  cache.insert({3, 3, 3, 3}, seq_of({3, 3, 3, 3}));
  EXPECT_LE(cache.bytes(), 10000u);
  EXPECT_EQ(cache.acquire({2, 2, 9}, 2).reused, 0);
  EXPECT_EQ(cache.acquire({1, 1, 9}, 2).reused, 2);
  cache.insert(std::vector<int32_t>(20, 4), seq_of(std::vector<int32_t>(20, 4)));  // larger than the bound
  EXPECT_EQ(cache.acquire(std::vector<int32_t>(20, 4), 19).reused, 0);
}

namespace {
// Records the token count of every forward call; the next token is always 1.
class CallSizeEngine : public Engine {
 public:
  explicit CallSizeEngine(int64_t chunk) : chunk_(chunk) {}
  std::string name() const override { return "call-sizes"; }
  int64_t vocab_size() const override { return 4; }
  int64_t max_context() const override { return 1 << 20; }
  int64_t prefill_chunk() const override { return chunk_; }
  std::unique_ptr<SequenceState> new_sequence() const override { return std::make_unique<ScriptedSequence>(); }
  std::vector<float> forward(SequenceState& s, const std::vector<int32_t>& tokens, bool) override {
    auto& seq = static_cast<ScriptedSequence&>(s);
    seq.tokens.insert(seq.tokens.end(), tokens.begin(), tokens.end());
    calls.push_back(int64_t(tokens.size()));
    return {0.0f, 1.0f, 0.0f, 0.0f};
  }
  std::vector<int64_t> calls;

 private:
  int64_t chunk_;
};
struct NoHooks : DecodeHooks {
  bool on_token(int32_t) override { return true; }
};
}  // namespace

// The generator cuts a prompt at the engine's pass length unless told otherwise: a GPU engine's prefill pass (its
// expert plan, a hybrid engine's expert transfers) then runs once per 8K tokens, not once per 512.
TEST(Generator, PrefillCallsFollowTheEnginePassLength) {
  const std::vector<int32_t> prompt(23, 2);
  Sampler greedy({.temperature = 0});
  NoHooks hooks;
  CallSizeEngine by_engine(10);
  generate(by_engine, nullptr, prompt, 2, greedy, hooks);
  EXPECT_EQ(by_engine.calls, (std::vector<int64_t>{10, 10, 3, 1}));  // prompt in pass-sized calls, then a token
  CallSizeEngine fixed(10);
  generate(fixed, nullptr, prompt, 2, greedy, hooks, {.prefill_chunk = 4});
  EXPECT_EQ(fixed.calls, (std::vector<int64_t>{4, 4, 4, 4, 4, 3, 1}));
}

namespace {
// Greedy decoding that records each generated token and the logits it was picked from.
struct Recorder : DecodeHooks {
  std::vector<int32_t> ids;
  std::vector<float> logits;
  void on_sampled(std::span<const float> l, int32_t) override { logits.insert(logits.end(), l.begin(), l.end()); }
  bool on_token(int32_t id) override {
    ids.push_back(id);
    return true;
  }
};
struct Decoded {
  GenerationResult r;
  Recorder rec;
};
namespace mt = moesrv::testing;
Decoded run(Engine& e, PrefixCache& cache, const std::vector<int32_t>& prompt, int64_t steps) {
  Decoded out;
  Sampler greedy({.temperature = 0});
  out.r = generate(e, &cache, prompt, steps, greedy, out.rec, {.prefill_chunk = 16});
  return out;
}
}  // namespace

// Hybrid models (linear-attention layers: recurrent + conv state, resumable only at checkpoints). The same prompt
// twice reuses all but its last token and decodes exactly as the cold run, which equals transformers' greedy
// tokens; a follow-up turn resumes at the end of the prompt or of the answer. Checkpoints count as cache memory.
class HybridPrefixCache : public ::testing::TestWithParam<std::string> {};

TEST_P(HybridPrefixCache, SamePromptTwiceReusesAllButTheLastToken) {
  if (!std::filesystem::exists(mt::hf_tiny(GetParam()) + "/reference.safetensors")) GTEST_SKIP() << "no hf-tiny";
  auto engine = CpuEngine::open(mt::hf_tiny(GetParam()));
  const mt::Reference ref = mt::load_reference(GetParam());
  const std::vector<int32_t> prompt(ref.gen_ids.begin(), ref.gen_ids.begin() + ref.prompt_len);
  const std::vector<int32_t> want(ref.gen_ids.begin() + ref.prompt_len, ref.gen_ids.end());
  const int64_t n = int64_t(prompt.size()), steps = int64_t(want.size()), V = engine->vocab_size();
  PrefixCache cache(size_t(1) << 30);

  Decoded cold = run(*engine, cache, prompt, steps);
  EXPECT_EQ(cold.r.cached_tokens, 0);
  EXPECT_EQ(cold.rec.ids, want);  // transformers' greedy continuation
  Decoded warm = run(*engine, cache, prompt, steps);
  EXPECT_EQ(warm.r.cached_tokens, n - 1);
  EXPECT_EQ(warm.rec.ids, want);
  EXPECT_EQ(warm.rec.logits, cold.rec.logits);  // resumed from an exact copy of the state

  // The entry (prompt + answer but its last token) counts its checkpoints of the fixed-size state in its bytes:
  // chunk ends 16, 32, ..., then prompt - 1 and prompt; each a copy of the recurrent + conv state (+ open k-pool).
  std::vector<int32_t> history = prompt;
  history.insert(history.end(), want.begin(), want.end() - 1);
  const size_t cached_bytes = cache.bytes();
  auto whole = cache.acquire(history, int64_t(history.size()));
  ASSERT_EQ(whole.reused, int64_t(history.size()));
  const auto& cpu = static_cast<const CpuSequence&>(*whole.state);
  EXPECT_EQ(cached_bytes, cpu.bytes());
  size_t live = 0, recurrent = 0;
  for (const auto& L : cpu.layers) {
    live += L.bytes();
    recurrent += (L[StateSlot::Conv].size() + L[StateSlot::Recurrent].size()) * sizeof(float);
  }
  const size_t checkpoints = size_t((n - 2) / 16) + 2;
  EXPECT_GT(recurrent, 0u);
  EXPECT_GE(cached_bytes - live, checkpoints * recurrent);
  EXPECT_LT(cached_bytes - live, (checkpoints + 1) * recurrent);
  EXPECT_EQ(cpu.resume_point(n - 1), n - 1);
  EXPECT_EQ(cpu.resume_point(n), n);
  cache.insert(history, std::move(whole.state));

  // Follow-ups: diverging inside the answer resumes at the prompt's end, continuing it at the answer's end;
  // both give a cold run's logits (one full forward, no cache).
  for (int64_t keep : {int64_t(2), steps - 1}) {
    std::vector<int32_t> follow(history.begin(), history.begin() + n + keep);
    follow.insert(follow.end(), ref.input_ids.begin(), ref.input_ids.begin() + 20);
    Decoded f = run(*engine, cache, follow, 3);
    EXPECT_EQ(f.r.cached_tokens, keep == 2 ? n : n + keep);
    std::vector<int32_t> all = follow;
    all.insert(all.end(), f.rec.ids.begin(), f.rec.ids.end() - 1);
    auto seq = engine->new_sequence();
    const auto full = engine->forward(*seq, all, true);
    const std::vector<float> tail(full.end() - 3 * V, full.end());
    EXPECT_LE(mt::max_rel_row_error(f.rec.logits.data(), tail.data(), 3, V), 1e-4) << keep;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, HybridPrefixCache, ::testing::Values("glm5_next", "qwen3_next"));
