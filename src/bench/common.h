// Helpers every benchmark here shares: wall-clock timing, a deterministic prompt, tok/s formatting.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "util/timing.h"

namespace moesrv::bench {

using Clock = std::chrono::steady_clock;

inline double since(Clock::time_point t0) { return seconds_since(t0); }

// The fastest of `reps` runs of f, in seconds.
template <typename F>
double best_of(int reps, F&& f) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    f();
    best = std::min(best, since(t0));
  }
  return best;
}

// `n` pseudo-random token ids below `vocab`, the same for the same seed.
std::vector<int32_t> prompt_tokens(int64_t n, int64_t vocab, uint64_t seed);

// A rate for a table: no decimals from 100 up, else two.
std::string fmt_rate(double per_s);

}  // namespace moesrv::bench
