#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "serving/sampler.h"

using namespace moesrv;

TEST(Sampler, GreedyAtTemperatureZero) {
  Sampler s({.temperature = 0});
  std::vector<float> logits = {0.1f, 3.f, 2.f, -1.f};
  EXPECT_EQ(s.sample(logits), 1);
  std::vector<uint8_t> mask = {1, 0, 1, 1};
  EXPECT_EQ(s.sample(logits, &mask), 2);
  std::vector<uint8_t> none = {0, 0, 0, 0};
  EXPECT_EQ(s.sample(logits, &none), 1);  // an empty mask is ignored
}

TEST(Sampler, SeededSamplingIsReproducible) {
  std::vector<float> logits = {1.f, 1.2f, 0.8f, 1.1f, 0.9f};
  std::vector<int32_t> a, b;
  Sampler s1({.temperature = 1, .seed = 42}), s2({.temperature = 1, .seed = 42});
  for (int i = 0; i < 50; ++i) a.push_back(s1.sample(logits)), b.push_back(s2.sample(logits));
  EXPECT_EQ(a, b);
}

TEST(Sampler, TopKAndTopPRestrictCandidates) {
  std::vector<float> logits = {5.f, 4.f, 0.f, 0.f, 0.f, 0.f};
  Sampler k({.temperature = 1, .top_k = 2, .seed = 1});
  Sampler p({.temperature = 1, .top_p = 0.5f, .seed = 1});
  std::map<int32_t, int> seen_k, seen_p;
  for (int i = 0; i < 2000; ++i) ++seen_k[k.sample(logits)], ++seen_p[p.sample(logits)];
  EXPECT_EQ(seen_k.size(), 2u);
  EXPECT_GT(seen_k[1], 100);  // ~27%
  EXPECT_EQ(seen_p.size(), 1u);  // token 0 alone holds > 50% of the mass
  EXPECT_EQ(seen_p.begin()->first, 0);
}

TEST(Sampler, TemperatureFollowsTheSoftmax) {
  std::vector<float> logits = {0.f, std::log(3.f)};  // p = 0.25, 0.75
  Sampler s({.temperature = 1, .seed = 3});
  int ones = 0;
  for (int i = 0; i < 20000; ++i) ones += s.sample(logits) == 1;
  EXPECT_NEAR(ones / 20000.0, 0.75, 0.02);
  std::vector<uint8_t> mask = {1, 0};
  EXPECT_EQ(s.sample(logits, &mask), 0);
}

TEST(Sampler, TopPZeroIsGreedy) {
  // OpenAI: top_p 0 keeps only the most likely token, whatever the temperature.
  std::vector<float> logits = {1.f, 1.1f, 0.9f, 1.05f};
  Sampler s({.temperature = 1.5f, .top_p = 0.0f, .seed = 5});
  for (int i = 0; i < 200; ++i) ASSERT_EQ(s.sample(logits), 1);
  std::vector<uint8_t> mask = {1, 0, 1, 1};
  EXPECT_EQ(s.sample(logits, &mask), 3);
}

TEST(Sampler, DifferentSeedsDiffer) {
  std::vector<float> logits(50, 0.f);
  auto run = [&](uint64_t seed) {
    Sampler s({.temperature = 1, .seed = seed});
    std::vector<int32_t> out;
    for (int i = 0; i < 40; ++i) out.push_back(s.sample(logits));
    return out;
  };
  EXPECT_EQ(run(1), run(1));
  EXPECT_NE(run(1), run(2));
}

TEST(Sampler, TokenLogprobsAreTheLogSoftmax) {
  std::vector<float> logits = {0.f, std::log(3.f), -100.f, std::log(3.f)};  // p = 1/7, 3/7, ~0, 3/7
  TokenLogprobs lp = token_logprobs(logits, 0, 3);
  EXPECT_NEAR(lp.logprob, std::log(1.0 / 7), 1e-5);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].first, 1);  // ties: lower id first
  EXPECT_EQ(lp.top[1].first, 3);
  EXPECT_EQ(lp.top[2].first, 0);
  EXPECT_NEAR(lp.top[0].second, std::log(3.0 / 7), 1e-5);
  double total = 0;
  for (size_t i = 0; i < logits.size(); ++i) total += std::exp(token_logprobs(logits, int32_t(i), 0).logprob);
  EXPECT_NEAR(total, 1.0, 1e-5);
  EXPECT_TRUE(token_logprobs(logits, 2, 0).top.empty());
}

// Speculative acceptance of a one-hot draft d on a toy distribution p: d is kept with probability p(d), and the
// emitted tokens (kept drafts and resamples from p without d) follow p; with top-k, a draft outside the kept set is
// never kept and the rest stays renormalised over that set; greedy keeps exactly the argmax.
TEST(Sampler, AcceptDraftKeepsTheTargetDistribution) {
  const std::vector<float> logits = {1.5f, 0.2f, 1.0f, -0.5f};
  const float t = 0.8f;
  std::vector<double> p(logits.size());
  double z = 0;
  for (size_t i = 0; i < p.size(); ++i) z += (p[i] = std::exp(logits[i] / t));
  for (double& v : p) v /= z;
  const int n = 200000;
  for (int32_t draft : {0, 2, 3}) {
    Sampler s({.temperature = t, .seed = uint64_t(17 + draft)});
    std::vector<int> count(p.size());
    int kept = 0;
    for (int i = 0; i < n; ++i) {
      const int32_t tok = s.accept_draft(logits, draft);
      ++count[size_t(tok)];
      kept += tok == draft;
    }
    EXPECT_NEAR(double(kept) / n, p[size_t(draft)], 0.006) << "draft " << draft;
    for (size_t i = 0; i < p.size(); ++i)
      EXPECT_NEAR(double(count[i]) / n, p[i], 0.006) << "draft " << draft << " token " << i;
  }
  Sampler k({.temperature = 1, .top_k = 2, .seed = 3});
  std::vector<int> count(logits.size());
  for (int i = 0; i < 20000; ++i) ++count[size_t(k.accept_draft(logits, 1))];
  EXPECT_EQ(count[1] + count[3], 0);  // outside the top 2: never kept, never drawn
  const double p0 = 1 / (1 + std::exp(1.0 - 1.5));
  EXPECT_NEAR(count[0] / 20000.0, p0, 0.015);
  Sampler g({.temperature = 0});
  EXPECT_EQ(g.accept_draft(logits, 0), 0);
  EXPECT_EQ(g.accept_draft(logits, 2), 0);
  std::vector<uint8_t> mask = {0, 1, 1, 1};
  EXPECT_EQ(g.accept_draft(logits, 2, &mask), 2);
}
