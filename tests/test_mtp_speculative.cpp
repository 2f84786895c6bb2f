// Speculative decoding with the MTP block on the CPU engine: greedy output equal to plain decoding for k = 1..3 on
// three tiny models with a random MTP block, forced acceptance (a draft picker that knows the greedy tokens) to
// commit several tokens per step, exact rollback of recurrent / conv / k-pool state, the MTP forward's own
// consistency, and the sampled path end to end.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>

#include "backend/cpu/cpu_engine.h"
#include "engine_test_util.h"
#include "mtp_test_checks.h"
#include "mtp_test_model.h"
#include "reference_util.h"
#include "server/generator.h"
#include "serving/speculative.h"

namespace moesrv {
namespace {

using testing::copy_with_mtp;
using testing::hf_tiny;

// The engine maps its files, so the copy's folder goes as soon as it is open.
struct MtpModel {
  std::unique_ptr<CpuEngine> engine;
};

MtpModel open_with_mtp(const std::string& model, bool with_head = false) {
  const std::string dir = copy_with_mtp(hf_tiny(model), model, 1234, with_head);
  MtpModel m{CpuEngine::open(dir)};
  std::filesystem::remove_all(dir);
  return m;
}

std::vector<int32_t> prompt_of(const std::string& model, size_t n) { return testing::reference_prompt(model, n); }
std::vector<int32_t> plain_greedy(Engine& e, const std::vector<int32_t>& prompt, int64_t n) {
  return test::greedy_tokens(e, prompt, n);
}

Sampler greedy_sampler() { return Sampler(SamplingParams{.temperature = 0.0f}); }

class MtpGreedy : public ::testing::TestWithParam<std::string> {};

TEST_P(MtpGreedy, SameTokensAsPlainDecodingForK1To3) {
  MtpModel m = open_with_mtp(GetParam(), GetParam() == "deepseek_v3");
  ASSERT_NE(m.engine->mtp(), nullptr);
  const auto prompt = prompt_of(GetParam(), 19);
  const auto plain = plain_greedy(*m.engine, prompt, 24);
  for (int k = 1; k <= 3; ++k) {
    Sampler s = greedy_sampler();
    SpeculativeStats stats;
    EXPECT_EQ(generate_speculative(*m.engine, prompt, 24, s, k, &stats), plain) << "k = " << k;
    EXPECT_GT(stats.steps, 0);
    EXPECT_EQ(stats.drafted > 0, true);
  }
}

// With a draft policy the steps draft 0..k tokens (plain steps among them: the random MTP block's drafts are rarely
// accepted, and the policy's warm-up runs two); the tokens stay plain greedy decoding's.
TEST_P(MtpGreedy, AdaptiveDraftLengthKeepsTheTokens) {
  MtpModel m = open_with_mtp(GetParam(), GetParam() == "deepseek_v3");
  const auto prompt = prompt_of(GetParam(), 19);
  const auto plain = plain_greedy(*m.engine, prompt, 40);
  for (int k = 1; k <= 3; ++k) {
    Sampler s = greedy_sampler();
    SpeculativeStats stats;
    auto policy = std::make_shared<DraftPolicy>(k);
    EXPECT_EQ(generate_speculative(*m.engine, prompt, 40, s, k, &stats, {}, policy), plain) << "k = " << k;
    EXPECT_GE(stats.plain, DraftPolicy::kWarmupSteps) << "k = " << k;
    EXPECT_GE(policy->step_seconds(0), 0.0);
    EXPECT_GE(policy->step_seconds(k), 0.0);
  }
}

// Drafts from a picker that knows the greedy tokens: every draft is accepted (several tokens per step), or, with
// every third position corrupted, a prefix is; either way the output is plain greedy decoding's.
TEST_P(MtpGreedy, ForcedAcceptanceCommitsSeveralTokensPerStep) {
  MtpModel m = open_with_mtp(GetParam());
  const auto prompt = prompt_of(GetParam(), 17);
  const auto plain = plain_greedy(*m.engine, prompt, 24);
  testing::expect_forced_acceptance(*m.engine, prompt, plain);
}

// glm4_moe (GQA, GLM-4.5's MTP layout) and glm_moe_dsa_h16 (MLA + per-token DSA indexer keys) as well.
INSTANTIATE_TEST_SUITE_P(TinyModels, MtpGreedy,
                         ::testing::Values("glm5_next", "glm5_next_clamp", "deepseek_v3", "glm4_moe",
                                           "glm_moe_dsa_h16"));

CpuSequence& cpu(SequenceState& s) { return dynamic_cast<CpuSequence&>(s); }

void expect_same_state(CpuSequence& a, CpuSequence& b) {
  ASSERT_EQ(a.length(), b.length());
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const auto &x = a.layers[l], &y = b.layers[l];
    for (StateSlot s : {StateSlot::Recurrent, StateSlot::Conv, StateSlot::Open, StateSlot::OpenG, StateSlot::PoolK,
                        StateSlot::Kv, StateSlot::IndexK})
      EXPECT_EQ(x[s], y[s]) << "layer " << l << " slot " << int(s);  // bit for bit
  }
}

// A verify of 4 tokens cut back to 1, 2 or 3 of them holds the state of a plain run over those tokens, bit for bit
// (KDA recurrent + conv state, the k-pool's open pool across a pool boundary, the MLA cache), and goes on to the same
// logits; the verify's own logits equal the single steps'.
TEST(MtpRollback, RejectedDraftsLeaveTheStateOfThePlainRun) {
  MtpModel m = open_with_mtp("glm5_next");
  MtpEngine& mtp = *m.engine->mtp();
  const auto prompt = prompt_of("glm5_next", 18);  // the verify crosses the pool boundary at 20 (k-pool 4)
  const std::vector<int32_t> window{5, 77, 300, 9};
  auto plain = m.engine->new_sequence();
  m.engine->forward(*plain, prompt);
  std::vector<std::vector<float>> step_logits;
  std::vector<std::unique_ptr<SequenceState>> after;  // plain state after 1..4 window tokens
  for (int32_t t : window) {
    step_logits.push_back(m.engine->forward(*plain, {t}));
    after.push_back(plain->clone());
  }
  for (int64_t keep = 1; keep <= 4; ++keep) {
    auto seq = m.engine->new_sequence();
    m.engine->forward(*seq, prompt);
    std::vector<float> hidden;
    auto logits = mtp.forward_hidden(*seq, window, true, true, hidden);
    ASSERT_EQ(hidden.size(), size_t(4 * mtp.hidden_size()));
    const size_t V = size_t(m.engine->vocab_size());
    for (size_t j = 0; j < 4; ++j)
      EXPECT_EQ(std::vector<float>(logits.begin() + long(j * V), logits.begin() + long((j + 1) * V)), step_logits[j]);
    EXPECT_EQ(seq->resume_point(int64_t(prompt.size()) + keep), int64_t(prompt.size()) + keep);
    seq->truncate(int64_t(prompt.size()) + keep);
    expect_same_state(cpu(*seq), cpu(*after[size_t(keep - 1)]));
    auto next_a = m.engine->forward(*seq, {42});
    auto b = after[size_t(keep - 1)]->clone();
    EXPECT_EQ(next_a, m.engine->forward(*b, {42})) << "keep " << keep;
  }
}

// The MTP block's own cache after steps with partly accepted drafts (its chained draft positions cut again) holds
// what an MTP run over the committed positions, fed the model's hidden states, holds. `max_draft(i)` bounds step i's
// drafts: 0 makes a plain step, whose MTP catch-up a later step runs (several rows in one forward).
void expect_mtp_cache_of_committed_positions(int64_t tokens, const std::function<int64_t(int64_t)>& max_draft) {
  MtpModel m = open_with_mtp("glm5_next");
  MtpEngine& mtp = *m.engine->mtp();
  const auto prompt = prompt_of("glm5_next", 14);
  const auto plain = plain_greedy(*m.engine, prompt, tokens);
  std::vector<int32_t> full = prompt;
  full.insert(full.end(), plain.begin(), plain.end());
  auto picker = [&](int64_t pos, std::span<const float>) {
    const int32_t t = pos < int64_t(full.size()) ? full[size_t(pos)] : 0;
    return pos % 3 == 0 ? (t + 1) % 1024 : t;
  };
  SpeculativeDecoder dec(*m.engine, 3, picker);
  auto seq = m.engine->new_sequence();
  std::vector<int32_t> out{argmax(dec.prefill(*seq, prompt))};
  for (int64_t i = 0; out.size() < plain.size(); ++i) {
    auto st = dec.step(*seq, out.back(), std::min(max_draft(i), int64_t(plain.size() - out.size()) - 1));
    const size_t V = st.logits.size() / (st.draft.size() + 1);
    int64_t accepted = 0;
    for (size_t j = 0; j <= st.draft.size(); ++j) {
      out.push_back(argmax(std::span<const float>(st.logits.data() + j * V, V)));
      if (j == st.draft.size() || out.back() != st.draft[j]) break;
      ++accepted;
    }
    dec.commit(*seq, accepted);
  }
  ASSERT_EQ(out, plain);
  EXPECT_GT(dec.stats().accepted, 0);
  EXPECT_LT(dec.stats().accepted, dec.stats().drafted);
  EXPECT_EQ(dec.stats().plain > 0, max_draft(0) == 0);

  // The model's hidden states: the prompt's prefill, then single steps (a verify equals those bit for bit).
  auto ref = m.engine->new_sequence();
  std::vector<float> hidden, h;
  mtp.forward_hidden(*ref, prompt, false, false, hidden);
  for (size_t i = 0; i + 1 < out.size(); ++i) {
    mtp.forward_hidden(*ref, {out[i]}, false, false, h);
    hidden.insert(hidden.end(), h.begin(), h.end());
  }
  const int64_t D = mtp.hidden_size(), n = dec.mtp_state().length();
  ASSERT_GT(n, int64_t(prompt.size()));
  auto mref = mtp.new_mtp_sequence();
  std::vector<float> g;
  for (int64_t p = 0; p < n; ++p)
    mtp.mtp_forward(*mref, {full[size_t(p + 1)]},
                    std::vector<float>(hidden.begin() + p * D, hidden.begin() + (p + 1) * D), g);
  const auto& a = dynamic_cast<const CpuSequence&>(dec.mtp_state()).layers[0];
  const auto& b = cpu(*mref).layers[0];
  for (StateSlot s : {StateSlot::Kv, StateSlot::PoolK, StateSlot::Open}) {
    ASSERT_EQ(a[s].size(), b[s].size());
    for (size_t i = 0; i < a[s].size(); ++i) ASSERT_NEAR(a[s][i], b[s][i], 1e-5f) << i;
  }
  ASSERT_EQ(a[StateSlot::OpenG].size(), b[StateSlot::OpenG].size());
}

TEST(MtpRollback, MtpCacheMatchesARunOverTheCommittedPositions) {
  expect_mtp_cache_of_committed_positions(16, [](int64_t) { return int64_t(3); });
}

// Plain steps (no drafts: the draft policy's choice when drafts are rarely accepted) leave the MTP block's catch-up to
// the next step that drafts, or to the step where kMaxDeferredRows wait; the cache ends the same.
TEST(MtpRollback, PlainStepsDeferTheMtpCatchUp) {
  const int64_t flush = SpeculativeDecoder::kMaxDeferredRows;
  expect_mtp_cache_of_committed_positions(flush + 24, [flush](int64_t i) {
    if (i < flush + 3) return int64_t(0);  // one catch-up at kMaxDeferredRows, then rows pending again
    return i % 4 < 2 ? int64_t(0) : int64_t(3);
  });
}

// The same for Gated DeltaNet (qwen3_next, no MTP block: the verify forward is the engine's own).
TEST(MtpRollback, GatedDeltaNetStateToo) {
  auto e = CpuEngine::open(hf_tiny("qwen3_next"));
  const auto prompt = prompt_of("qwen3_next", 13);
  const std::vector<int32_t> window{11, 12, 13};
  auto plain = e->new_sequence();
  e->forward(*plain, prompt);
  std::vector<std::vector<float>> step_logits;
  std::vector<std::unique_ptr<SequenceState>> after;
  for (int32_t t : window) {
    step_logits.push_back(e->forward(*plain, {t}));
    after.push_back(plain->clone());
  }
  for (int64_t keep = 1; keep <= 3; ++keep) {
    auto seq = e->new_sequence();
    e->forward(*seq, prompt);
    std::vector<float> hidden;
    auto logits = e->forward_hidden(*seq, window, true, true, hidden);
    const size_t V = size_t(e->vocab_size());
    for (size_t j = 0; j < 3; ++j)
      EXPECT_EQ(std::vector<float>(logits.begin() + long(j * V), logits.begin() + long((j + 1) * V)), step_logits[j]);
    seq->truncate(int64_t(prompt.size()) + keep);
    expect_same_state(cpu(*seq), cpu(*after[size_t(keep - 1)]));
  }
}

// The MTP block over n positions at once equals n single positions (logits and the chained hidden state), and the
// token paired with position 0 is masked (its embedding zeroed).
TEST(MtpForward, BatchEqualsSinglePositionsAndPositionZeroIsMasked) {
  for (const char* model : {"glm5_next", "deepseek_v3"}) {
    MtpModel m = open_with_mtp(model);
    MtpEngine& mtp = *m.engine->mtp();
    const auto prompt = prompt_of(model, 9);
    auto seq = m.engine->new_sequence();
    std::vector<float> hidden, h_all, h_one;
    mtp.forward_hidden(*seq, prompt, false, false, hidden);
    const int64_t D = mtp.hidden_size(), n = int64_t(prompt.size()) - 1;
    const std::vector<int32_t> next(prompt.begin() + 1, prompt.end());
    auto all = mtp.new_mtp_sequence();
    auto l_all = mtp.mtp_forward(*all, next, std::vector<float>(hidden.begin(), hidden.begin() + n * D), h_all);
    auto one = mtp.new_mtp_sequence();
    std::vector<float> l_one;
    for (int64_t i = 0; i < n; ++i)
      l_one = mtp.mtp_forward(*one, {next[size_t(i)]},
                              std::vector<float>(hidden.begin() + i * D, hidden.begin() + (i + 1) * D), h_one);
    EXPECT_EQ(all->length(), n);
    for (size_t i = 0; i < l_all.size(); ++i) ASSERT_NEAR(l_all[i], l_one[i], 1e-4f) << model;
    for (size_t i = 0; i < h_all.size(); ++i) ASSERT_NEAR(h_all[i], h_one[i], 1e-4f) << model;

    std::vector<float> h0(hidden.begin(), hidden.begin() + D), ha, hb;
    auto a = mtp.new_mtp_sequence(), b = mtp.new_mtp_sequence();
    EXPECT_EQ(mtp.mtp_forward(*a, {3}, h0, ha), mtp.mtp_forward(*b, {700}, h0, hb)) << model;
    EXPECT_NE(mtp.mtp_forward(*a, {3}, h0, ha), mtp.mtp_forward(*b, {700}, h0, hb)) << model;  // position 1: not
  }
}

TEST(MtpForward, OnlyWhenThePackageHasTheBlock) {
  auto plain = CpuEngine::open(hf_tiny("deepseek_v3"));  // num_nextn_predict_layers 1, no layer-4 tensors
  EXPECT_EQ(plain->mtp(), nullptr);
  Sampler s = greedy_sampler();
  EXPECT_THROW(generate_speculative(*plain, {1, 2, 3}, 4, s, 2), std::exception);
}

// Sampling (temperature 0.8, top-k 50, seeded): the speculative path runs end to end, in the vocabulary, and a seed
// reproduces it (the acceptance rule itself: test_sampler's AcceptDraftKeepsTheTargetDistribution).
TEST(MtpSampled, SeededRunIsReproducible) {
  MtpModel m = open_with_mtp("glm5_next_clamp");
  const auto prompt = prompt_of("glm5_next_clamp", 12);
  auto run = [&](int k) {
    Sampler s(SamplingParams{.temperature = 0.8f, .top_k = 50, .seed = 7});
    SpeculativeStats stats;
    auto out = generate_speculative(*m.engine, prompt, 20, s, k, &stats);
    EXPECT_EQ(out.size(), 20u);
    for (int32_t t : out) EXPECT_TRUE(t >= 0 && t < 1024);
    return out;
  };
  EXPECT_EQ(run(2), run(2));
}

// The server's decode loop with MTP drafts: the same greedy tokens as its plain loop, through the hooks (a mask that
// forbids the plain run's 5th token and a stop after 20 tokens), with the drafting counted.
struct CollectHooks : DecodeHooks {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  int64_t stop_after = 20;
  bool logits = true;   // wants_logits()
  int64_t no_rows = 0;  // on_sampled calls without the logits
  const std::vector<uint8_t>* allowed_tokens() override { return mask.empty() ? nullptr : &mask; }
  bool wants_logits() const override { return logits; }
  void on_sampled(std::span<const float> row, int32_t) override { no_rows += row.empty() ? 1 : 0; }
  bool on_token(int32_t id) override {
    tokens.push_back(id);
    return int64_t(tokens.size()) < stop_after;
  }
};

TEST(MtpServerLoop, SameTokensAsThePlainLoopThroughTheHooks) {
  MtpModel m = open_with_mtp("glm5_next_clamp");
  const auto prompt = prompt_of("glm5_next_clamp", 15);
  for (bool masked : {false, true}) {
    CollectHooks plain_hooks;
    if (masked) {
      plain_hooks.mask.assign(1024, 1);
      plain_hooks.mask[size_t(plain_greedy(*m.engine, prompt, 5)[4])] = 0;
    }
    Sampler s0 = greedy_sampler();
    auto r0 = generate(*m.engine, nullptr, prompt, 32, s0, plain_hooks, {.prefill_chunk = 7});
    for (int k = 1; k <= 3; ++k) {
      CollectHooks hooks;
      hooks.mask = plain_hooks.mask;
      Sampler s = greedy_sampler();
      auto r = generate(*m.engine, nullptr, prompt, 32, s, hooks, {.prefill_chunk = 7, .speculative = k});
      EXPECT_EQ(hooks.tokens, plain_hooks.tokens) << "k " << k << " masked " << masked;
      EXPECT_EQ(r.completion_tokens, 20);
      EXPECT_EQ(r.finish, GenerationResult::Finish::kStopped);
      EXPECT_GT(r.speculative.steps, 0);
      EXPECT_EQ(r0.speculative.steps, 0);
    }
  }
}

// Greedy decoding through Engine::forward_argmax (hooks that want no logits): the plain loop's tokens, also when the
// mask forbids the engine's pick (the row is then fetched with argmax_logits and sampled under the mask).
TEST(GreedyArgmaxLoop, SameTokensAsThePlainLoop) {
  MtpModel m = open_with_mtp("glm5_next_clamp");
  const auto prompt = prompt_of("glm5_next_clamp", 15);
  const auto plain = plain_greedy(*m.engine, prompt, 6);
  {  // forward_argmax picks what the logits' first maximum is, and argmax_logits returns that row
    auto a = m.engine->new_sequence(), b = m.engine->new_sequence();
    const auto row = m.engine->forward(*a, prompt);
    EXPECT_EQ(m.engine->forward_argmax(*b, prompt), plain[0]);
    EXPECT_EQ(m.engine->argmax_logits(), row);
  }
  for (bool masked : {false, true}) {
    CollectHooks plain_hooks;
    if (masked) plain_hooks.mask.assign(1024, 1), plain_hooks.mask[size_t(plain[4])] = 0;
    Sampler s0 = greedy_sampler();
    generate(*m.engine, nullptr, prompt, 32, s0, plain_hooks, {.prefill_chunk = 7});
    CollectHooks hooks;
    hooks.mask = plain_hooks.mask;
    hooks.logits = false;
    Sampler s = greedy_sampler();
    auto r = generate(*m.engine, nullptr, prompt, 32, s, hooks, {.prefill_chunk = 7});
    EXPECT_EQ(hooks.tokens, plain_hooks.tokens) << "masked " << masked;
    EXPECT_EQ(r.completion_tokens, 20);
    EXPECT_EQ(plain_hooks.no_rows, 0);
    // every token after the first (picked from the prompt's logits) came without a row, but for the masked picks
    if (masked) EXPECT_LT(hooks.no_rows, 19);
    else EXPECT_EQ(hooks.no_rows, 19);
  }
}

// The prefix cache with MTP drafts: a follow-up turn (the prompt, the answer and new tokens), a regenerated prompt
// and a prompt that diverges inside the answer resume the model's state and the MTP block's at an anchor (end of the
// last generation, end of a prompt but its last token) and give the cold run's tokens, drafts and acceptance (so
// the MTP cache resumed is the one a cold run builds), and plain decoding's tokens. glm5_next: KDA state resumes
// from checkpoints; deepseek_v3: MLA caches.
class MtpPrefixCache : public ::testing::TestWithParam<std::string> {};

TEST_P(MtpPrefixCache, ResumesTheModelAndTheMtpBlock) {
  MtpModel m = open_with_mtp(GetParam());
  PrefixCache cache(size_t(1) << 30);
  auto run = [&](const std::vector<int32_t>& prompt, PrefixCache* c) {
    CollectHooks hooks;
    hooks.stop_after = 1000;
    Sampler s = greedy_sampler();
    auto r = generate(*m.engine, c, prompt, 14, s, hooks, {.prefill_chunk = 8, .speculative = 2});
    EXPECT_EQ(hooks.tokens, plain_greedy(*m.engine, prompt, 14));
    return std::make_pair(r, hooks.tokens);
  };
  auto expect_as_cold = [&](const std::vector<int32_t>& prompt, int64_t cached, const char* what) {
    auto [warm, warm_tokens] = run(prompt, &cache);
    auto [cold, cold_tokens] = run(prompt, nullptr);
    EXPECT_EQ(warm.cached_tokens, cached) << what;
    EXPECT_EQ(warm_tokens, cold_tokens) << what;
    EXPECT_EQ(warm.speculative.steps, cold.speculative.steps) << what;
    EXPECT_EQ(warm.speculative.drafted, cold.speculative.drafted) << what;
    EXPECT_EQ(warm.speculative.accepted, cold.speculative.accepted) << what;
    return warm_tokens;
  };
  const auto a = prompt_of(GetParam(), 19);
  const auto answer = expect_as_cold(a, 0, "first turn");
  std::vector<int32_t> follow = a;
  follow.insert(follow.end(), answer.begin(), answer.end());
  for (int32_t t : {5, 77, 300}) follow.push_back(t);
  // The entry holds the prompt and the answer but its last token (never run): the generation's anchor.
  expect_as_cold(follow, int64_t(a.size() + answer.size()) - 1, "follow-up");
  expect_as_cold(follow, int64_t(follow.size()) - 1, "regenerated");
  std::vector<int32_t> diverged(a.begin(), a.end());
  diverged.insert(diverged.end(), answer.begin(), answer.begin() + 3);
  diverged.push_back(9);
  expect_as_cold(diverged, int64_t(a.size()) - 1, "diverged inside the answer");
  EXPECT_GT(cache.entries(), 0u);
}

// The same turns with the server's draft policy (plain steps among them, so an anchor may hold positions whose MTP
// catch-up was deferred): the tokens stay plain greedy decoding's, warm or cold. (Its choices follow measured
// times, so step counts may differ between runs.)
TEST_P(MtpPrefixCache, ResumesWithTheDraftPolicy) {
  MtpModel m = open_with_mtp(GetParam());
  PrefixCache cache(size_t(1) << 30);
  auto policy = std::make_shared<DraftPolicy>(2);
  auto run = [&](const std::vector<int32_t>& prompt, PrefixCache* c) {
    CollectHooks hooks;
    hooks.stop_after = 1000;
    Sampler s = greedy_sampler();
    auto r =
        generate(*m.engine, c, prompt, 14, s, hooks, {.prefill_chunk = 8, .speculative = 2, .draft_policy = policy});
    EXPECT_EQ(hooks.tokens, plain_greedy(*m.engine, prompt, 14));
    return std::make_pair(r.cached_tokens, hooks.tokens);
  };
  const auto a = prompt_of(GetParam(), 19);
  const auto [cached_a, answer] = run(a, &cache);
  EXPECT_EQ(cached_a, 0);
  std::vector<int32_t> follow = a;
  follow.insert(follow.end(), answer.begin(), answer.end());
  for (int32_t t : {5, 77, 300}) follow.push_back(t);
  EXPECT_EQ(run(follow, &cache).first, int64_t(a.size() + answer.size()) - 1);
  EXPECT_EQ(run(follow, &cache).first, int64_t(follow.size()) - 1);
  EXPECT_GT(policy->step_seconds(0), 0.0);
}

INSTANTIATE_TEST_SUITE_P(TinyModels, MtpPrefixCache, ::testing::Values("glm5_next", "deepseek_v3"));

}  // namespace
}  // namespace moesrv
