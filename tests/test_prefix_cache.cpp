#include <gtest/gtest.h>

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
