// Gated delta rule (KDA / GDN) kernels: recurrent and chunked against a double-precision recurrence; conv1d, l2norm.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/cpu/delta_rule.h"

using namespace moesrv::cpu;

namespace {

struct Inputs {
  DeltaRuleShape s;
  int64_t T;
  std::vector<float> q, k, v, g, beta, state0;
};

float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// q, k L2-normalised (q scaled by dk^-0.5), beta in (0,1); KDA g = -gmax*sigmoid(x), GDN g = -exp(a_h)*softplus(x).
Inputs make_inputs(DeltaRuleShape s, int64_t T, uint32_t seed, float gmax = 5.f, bool zero_state = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> N(0.f, 1.f);
  Inputs in{s, T, {}, {}, {}, {}, {}, {}};
  const int64_t H = s.heads;
  in.q.resize(size_t(T * H * s.dk)), in.k.resize(in.q.size()), in.v.resize(size_t(T * H * s.dv));
  for (auto* x : {&in.q, &in.k, &in.v})
    for (float& f : *x) f = N(rng);
  l2_normalize_rows(in.q.data(), T * H, s.dk);
  l2_normalize_rows(in.k.data(), T * H, s.dk);
  for (float& f : in.q) f /= std::sqrt(float(s.dk));
  in.beta.resize(size_t(T * H));
  for (float& f : in.beta) f = sigmoid(N(rng));
  if (s.per_channel_decay) {
    in.g.resize(size_t(T * H * s.dk));
    for (float& f : in.g) f = -gmax * sigmoid(N(rng));
  } else {
    std::vector<float> a(static_cast<size_t>(H));
    for (float& f : a) f = std::uniform_real_distribution<float>(-1.f, 1.5f)(rng);
    in.g.resize(size_t(T * H));
    for (int64_t i = 0; i < T * H; ++i) in.g[size_t(i)] = -std::exp(a[size_t(i % H)]) * std::log1p(std::exp(N(rng)));
  }
  in.state0.assign(size_t(H * s.dk * s.dv), 0.f);
  if (!zero_state)
    for (float& f : in.state0) f = 0.5f * N(rng);
  return in;
}

// The per-token definition, in double.
void naive(const Inputs& in, std::vector<double>& S, std::vector<double>& out) {
  const auto& s = in.s;
  const int64_t H = s.heads, dk = s.dk, dv = s.dv;
  S.assign(in.state0.begin(), in.state0.end());
  out.assign(size_t(in.T * H * dv), 0.0);
  std::vector<double> u(static_cast<size_t>(dv));
  for (int64_t t = 0; t < in.T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t ti = t * H + h;
      double* Sh = S.data() + h * dk * dv;
      const float *q = &in.q[size_t(ti * dk)], *k = &in.k[size_t(ti * dk)], *v = &in.v[size_t(ti * dv)];
      std::fill(u.begin(), u.end(), 0.0);
      for (int64_t c = 0; c < dk; ++c) {
        const double e = std::exp(double(s.per_channel_decay ? in.g[size_t(ti * dk + c)] : in.g[size_t(ti)]));
        for (int64_t j = 0; j < dv; ++j) u[size_t(j)] += k[c] * (Sh[c * dv + j] *= e);
      }
      for (int64_t j = 0; j < dv; ++j) u[size_t(j)] = in.beta[size_t(ti)] * (v[j] - u[size_t(j)]);
      for (int64_t c = 0; c < dk; ++c)
        for (int64_t j = 0; j < dv; ++j) {
          Sh[c * dv + j] += k[c] * u[size_t(j)];
          out[size_t(ti * dv + j)] += q[c] * Sh[c * dv + j];
        }
    }
}

// max |a - ref| / max |ref|
template <typename A, typename B>
double rel_err(const A& a, const B& ref) {
  double num = 0, den = 1e-30;
  for (size_t i = 0; i < ref.size(); ++i) {
    num = std::max(num, std::abs(double(a[i]) - double(ref[i])));
    den = std::max(den, std::abs(double(ref[i])));
  }
  return num / den;
}

using Kernel = void (*)(const DeltaRuleShape&, int64_t, const float*, const float*, const float*, const float*,
                        const float*, float*, float*);

// Runs `fn` over tokens [t0, t0 + n) of `in`, carrying `state`.
void run_range(Kernel fn, const Inputs& in, int64_t t0, int64_t n, std::vector<float>& state, std::vector<float>& out) {
  const auto& s = in.s;
  const int64_t H = s.heads, gw = s.per_channel_decay ? s.dk : 1;
  out.resize(size_t(in.T * H * s.dv));
  fn(s, n, &in.q[size_t(t0 * H * s.dk)], &in.k[size_t(t0 * H * s.dk)], &in.v[size_t(t0 * H * s.dv)],
     &in.g[size_t(t0 * H * gw)], &in.beta[size_t(t0 * H)], state.data(), &out[size_t(t0 * H * s.dv)]);
}

void check_against_naive(DeltaRuleShape s, int64_t T, uint32_t seed, float gmax = 5.f, double tol = 1e-5) {
  const Inputs in = make_inputs(s, T, seed, gmax, seed % 2 == 0);
  std::vector<double> S_ref, o_ref;
  naive(in, S_ref, o_ref);
  for (Kernel fn : {Kernel(delta_rule_recurrent), Kernel(delta_rule_chunked)}) {
    std::vector<float> S = in.state0, out;
    run_range(fn, in, 0, T, S, out);
    const bool chunked = fn == Kernel(delta_rule_chunked);
    SCOPED_TRACE(::testing::Message() << (chunked ? "chunked" : "recurrent") << " H=" << s.heads << " dk=" << s.dk
                                      << " dv=" << s.dv << " kda=" << s.per_channel_decay << " T=" << T);
    EXPECT_LT(rel_err(out, o_ref), tol);
    EXPECT_LT(rel_err(S, S_ref), tol);
  }
}

const DeltaRuleShape kShapes[] = {{4, 32, 32, true}, {2, 16, 24, true}, {4, 32, 32, false}, {2, 16, 24, false}};

}  // namespace

