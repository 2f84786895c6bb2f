// Checks of speculative decoding shared by the CPU and CUDA MTP tests (header-only, gtest).
#pragma once
#include <gtest/gtest.h>

#include <span>
#include <vector>

#include "backend/engine.h"
#include "serving/sampler.h"
#include "serving/speculative.h"

namespace moesrv::testing {

// Drafts from a picker that knows the greedy tokens (`plain`, 24 after `prompt`): every draft is accepted (several
// tokens per step), or, with every third position corrupted, a prefix is; either way the output is plain greedy
// decoding's, for k = 1..3.
inline void expect_forced_acceptance(Engine& e, const std::vector<int32_t>& prompt, const std::vector<int32_t>& plain) {
  ASSERT_EQ(plain.size(), 24u);
  std::vector<int32_t> full = prompt;
  full.insert(full.end(), plain.begin(), plain.end());
  for (bool corrupt : {false, true}) {
    auto picker = [&](int64_t pos, std::span<const float>) {
      const int32_t t = pos < int64_t(full.size()) ? full[size_t(pos)] : 0;
      return corrupt && pos % 3 == 0 ? (t + 1) % 1024 : t;
    };
    for (int k = 1; k <= 3; ++k) {
      Sampler s(SamplingParams{.temperature = 0.0f});
      SpeculativeStats stats;
      EXPECT_EQ(generate_speculative(e, prompt, 24, s, k, &stats, picker), plain) << "k " << k;
      if (!corrupt) {
        EXPECT_EQ(stats.accepted, stats.drafted) << "k " << k;
        EXPECT_EQ(stats.steps + stats.accepted, 23) << "k " << k;  // 24 tokens: one from the prefill
        EXPECT_GT(stats.tokens_per_step(), k == 1 ? 1.9 : 2.5) << "k " << k;
      } else {
        EXPECT_LT(stats.accepted, stats.drafted) << "k " << k;
        EXPECT_GT(stats.accepted, 0) << "k " << k;
      }
    }
  }
}

}  // namespace moesrv::testing
