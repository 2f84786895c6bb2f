// UsageStats: counting, decay, hottest/entropy, JSON and atomic file round trip, stale or corrupt files ignored.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "backend/usage_stats.h"
#include "util/error.h"

namespace moesrv {
namespace {

namespace fs = std::filesystem;

TEST(UsageStats, CountsDecayAndRanks) {
  UsageStats u(2, 8, 2);
  EXPECT_TRUE(u.empty(0));
  EXPECT_NEAR(u.entropy(0), std::log(8.0), 1e-12);
  EXPECT_DOUBLE_EQ(u.selection_probability(0)[3], 0.25);  // uniform k/E without data
  u.record(0, {3, 5});
  u.record(0, {3, 1});
  u.record(0, std::vector<int32_t>{3, 5});
  EXPECT_DOUBLE_EQ(u.count(0, 3), 3);
  EXPECT_DOUBLE_EQ(u.count(0, 5), 2);
  EXPECT_DOUBLE_EQ(u.tokens(0), 3);
  EXPECT_DOUBLE_EQ(u.selection_probability(0)[3], 1.0);
  EXPECT_DOUBLE_EQ(u.selection_probability(0)[1], 1.0 / 3);
  EXPECT_EQ(u.hottest(0, 3), (std::vector<int32_t>{3, 5, 1}));
  EXPECT_TRUE(u.empty(1));
  u.decay(0.5);
  EXPECT_DOUBLE_EQ(u.count(0, 3), 1.5);
  EXPECT_DOUBLE_EQ(u.tokens(0), 1.5);
  EXPECT_LT(u.entropy(0), std::log(8.0));
  EXPECT_THROW(u.record(0, {8}), Error);
  EXPECT_THROW(u.record(2, {1}), Error);
  EXPECT_THROW(u.decay(0), Error);
}

// Counts gathered elsewhere (the CUDA engine's device counters) add up like the same selections recorded here.
TEST(UsageStats, AddCountsEqualsRecording) {
  UsageStats a(2, 4, 2), b(2, 4, 2);
  a.record(1, {0, 3});
  a.record(1, {3, 2});
  a.record(1, {3, 0});
  const uint32_t per_expert[4] = {2, 0, 1, 3};
  b.add_counts(1, per_expert, 3);
  for (int64_t e = 0; e < 4; ++e) EXPECT_DOUBLE_EQ(a.count(1, e), b.count(1, e)) << e;
  EXPECT_DOUBLE_EQ(a.tokens(1), b.tokens(1));
  EXPECT_TRUE(b.empty(0));
  EXPECT_THROW(b.add_counts(2, per_expert, 1), Error);
}

TEST(UsageStats, FileRoundTripIsAtomic) {
  fs::path dir = fs::temp_directory_path() / ("moesrv_usage_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = UsageStats::default_path(dir.string());
  EXPECT_EQ(fs::path(path), dir / ".moesrv" / "expert_usage.json");
  EXPECT_FALSE(UsageStats::load(path, 3, 16));  // absent
  UsageStats u(3, 16, 4);
  for (int t = 0; t < 50; ++t) u.record(t % 3, {int32_t(t % 16), int32_t((t * 5 + 1) % 16), 2, 9});
  u.decay(0.9);
  u.save(path, "glm-test");
  for (const auto& e : fs::directory_iterator(dir / ".moesrv"))
    EXPECT_EQ(e.path().filename(), "expert_usage.json") << "temporary file left behind";
  auto v = UsageStats::load(path, 3, 16);
  ASSERT_TRUE(v);
  for (int l = 0; l < 3; ++l) {
    EXPECT_DOUBLE_EQ(v->tokens(l), u.tokens(l));
    for (int e = 0; e < 16; ++e) EXPECT_DOUBLE_EQ(v->count(l, e), u.count(l, e));
  }
  EXPECT_EQ(v->experts_per_token(), 4);
  EXPECT_EQ(u.to_json("glm-test")["model"], "glm-test");
  u.save(path);  // overwrite in place
  EXPECT_FALSE(UsageStats::load(path, 4, 16));  // another model's shape: ignored
  EXPECT_FALSE(UsageStats::load(path, 3, 32));
  std::ofstream(path) << "{ not json";
  EXPECT_FALSE(UsageStats::load(path, 3, 16));
  fs::remove_all(dir);
}

TEST(UsageStats, MalformedDocumentsThrow) {
  UsageStats u(1, 4, 2);
  auto j = u.to_json();
  j["layers"][0]["counts"] = {1, 2};
  EXPECT_THROW(UsageStats::from_json(j), Error);
  j = u.to_json();
  j["layers"][0]["counts"][1] = -1.0;
  EXPECT_THROW(UsageStats::from_json(j), Error);
  EXPECT_THROW(UsageStats::from_json(nlohmann::json{{"format", "other"}}), Error);
  EXPECT_THROW(UsageStats::from_json(u.to_json(), 2), Error);
  EXPECT_NO_THROW(UsageStats::from_json(u.to_json(), 1, 4));
  // Sizes that are not integers, or absurd, are errors before anything is allocated.
  for (const char* key : {"num_layers", "n_routed_experts", "experts_per_token", "version"})
    for (nlohmann::json bad : {nlohmann::json(9e61), nlohmann::json(2.5), nlohmann::json(-1),
                               nlohmann::json(uint64_t(1) << 63), nlohmann::json("4")}) {
      j = u.to_json();
      j[key] = bad;
      EXPECT_THROW(UsageStats::from_json(j), Error) << key << " = " << bad.dump();
    }
  EXPECT_THROW(UsageStats(int64_t(1) << 20, int64_t(1) << 20, 8), Error);
}

}  // namespace
}  // namespace moesrv
