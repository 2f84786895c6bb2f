// Engine drivers the engine tests and opt-in throughput tests share (any Engine; header-only).
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <vector>

#include "backend/engine.h"
#include "util/timing.h"

namespace moesrv::test {

inline int32_t greedy(const std::vector<float>& logits) {
  return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// Every row of a prefill of `prompt`, then one row per teacher-forced single-token step, concatenated.
inline std::vector<float> prefill_then_steps(Engine& e, const std::vector<int32_t>& prompt,
                                             const std::vector<int32_t>& steps) {
  auto seq = e.new_sequence();
  std::vector<float> out = e.forward(*seq, prompt, true);
  for (int32_t t : steps) {
    auto l = e.forward(*seq, {t});
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

// A deterministic prompt over the first 150000 ids (every vocabulary the throughput tests build is larger).
// n greedy tokens after the prompt, one forward per token.
inline std::vector<int32_t> greedy_tokens(Engine& e, const std::vector<int32_t>& prompt, int64_t n) {
  auto seq = e.new_sequence();
  auto logits = e.forward(*seq, prompt);
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(greedy(logits));
    if (i + 1 < n) logits = e.forward(*seq, {out.back()});
  }
  return out;
}

inline std::vector<int32_t> bench_prompt(size_t n) {
  std::vector<int32_t> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = int32_t((i * 7919) % 150000);
  return p;
}

struct PrefillDecodeTiming {
  double prefill_s = 0, decode_s = 0;  // the whole prompt; per greedy decode step
  std::vector<double> verify_s;        // [k - 1]: a forward of k + 1 tokens with all logits (with verify_k)
};

// Times a prefill of `prompt` (after a 64-token warm-up prefill when `warm_up`), then `warm` untimed and `steps`
// timed greedy decode steps; `before_timed` and `after_timed` run just before and after the timed steps (e.g. to read
// counters). With verify_k > 0, then the verify of MTP speculative decoding for k = 1 .. verify_k: a forward of k + 1
// tokens with every row's logits (an MtpEngine's forward_hidden with rollback points, cut back to the first token),
// cut back to the context after each (a checkpoint there), best of 3 after one untimed; after_verify(k) runs after
// each k's passes (e.g. to read counters per k).
inline PrefillDecodeTiming time_prefill_decode(Engine& e, const std::vector<int32_t>& prompt, int warm, int steps,
                                               bool warm_up = true, const std::function<void()>& before_timed = {},
                                               int verify_k = 0, const std::function<void()>& after_timed = {},
                                               const std::function<void(int)>& after_verify = {}) {
  using Clock = std::chrono::steady_clock;
  auto seq = e.new_sequence();
  if (warm_up) {
    e.forward(*seq, std::vector<int32_t>(prompt.begin(), prompt.begin() + std::min<size_t>(64, prompt.size())));
    seq->truncate(0);
  }
  PrefillDecodeTiming t;
  auto t0 = Clock::now();
  int32_t tok = greedy(e.forward(*seq, prompt));
  t.prefill_s = seconds_since(t0);
  // Decode steps as the server's greedy loop runs them (Engine::forward_argmax); MOESRV_BENCH_HOST_ARGMAX=1: the
  // logits row comes back and the argmax is taken here (the loop before forward_argmax existed).
  static const bool host_argmax = [] {
    const char* v = std::getenv("MOESRV_BENCH_HOST_ARGMAX");
    return v && v[0] == '1';
  }();
  std::vector<int32_t> made;  // the tokens decode made (distinct draft tokens for the verify passes below)
  auto step = [&] {
    tok = host_argmax ? greedy(e.forward(*seq, {tok})) : e.forward_argmax(*seq, {tok});
    made.push_back(tok);
  };
  for (int i = 0; i < warm; ++i) step();
  if (before_timed) before_timed();
  t0 = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  t.decode_s = steps > 0 ? seconds_since(t0) / steps : 0;
  if (after_timed) after_timed();
  if (verify_k > 0) {
    const int64_t len = seq->length();
    seq->checkpoint();
    // An engine with the MTP interface verifies as speculative decoding does: rollback points kept, then cut back to
    // the first token (a rejected draft; its state restore is timed too).
    auto* mtp = dynamic_cast<MtpEngine*>(&e);
    std::vector<float> hidden;
    // MOESRV_BENCH_VERIFY_REVERSE=1: the passes of k = verify_k first, down to 1 (to tell an order effect apart)
    static const bool reverse = [] {
      const char* v = std::getenv("MOESRV_BENCH_VERIFY_REVERSE");
      return v && v[0] == '1';
    }();
    t.verify_s.assign(size_t(verify_k), 0.0);
    for (int i = 0; i < verify_k; ++i) {
      const int k = reverse ? verify_k - i : i + 1;
      double best = 1e30;
      for (int rep = 0; rep < 4; ++rep) {
        // Each pass its own k + 1 tokens (from those decode made, newest first): repeating one token would route
        // every row and every pass alike, and under a budget every pass after the first would find its experts cached.
        std::vector<int32_t> tokens(size_t(k + 1), tok);
        for (size_t j = 0; j < tokens.size(); ++j) {
          const size_t back = size_t(rep) * tokens.size() + j + 1;
          if (back <= made.size()) tokens[j] = made[made.size() - back];
        }
        t0 = Clock::now();
        if (mtp) {
          mtp->forward_hidden(*seq, tokens, true, true, hidden);
          seq->truncate(len + 1);
        } else {
          e.forward(*seq, tokens, true);
        }
        if (rep > 0) best = std::min(best, seconds_since(t0));
        seq->truncate(len);
      }
      t.verify_s[size_t(k - 1)] = best;
      if (after_verify) after_verify(k);
    }
  }
  return t;
}

}  // namespace moesrv::test
