#include <gtest/gtest.h>

#include <map>

#include "runtime/sampler.h"

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
