// Synthetic model (in-memory package) and the bench end to end on a 1-layer reduced-width model.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fmt/format.h>

#include "backend/cpu/cpu_engine.h"
#include "bench/bench.h"
#include "bench/speculative_projection.h"
#include "model/synthetic_model.h"
#include "util/error.h"

namespace moesrv {
namespace {

TEST(SyntheticModel, LoadsRunsAndIsDeterministic) {
  auto cfg = tiny_moe_config(2);
  CpuEngine a(make_synthetic_model(cfg, {7, 0.02f, 0})), b(make_synthetic_model(cfg, {7, 0.02f, 0}));
  CpuEngine other(make_synthetic_model(cfg, {8, 0.02f, 0}));
  EXPECT_EQ(a.config().hidden_size, 256);
  EXPECT_TRUE(a.config().dsa);
  std::vector<int32_t> prompt{1, 5, 9, 200, 3};
  auto sa = a.new_sequence(), sb = b.new_sequence(), so = other.new_sequence();
  auto la = a.forward(*sa, prompt), lb = b.forward(*sb, prompt), lo = other.forward(*so, prompt);
  ASSERT_EQ(la.size(), size_t(a.vocab_size()));
  EXPECT_EQ(la, lb);
  EXPECT_NE(la, lo);
  for (float v : la) ASSERT_TRUE(std::isfinite(v));
}

TEST(SyntheticModel, WeightStatisticsAndExpertAliasing) {
  auto pkg = make_synthetic_model(tiny_moe_config(1), {3, 0.02f, 4});
  const TensorView& t = pkg->require("model.layers.0.self_attn.o_proj.weight");
  auto v = t.to_f32();
  double mean = 0, var = 0;
  for (float f : v) mean += f;
  mean /= double(v.size());
  for (float f : v) var += (f - mean) * (f - mean);
  EXPECT_NEAR(mean, 0.0, 1e-3);
  EXPECT_NEAR(std::sqrt(var / double(v.size())), 0.02, 1e-3);
  EXPECT_EQ(pkg->require("model.layers.0.input_layernorm.weight").at(0), 1.0f);
  // 4 distinct experts: expert 5 reuses expert 1's bytes, expert 2 has its own.
  auto data = [&](int e) { return pkg->require(fmt::format("model.layers.0.mlp.experts.{}.up_proj.weight", e)).data; };
  EXPECT_EQ(data(5), data(1));
  EXPECT_NE(data(2), data(1));
  EXPECT_THROW(pkg->require("model.layers.1.input_layernorm.weight"), Error);
}

TEST(SyntheticModel, FromMemoryRejectsDuplicates) {
  TensorView t;
  t.name = "x";
  EXPECT_THROW(ModelPackage::from_memory(nlohmann::json::object(), {t, t}, nullptr), Error);
}

TEST(Bench, RunsEndToEndOnTinyModel) {
  BenchOptions o;
  o.synthetic_config = tiny_moe_config(1);
  o.contexts = {32, 96};
  o.model_contexts = {8192, 32768};
  o.decode_tokens = 2;
  o.full_layers = 78;
  auto t0 = std::chrono::steady_clock::now();
  BenchResult r = run_bench(o);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 20.0);
  const auto& j = r.json;
  ASSERT_EQ(j["measured"].size(), 2u);
  for (const auto& m : j["measured"]) {
    EXPECT_GT(m["ttft_s"].get<double>(), 0);
    EXPECT_GT(m["decode_tps"].get<double>(), 0);
    EXPECT_GT(m["full_decode_tps"].get<double>(), 0);
    EXPECT_LT(m["full_decode_tps"].get<double>(), m["decode_tps"].get<double>());  // 78 layers are slower than 1
  }
  EXPECT_GT(j["calibration"]["memcpy_gbps"].get<double>(), 0.1);
  EXPECT_GT(j["calibration"]["expert_gemv_gbps"].get<double>(), 0);
  ASSERT_EQ(j["projected"].size(), 6u);  // 3 placements x 2 contexts
  for (const auto& p : j["projected"]) {
    EXPECT_GT(p["decode_tps"].get<double>(), 0);
    // The floor is a bound: no placement beats bytes / bandwidth.
    EXPECT_LE(p["decode_tps"].get<double>(), p["decode_floor_tps"].get<double>() * 1.0001);
  }
  EXPECT_EQ(j["projected"][2]["decode_vs_baseline"].get<double>(), 1.0);
  EXPECT_NE(r.markdown.find("| context | TTFT s |"), std::string::npos);
  EXPECT_NE(r.markdown.find("hybrid 22 GiB"), std::string::npos);
  EXPECT_TRUE(j.contains("hybrid_plan"));
}

// The MTP projection's tokens per step against the sum over acceptance patterns, enumerated.
TEST(MtpProjection, TokensPerStepAndSpeedup) {
  for (int k = 0; k <= 3; ++k)
    for (double a : {0.0, 0.3, 0.7, 1.0}) {
      double want = 0;  // P(first rejection after exactly j accepted drafts) x (j + 1) committed tokens
      for (int j = 0; j <= k; ++j) want += (j + 1) * std::pow(a, j) * (j < k ? 1 - a : 1.0);
      EXPECT_NEAR(mtp_tokens_per_step(k, a), want, 1e-12) << k << " " << a;
    }
  // Nothing accepted: one token per (verify + drafts); everything accepted: k + 1 tokens.
  EXPECT_NEAR(mtp_projected_speedup(3, 0.0, 10, 12, 1), 10.0 / 15, 1e-12);
  EXPECT_NEAR(mtp_projected_speedup(3, 1.0, 10, 12, 1), 40.0 / 15, 1e-12);
  const auto j = mtp_projection_json(3, 10, 12, 1);
  EXPECT_NEAR(j["verify_over_decode"].get<double>(), 1.2, 1e-12);
  EXPECT_NEAR(j["projected_speedup_at_0.7"].get<double>(), (1 + 0.7 + 0.49 + 0.343) * 10 / 15, 1e-12);
}

}  // namespace
}  // namespace moesrv