TEST(DeltaRule, MatchesDoubleRecurrence) {
  uint32_t seed = 1;
  for (const auto& s : kShapes)
    for (int64_t T : {1, 63, 64, 65, 200}) check_against_naive(s, T, seed++);
}

TEST(DeltaRule, WideHeads) {  // full 64-column blocks in the recurrence, 32-wide GEMM panels, a 16-column tail
  check_against_naive({2, 128, 80, true}, 130, 7);
  check_against_naive({2, 64, 136, false}, 70, 8);
}

TEST(DeltaRule, StrongDecay) {  // sub-block spans beyond exp's range take the direct-exp path
  check_against_naive({2, 32, 32, true}, 150, 11, 30.f);
  check_against_naive({2, 32, 48, true}, 90, 12, 12.f);
}

TEST(DeltaRule, SegmentsCarryState) {
  for (const auto& s : kShapes) {
    const Inputs in = make_inputs(s, 137, 21);
    std::vector<float> S1 = in.state0, o1, S2 = in.state0, o2, S3 = in.state0, o3;
    run_range(delta_rule_chunked, in, 0, 137, S1, o1);
    run_range(delta_rule_chunked, in, 0, 100, S2, o2);  // prefill in two segments
    run_range(delta_rule_chunked, in, 100, 37, S2, o2);
    run_range(delta_rule_chunked, in, 0, 100, S3, o3);  // prefill then token-by-token decode
    for (int64_t t = 100; t < 137; ++t) run_range(delta_rule_recurrent, in, t, 1, S3, o3);
    EXPECT_LT(rel_err(o2, o1), 1e-5);
    EXPECT_LT(rel_err(S2, S1), 1e-5);
    EXPECT_LT(rel_err(o3, o1), 1e-5);
    EXPECT_LT(rel_err(S3, S1), 1e-5);
  }
}

TEST(DeltaRule, ZeroTokensIsNoOp) {
  const Inputs in = make_inputs({2, 16, 24, true}, 1, 3);
  std::vector<float> S = in.state0;
  delta_rule_chunked(in.s, 0, nullptr, nullptr, nullptr, nullptr, nullptr, S.data(), nullptr);
  delta_rule_recurrent(in.s, 0, nullptr, nullptr, nullptr, nullptr, nullptr, S.data(), nullptr);
  EXPECT_EQ(S, in.state0);
}

TEST(CausalConv1d, SegmentsEqualOnePassAndDefinition) {
  const int64_t T = 19, C = 37, K = 4;
  std::mt19937 rng(5);
  std::normal_distribution<float> N(0.f, 1.f);
  std::vector<float> x(size_t(T * C)), w(size_t(C * K));
  for (float& f : x) f = N(rng);
  for (float& f : w) f = 0.5f * N(rng);
  std::vector<float> st1(size_t((K - 1) * C), 0.f), y1(size_t(T * C));
  causal_conv1d_silu(x.data(), T, C, w.data(), K, st1.data(), y1.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double a = 0;
      for (int64_t j = 0; j < K; ++j)
        if (int64_t i = t - (K - 1) + j; i >= 0) a += double(w[size_t(c * K + j)]) * x[size_t(i * C + c)];
      EXPECT_NEAR(y1[size_t(t * C + c)], a / (1 + std::exp(-a)), 1e-5 * (1 + std::abs(a)));
    }
  for (int64_t c = 0; c < C; ++c)
    for (int64_t r = 0; r < K - 1; ++r) EXPECT_EQ(st1[size_t(r * C + c)], x[size_t((T - K + 1 + r) * C + c)]);
  // Segments of 1, 2 (< K-1), 5, 1, 1, 9 tokens with the state carried.
  std::vector<float> st2(size_t((K - 1) * C), 0.f), y2(size_t(T * C));
  int64_t t0 = 0;
  for (int64_t n : {1, 2, 5, 1, 1, 9}) {
    causal_conv1d_silu(x.data() + t0 * C, n, C, w.data(), K, st2.data(), y2.data() + t0 * C);
    t0 += n;
  }
  ASSERT_EQ(t0, T);
  EXPECT_EQ(y2, y1);
  EXPECT_EQ(st2, st1);
}

TEST(L2Normalize, MatchesDefinition) {
  const int64_t rows = 5, n = 37;
  std::vector<float> x(size_t(rows * n));
  std::mt19937 rng(9);
  std::normal_distribution<float> N(0.f, 2.f);
  for (float& f : x) f = N(rng);
  std::vector<float> y = x;
  l2_normalize_rows(y.data(), rows, n);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[size_t(r * n + i)]) * x[size_t(r * n + i)];
    for (int64_t i = 0; i < n; ++i)
      EXPECT_NEAR(y[size_t(r * n + i)], x[size_t(r * n + i)] / std::sqrt(ss + 1e-6), 1e-6);
  }
}
