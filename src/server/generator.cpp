#include "server/generator.h"

#include <algorithm>
#include <chrono>

#include "util/error.h"
#include "util/timing.h"

namespace moesrv {

namespace {
bool client_gone(DecodeHooks& hooks) { return hooks.client_alive && !hooks.client_alive(); }

// Prompt tokens per forward call: the configured count, else the engine's pass length.
int64_t prefill_call_tokens(const Engine& engine, const GeneratorConfig& config) {
  return config.prefill_chunk > 0 ? config.prefill_chunk : std::max<int64_t>(1, engine.prefill_chunk());
}

// Prefills `total` prompt tokens that start at position `pos0` in forward calls that end at multiples of `chunk`
// (so that, resumed from a cached prefix, they still fill the engine's passes, pass_plan.h) and never cross
// `split`: run(first, n) makes a call and returns its logits (kept in `logits`); after each call the client and,
// unless it was the last, the progress hook are asked. Times the prefill into r.prefill_seconds; false: cancelled
// (r.finish says so).
template <class Run>
bool prefill_in_calls(GenerationResult& r, int64_t pos0, int64_t total, int64_t split, int64_t chunk,
                      DecodeHooks& hooks, std::vector<float>& logits, Run run) {
  const auto t0 = std::chrono::steady_clock::now();
  bool finished = true;
  for (int64_t done = 0; done < total;) {
    const int64_t n = std::min(chunk - (pos0 + done) % chunk, (done < split ? split : total) - done);
    logits = run(done, n);
    done += n;
    if (client_gone(hooks) || (done < total && !hooks.on_prefill_progress(done, total))) {
      finished = false;
      break;
    }
  }
  r.prefill_seconds = seconds_since(t0);
  if (!finished) r.finish = GenerationResult::Finish::kCancelled;
  return finished;
}

// The same loop with MTP drafts: each step runs the chosen token and up to k drafts in one forward, then chooses
// token after token from its logits (forced tokens, masks and hooks as in the plain loop; a draft is kept while the
// sampler's acceptance rule keeps it) and commits the accepted prefix. With a prefix cache, the model's state and
// the decoder's are kept together (SpeculativeSequence) with anchors at the prompt's end but its last token and at
// the generation's end, where a later request resumes both.
GenerationResult generate_with_mtp(Engine& engine, PrefixCache* cache, const std::vector<int32_t>& prompt,
                                   int64_t max_new_tokens, Sampler& sampler, DecodeHooks& hooks,
                                   const GeneratorConfig& config) {
  GenerationResult r;
  r.prompt_tokens = int64_t(prompt.size());
  SpeculativeDecoder dec(engine, config.speculative, {}, config.draft_policy);
  std::unique_ptr<SpeculativeSequence> spec;
  if (cache) {
    auto hit = cache->acquire(prompt, r.prompt_tokens - 1);
    auto* s = dynamic_cast<SpeculativeSequence*>(hit.state.get());
    if (s && hit.reused > 0 && s->anchor(hit.reused)) {  // (resume points are anchors: always there)
      hit.state.release();
      spec.reset(s);
      r.cached_tokens = hit.reused;
      dec.restore(*spec->model, *spec->anchor(hit.reused));
    }
  }
  if (!spec) spec = std::make_unique<SpeculativeSequence>(engine.new_sequence()), r.cached_tokens = 0;
  SequenceState& seq = *spec->model;
  const int64_t total = r.prompt_tokens - r.cached_tokens, split = total > 1 ? total - 1 : total;
  std::vector<float> logits;
  if (!prefill_in_calls(r, r.cached_tokens, total, split, prefill_call_tokens(engine, config), hooks, logits,
                        [&](int64_t first, int64_t n) {
                          auto begin = prompt.begin() + r.cached_tokens + first;
                          auto out = dec.prefill(seq, std::vector<int32_t>(begin, begin + n));
                          if (cache && first + n == split && split < total) {
                            seq.checkpoint();
                            spec->add_anchor(dec.save(seq, true));
                          }
                          return out;
                        })) {
    if (cache && spec->resume_point(seq.length()) > 0)  // cancelled: what it can resume from stays cached
      cache->insert(std::vector<int32_t>(prompt.begin(), prompt.begin() + seq.length()), std::move(spec));
    return r;
  }
  std::vector<int32_t> held = prompt;  // the tokens `seq` holds: the prompt and every chosen token but the last

  auto t1 = std::chrono::steady_clock::now();
  r.finish = GenerationResult::Finish::kLength;
  auto choose = [&](std::span<const float> row, int32_t draft) {
    if (auto forced = hooks.forced_token()) return *forced;
    return draft >= 0 ? sampler.accept_draft(row, draft, hooks.allowed_tokens())
                      : sampler.sample(row, hooks.allowed_tokens());
  };
  auto emit = [&](std::span<const float> row, int32_t tok) {  // false: stop
    hooks.on_sampled(row, tok);
    ++r.completion_tokens;
    if (hooks.on_token(tok)) return true;
    r.finish = GenerationResult::Finish::kStopped;
    return false;
  };
  int32_t tok = choose(logits, -1);
  bool go = emit(logits, tok);
  while (go && r.completion_tokens < max_new_tokens && seq.length() + 1 < engine.max_context()) {
    auto st = dec.step(seq, tok, max_new_tokens - r.completion_tokens - 1);
    const size_t V = st.logits.size() / (st.draft.size() + 1);
    int64_t accepted = 0;
    held.push_back(tok);  // `last`, run by this step
    for (size_t j = 0; j <= st.draft.size(); ++j) {
      std::span<const float> row(st.logits.data() + j * V, V);
      tok = choose(row, j < st.draft.size() ? st.draft[j] : -1);
      if (!(go = emit(row, tok)) || j == st.draft.size() || tok != st.draft[j]) break;
      ++accepted;
      held.push_back(tok);
    }
    dec.commit(seq, accepted);
    if (go && client_gone(hooks)) {
      r.finish = GenerationResult::Finish::kCancelled;
      break;
    }
  }
  r.decode_seconds = seconds_since(t1);
  r.speculative = dec.stats();
  if (cache) {
    MOESRV_CHECK(int64_t(held.size()) == seq.length(), "speculative: {} tokens held, state of {}", held.size(),
                 seq.length());
    seq.checkpoint();
    spec->add_anchor(dec.save(seq, false));
    cache->insert(std::move(held), std::move(spec));
  }
  return r;
}

}  // namespace

GenerationResult generate(Engine& engine, PrefixCache* cache, const std::vector<int32_t>& prompt,
                          int64_t max_new_tokens, Sampler& sampler, DecodeHooks& hooks, GeneratorConfig config) {
  MOESRV_CHECK(!prompt.empty(), "empty prompt");
  if (config.speculative > 0) return generate_with_mtp(engine, cache, prompt, max_new_tokens, sampler, hooks, config);
  GenerationResult r;
  r.prompt_tokens = int64_t(prompt.size());
  std::unique_ptr<SequenceState> seq;
  if (cache) {
    auto hit = cache->acquire(prompt, r.prompt_tokens - 1);
    seq = std::move(hit.state);
    r.cached_tokens = hit.reused;
    // An entry of speculative decoding (another server setting): the model's part.
    if (auto* spec = dynamic_cast<SpeculativeSequence*>(seq.get())) seq = std::move(spec->model);
  }
  if (!seq) seq = engine.new_sequence(), r.cached_tokens = 0;
  std::vector<int32_t> seq_tokens(prompt.begin(), prompt.begin() + r.cached_tokens);  // what `seq` holds

  // Hands the state back to the cache however the generation ends, unless an engine call failed midway.
  bool state_valid = true;
  struct Return {
    PrefixCache* cache;
    std::unique_ptr<SequenceState>& seq;
    std::vector<int32_t>& tokens;
    bool& valid;
    ~Return() {
      if (cache && valid && seq && int64_t(tokens.size()) == seq->length()) cache->insert(std::move(tokens), std::move(seq));
    }
  } give_back{cache, seq, seq_tokens, state_valid};

  auto forward = [&](const std::vector<int32_t>& toks) {
    state_valid = false;
    auto logits = engine.forward(*seq, toks);
    state_valid = true;
    seq_tokens.insert(seq_tokens.end(), toks.begin(), toks.end());
    return logits;
  };

  std::vector<float> logits;
  // Fixed-size state resumes only at checkpoints: the prompt's last token runs alone, with one before it (the
  // longest prefix the same prompt may reuse: one token is left to produce logits) and one after it (where a
  // follow-up turn whose history diverges in the answer resumes).
  const int64_t total = r.prompt_tokens - r.cached_tokens;
  const bool fixed = seq->has_fixed_state();
  const int64_t split = fixed && total > 1 ? total - 1 : total;
  if (!prefill_in_calls(r, r.cached_tokens, total, split, prefill_call_tokens(engine, config), hooks, logits,
                        [&](int64_t first, int64_t n) {
                          auto begin = prompt.begin() + r.cached_tokens + first;
                          auto out = forward(std::vector<int32_t>(begin, begin + n));
                          if (fixed && (first + n == split || first + n == total)) seq->checkpoint();
                          return out;
                        }))
    return r;

  auto t1 = std::chrono::steady_clock::now();
  r.finish = GenerationResult::Finish::kLength;
  // Greedy decoding whose hooks need no logits: the engine picks the argmax (on the device for the CUDA engine) and
  // the row is fetched only when the mask rejects that pick; the choice is the same as sample()'s on the row (the
  // unmasked argmax is the lowest id among the maxima, so when the mask allows it, it is the masked argmax too; a
  // row with NaN logits, which no model here produces, could differ).
  std::optional<int32_t> picked;  // the engine's argmax of the last step (logits not fetched)
  while (r.completion_tokens < max_new_tokens) {
    int32_t tok;
    if (auto forced = hooks.forced_token()) {
      tok = *forced;
    } else {
      const std::vector<uint8_t>* mask = hooks.allowed_tokens();
      const bool allowed = picked && (!mask || (size_t(*picked) < mask->size() && (*mask)[size_t(*picked)]));
      if (picked && !allowed) logits = engine.argmax_logits(), picked.reset();
      tok = picked ? *picked : sampler.sample(logits, mask);
    }
    hooks.on_sampled(picked ? std::span<const float>() : std::span<const float>(logits), tok);
    ++r.completion_tokens;
    if (!hooks.on_token(tok)) {
      r.finish = GenerationResult::Finish::kStopped;
      break;
    }
    if (r.completion_tokens == max_new_tokens || seq->length() + 1 >= engine.max_context()) break;
    if (sampler.greedy() && !hooks.wants_logits()) {
      state_valid = false;
      picked = engine.forward_argmax(*seq, {tok});
      state_valid = true;
      seq_tokens.push_back(tok);
      logits.clear();
    } else {
      picked.reset();
      logits = forward({tok});
    }
    if (hooks.client_alive && !hooks.client_alive()) {
      r.finish = GenerationResult::Finish::kCancelled;
      break;
    }
  }
  r.decode_seconds = seconds_since(t1);
  return r;
}

}  // namespace moesrv
