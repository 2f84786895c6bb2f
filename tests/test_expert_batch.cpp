// cpu::experts_forward (several experts in shared parallel_fors) against mlp_forward one expert at a time.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/exl3_gemv.h"
#include "backend/cpu/exl3_linear.h"
#include "backend/cpu/expert_batch.h"

using namespace moesrv;

namespace {

std::vector<float> randn(size_t n, std::mt19937& rng, float sd = 1.0f) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

int64_t pad128(int64_t v) { return (v + 127) / 128 * 128; }

// A random EXL3 linear in -> out (logical), trellis owned by the weights.
std::unique_ptr<Linear> exl3(int K, Exl3Codebook cb, int64_t in, int64_t out, bool bias, std::mt19937& rng) {
  Exl3Weights w;
  w.K = K;
  w.codebook = cb;
  w.in_pad = pad128(in);
  w.out_pad = pad128(out);
  auto tr = std::make_shared<std::vector<uint16_t>>(size_t(w.in_pad / 16 * w.out_pad / 16 * 16 * K));
  for (auto& v : *tr) v = uint16_t(rng());
  w.trellis = tr->data();
  w.owner = tr;
  w.suh = randn(size_t(w.in_pad), rng, 0.2f);
  w.svh = randn(size_t(w.out_pad), rng, 0.2f);
  return std::make_unique<Exl3Linear>(std::move(w), bias ? randn(size_t(out), rng) : std::vector<float>{}, in, out);
}

// A plain fp32 linear: experts with it take the per-expert fallback.
class F32Linear : public Linear {
 public:
  F32Linear(int64_t in, int64_t out, std::mt19937& rng) : w_(randn(size_t(in * out), rng, 0.1f)) {
    in_ = in;
    out_ = out;
  }
  void forward(const float* x, int64_t n, float* y) const override {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t o = 0; o < out_; ++o) {
        float s = 0;
        for (int64_t i = 0; i < in_; ++i) s += x[r * in_ + i] * w_[size_t(o * in_ + i)];
        y[r * out_ + o] = s;
      }
  }
  void dequant_rows(int64_t b, int64_t e, float* out) const override {
    std::copy(w_.begin() + b * in_, w_.begin() + e * in_, out);
  }
  std::string kind() const override { return "f32"; }
  size_t stored_bytes() const override { return w_.size() * 4; }

 private:
  std::vector<float> w_;
};

MlpWeights expert(int K, Exl3Codebook cb, int64_t hidden, int64_t inter, float limit, bool bias, std::mt19937& rng) {
  MlpWeights m;
  m.gate = exl3(K, cb, hidden, inter, bias, rng);
  m.up = exl3(K, cb, hidden, inter, false, rng);
  m.down = exl3(K, cb, inter, hidden, bias, rng);
  m.limit = limit;
  return m;
}

}  // namespace

TEST(ExpertBatch, MatchesMlpForwardPerExpertBitForBit) {
  std::mt19937 rng(5);
  const int64_t hidden = 250;  // padded to 256: zero-padded inputs, cut outputs
  std::vector<MlpWeights> experts;
  experts.push_back(expert(3, Exl3Codebook::Mul1, hidden, 128, 0.0f, false, rng));
  experts.push_back(expert(4, Exl3Codebook::Mul1, hidden, 200, 0.5f, true, rng));  // the clamp bites
  experts.push_back(expert(2, Exl3Codebook::Inst3, hidden, 256, 3.0f, false, rng));
  experts.push_back(expert(5, Exl3Codebook::Mcg, hidden, 384, 0.0f, true, rng));
  MlpWeights dense;
  dense.gate = std::make_unique<F32Linear>(hidden, 96, rng);
  dense.up = std::make_unique<F32Linear>(hidden, 96, rng);
  dense.down = std::make_unique<F32Linear>(96, hidden, rng);
  dense.limit = 1.0f;
  experts.push_back(std::move(dense));
  const int64_t rows[] = {1, 3, 8, 1, 2};
  // the same experts again with 9 rows: more than the GEMV takes, so mlp_forward
  std::vector<std::vector<float>> xs, ys, want;
  std::vector<cpu::ExpertRows> jobs;
  for (size_t e = 0; e < 6; ++e) {
    const int64_t n = e < 5 ? rows[e] : 9;
    xs.push_back(randn(size_t(n * hidden), rng));
    ys.emplace_back(size_t(n * hidden), -1.0f);
    want.emplace_back(size_t(n * hidden));
  }
  for (size_t e = 0; e < 6; ++e)
    jobs.push_back({&experts[e % 5], xs[e].data(), int64_t(xs[e].size()) / hidden, ys[e].data()});
  for (Exl3GemvPath p : kExl3GemvPaths) {
    if (p == Exl3GemvPath::Scalar || !exl3_gemv_path_supported(p)) continue;
    exl3_gemv_set_default_path(p);
    for (size_t e = 0; e < 6; ++e) {
      cpu::mlp_forward(experts[e % 5], xs[e].data(), int64_t(xs[e].size()) / hidden, want[e].data());
      std::fill(ys[e].begin(), ys[e].end(), -1.0f);
    }
    cpu::experts_forward(jobs);
    for (size_t e = 0; e < 6; ++e)
      ASSERT_EQ(0, std::memcmp(ys[e].data(), want[e].data(), ys[e].size() * 4))
          << "expert job " << e << " path " << exl3_gemv_path_name(p);
  }
  exl3_gemv_set_default_path(exl3_gemv_best_path());
}

