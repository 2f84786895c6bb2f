// CpuExpertPool: routed experts computed asynchronously on the CPU equal cpu::moe_forward.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/linear.h"
#include "model/router.h"
#include "model/synthetic_model.h"
#include "runtime/cpu_expert_pool.h"
#include "util/error.h"

namespace moesrv {
namespace {

struct Routed {
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> weights;
};

Routed route(const MoeWeights& w, const ModelSpec& c, const std::vector<float>& x, int64_t S) {
  std::vector<float> logits(size_t(S * c.n_routed_experts));
  gemm_f32(x.data(), S, w.router.data(), c.n_routed_experts, c.hidden_size, logits.data());
  Routed r;
  for (int64_t s = 0; s < S; ++s) {
    RoutedExperts e = route_token(logits.data() + s * c.n_routed_experts, w.router_bias.data(), c);
    r.ids.push_back(e.ids);
    r.weights.push_back(e.weights);
  }
  return r;
}

std::vector<float> random_rows(int64_t S, int64_t D, uint32_t seed) {
  std::vector<float> x(size_t(S * D));
  for (auto& v : x) {
    seed = seed * 1664525u + 1013904223u;
    v = float(int32_t(seed >> 9) % 2001 - 1000) * 1e-3f;
  }
  return x;
}

TEST(CpuExpertPool, MatchesMoeForward) {
  auto w = ModelWeights::load(make_synthetic_model(tiny_moe_config(1)), load_linear);
  const ModelSpec& c = w->config;
  const MoeWeights& moe = *w->layers[0].moe;
  const int64_t D = c.hidden_size;
  CpuExpertPool pool;
  for (int64_t S : {1, 7, 40}) {
    auto x = random_rows(S, D, uint32_t(S));
    std::vector<float> want(size_t(S * D)), got(size_t(S * D));
    cpu::moe_forward(moe, c, x.data(), S, want.data());
    Routed r = route(moe, c, x, S);
    cpu::mlp_forward(*moe.shared, x.data(), S, got.data());  // the GPU side would add the shared expert
    auto jobs = CpuExpertPool::group(r.ids, r.weights, moe);
    size_t routed = 0;
    for (const auto& j : jobs) routed += j.tokens.size();
    EXPECT_EQ(routed, size_t(S * c.experts_per_token));
    pool.submit(std::move(jobs), x.data(), D, got.data()).get();
    double max_err = 0, max_ref = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      max_err = std::max(max_err, double(std::fabs(got[i] - want[i])));
      max_ref = std::max(max_ref, double(std::fabs(want[i])));
    }
    EXPECT_GT(max_ref, 0);
    EXPECT_LE(max_err, 1e-6 * max_ref) << "S=" << S;
  }
}

TEST(CpuExpertPool, SplitBatchesAccumulateAndErrorsPropagate) {
  auto w = ModelWeights::load(make_synthetic_model(tiny_moe_config(1)), load_linear);
  const ModelSpec& c = w->config;
  const MoeWeights& moe = *w->layers[0].moe;
  const int64_t D = c.hidden_size, S = 5;
  auto x = random_rows(S, D, 99);
  Routed r = route(moe, c, x, S);
  auto jobs = CpuExpertPool::group(r.ids, r.weights, moe);
  std::vector<float> whole(size_t(S * D), 0.0f), parts(size_t(S * D), 0.0f);
  CpuExpertPool::run(jobs, x.data(), D, whole.data());
  // Two asynchronous halves into the same buffer run in submission order: same sums.
  CpuExpertPool pool;
  std::vector<CpuExpertJob> first(jobs.begin(), jobs.begin() + long(jobs.size() / 2)), second(jobs.begin() + long(jobs.size() / 2), jobs.end());
  auto f1 = pool.submit(first, x.data(), D, parts.data());
  auto f2 = pool.submit(second, x.data(), D, parts.data());
  f1.get();
  f2.get();
  for (size_t i = 0; i < whole.size(); ++i) ASSERT_FLOAT_EQ(whole[i], parts[i]);
  CpuExpertJob bad{nullptr, {0}, {1.0f}};
  auto f3 = pool.submit({bad}, x.data(), D, parts.data());
  EXPECT_THROW(f3.get(), Error);
  EXPECT_THROW(CpuExpertPool::group({{0, 99}}, {{1.0f, 1.0f}}, moe), Error);
}

}  // namespace
}  // namespace moesrv