TEST(ExpertBatch, ClampChangesTheResult) {
  // Guards the test above: with limit 0.5 the clamp must matter for these weights.
  std::mt19937 rng(9);
  MlpWeights a = expert(4, Exl3Codebook::Mul1, 256, 128, 0.5f, false, rng);
  std::vector<float> x = randn(256, rng), y1(256), y2(256);
  cpu::experts_forward({{&a, x.data(), 1, y1.data()}});
  a.limit = 0;
  cpu::experts_forward({{&a, x.data(), 1, y2.data()}});
  EXPECT_NE(0, std::memcmp(y1.data(), y2.data(), y1.size() * 4));
}

TEST(ExpertBatch, SlicesAddUpToTheExpert) {
  // An expert's intermediate range cut into slices (the CUDA engine computes one on the CPU while the GPU takes the
  // rest): the shares add up to the whole expert (the down sums split in two: fp32 rounding apart), the whole range
  // as one slice is the expert bit for bit, and unaligned bounds, a down bias or too many rows are refused.
  std::mt19937 rng(13);
  const int64_t hidden = 256, inter = 500;  // padded to 512: 4 blocks
  MlpWeights a = expert(3, Exl3Codebook::Mul1, hidden, inter, 2.0f, false, rng);
  const std::vector<float> x = randn(size_t(2 * hidden), rng);
  for (Exl3GemvPath p : kExl3GemvPaths) {
    if (p == Exl3GemvPath::Scalar || !exl3_gemv_path_supported(p)) continue;
    exl3_gemv_set_default_path(p);
    const int64_t n = std::min<int64_t>(2, exl3_gemv_fast_rows(p));  // (the AVX2 paths batch one row)
    int64_t padded = 0;
    ASSERT_TRUE(cpu::expert_slices_supported(a, n, &padded));
    EXPECT_EQ(padded, 512);
    std::vector<float> whole(size_t(n * hidden)), one(whole.size());
    cpu::mlp_forward(a, x.data(), n, whole.data());
    cpu::experts_forward({{&a, x.data(), n, one.data(), 0, padded}});
    ASSERT_EQ(0, std::memcmp(one.data(), whole.data(), whole.size() * 4)) << exl3_gemv_path_name(p);
    for (const std::vector<int64_t>& cuts : {std::vector<int64_t>{0, 128, 512}, std::vector<int64_t>{0, 256, 384, 512},
                                             std::vector<int64_t>{0, 384, 512}}) {
      std::vector<std::vector<float>> parts(cuts.size() - 1, std::vector<float>(whole.size()));
      std::vector<cpu::ExpertRows> jobs;
      for (size_t s = 0; s + 1 < cuts.size(); ++s)
        jobs.push_back({&a, x.data(), n, parts[s].data(), cuts[s], cuts[s + 1]});
      cpu::experts_forward(jobs);
      double err = 0, norm = 0;
      for (size_t i = 0; i < whole.size(); ++i) {
        float sum = 0;
        for (const auto& part : parts) sum += part[i];
        err = std::max(err, double(std::fabs(sum - whole[i])));
        norm = std::max(norm, double(std::fabs(whole[i])));
      }
      EXPECT_LE(err, 1e-5 * norm) << exl3_gemv_path_name(p) << ", " << cuts.size() - 1 << " slices";
      EXPECT_GT(norm, 0.0);
      // Through add_routed_experts: row r of x to out row n - 1 - r, weighted, added.
      std::vector<float> out(whole.size(), 1.0f);
      std::vector<cpu::RoutedRows> routed;
      for (size_t s = 0; s + 1 < cuts.size(); ++s) {
        cpu::RoutedRows& j = routed.emplace_back();
        j.expert = &a, j.inter0 = cuts[s], j.inter1 = cuts[s + 1];
        for (int32_t r = 0; r < n; ++r) j.tokens.push_back(r), j.weights.push_back(r ? 0.5f : -2.0f);
      }
      cpu::add_routed_experts(routed, x.data(), hidden, out.data());
      for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < hidden; ++i)
          EXPECT_NEAR(out[size_t(r * hidden + i)], 1.0f + (r ? 0.5f : -2.0f) * whole[size_t(r * hidden + i)],
                      3e-5 * norm);
    }
    std::vector<float> y(size_t(n * hidden));
    EXPECT_THROW(cpu::experts_forward({{&a, x.data(), n, y.data(), 64, 192}}), std::exception);
    EXPECT_THROW(cpu::experts_forward({{&a, x.data(), n, y.data(), 256, 128}}), std::exception);
    EXPECT_THROW(cpu::experts_forward({{&a, x.data(), n, y.data(), 0, 640}}), std::exception);
  }
  exl3_gemv_set_default_path(exl3_gemv_best_path());
  MlpWeights biased = expert(3, Exl3Codebook::Mul1, hidden, inter, 0.0f, true, rng);
  EXPECT_FALSE(cpu::expert_slices_supported(biased, 1));
  std::vector<float> y(static_cast<size_t>(hidden));
  EXPECT_THROW(cpu::experts_forward({{&biased, x.data(), 1, y.data(), 0, 128}}), std::exception);
  EXPECT_FALSE(cpu::expert_slices_supported(a, kExl3GemvMaxRows + 1));  // more rows than the batched path takes
  std::vector<float> x9 = randn(size_t(9 * hidden), rng), y9(x9.size());
  EXPECT_THROW(cpu::experts_forward({{&a, x9.data(), 9, y9.data(), 0, 128}}), std::exception);
}
