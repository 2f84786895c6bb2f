// EXL3 GEMV strip kernels (every instruction-set path the CPU runs) against the reference tile decoder.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "backend/cpu/exl3_gemv.h"
#include "format/exl3_tile.h"

using namespace moesrv;

namespace {

constexpr Exl3GemvPath kPaths[] = {Exl3GemvPath::Scalar, Exl3GemvPath::Avx2,       Exl3GemvPath::Avx2Vnni,
                                   Exl3GemvPath::Avx512, Exl3GemvPath::Avx512Vbmi, Exl3GemvPath::Avx512Fp16};
constexpr Exl3Codebook kCodebooks[] = {Exl3Codebook::Inst3, Exl3Codebook::Mcg, Exl3Codebook::Mul1};

struct Matrix {
  std::vector<uint16_t> trellis;  // sized exactly, so the last tiles sit at the end of the allocation
  Exl3Weights w;
};

Matrix random_matrix(int K, Exl3Codebook cb, int64_t in, int64_t out, uint32_t seed) {
  Matrix m;
  m.trellis.resize(size_t(in / 16 * out / 16 * 16 * K));
  std::mt19937 rng(seed);
  for (auto& v : m.trellis) v = uint16_t(rng());
  m.w.K = K;
  m.w.codebook = cb;
  m.w.in_pad = in;
  m.w.out_pad = out;
  m.w.trellis = m.trellis.data();
  return m;
}

// W_hat [in_pad][out_pad] through exl3_decode_tile and the codebook table.
std::vector<float> reference(const Exl3Weights& w) {
  std::vector<float> ref(size_t(w.in_pad * w.out_pad));
  float tile[256];
  for (int64_t kt = 0; kt < w.tiles_k(); ++kt)
    for (int64_t nt = 0; nt < w.tiles_n(); ++nt) {
      exl3_decode_tile(w.tile(kt, nt), w.K, w.table(), tile);
      for (int i = 0; i < 256; ++i) ref[size_t((kt * 16 + i / 16) * w.out_pad + nt * 16 + i % 16)] = tile[i];
    }
  return ref;
}

// (through the path that runs w)
std::vector<float> gemv(Exl3GemvPath asked, const Exl3Weights& w, const std::vector<float>& x, int64_t n) {
  const Exl3GemvPath p = exl3_gemv_path_for(asked, w);
  std::vector<float> xs(size_t(n * exl3_activation_floats(p, w.in_pad))), y(size_t(n * w.out_pad));
  exl3_prepare_activations(p, x.data(), n, w.in_pad, xs.data());
  for (int64_t nt = 0; nt < w.tiles_n(); ++nt) exl3_gemv_strip(p, w, xs.data(), n, nt, y.data(), w.out_pad);
  return y;
}

// One-hot rows pick single weights: every decoded value must come out exactly, for row counts cycling 1..8.
void expect_exact_weights(Exl3GemvPath p, const Exl3Weights& w, const std::vector<float>& ref) {
  int64_t n = 1;
  for (int64_t k0 = 0; k0 < w.in_pad; k0 += n, n = n % kExl3GemvMaxRows + 1) {
    const int64_t rows = std::min(n, w.in_pad - k0);
    std::vector<float> x(size_t(rows * w.in_pad), 0.0f);
    for (int64_t r = 0; r < rows; ++r) x[size_t(r * w.in_pad + k0 + r)] = 1.0f;
    const std::vector<float> y = gemv(p, w, x, rows);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < w.out_pad; ++c)
        ASSERT_EQ(y[size_t(r * w.out_pad + c)], ref[size_t((k0 + r) * w.out_pad + c)])
            << exl3_gemv_path_name(p) << " K=" << w.K << " " << exl3_codebook_name(w.codebook) << " rows " << rows
            << " k " << k0 + r << " col " << c;
  }
}

}  // namespace

TEST(Exl3Gemv, EveryPathDecodesExactlyForEveryKAndCodebook) {
  for (Exl3GemvPath p : kPaths) {
    if (!exl3_gemv_path_supported(p)) {
      printf("path %s: not supported here, skipped\n", exl3_gemv_path_name(p));
      continue;
    }
    for (Exl3Codebook cb : kCodebooks)
      for (int K = 1; K <= kExl3MaxK; ++K) {
        Matrix m = random_matrix(K, cb, 128, 64, uint32_t(K * 7 + int(cb)));
        expect_exact_weights(p, m.w, reference(m.w));
      }
  }
}

// K = 8 tiles whose states cover all 65536 values (state t = v[t-1] << 8 | v[t]): every codebook value.
TEST(Exl3Gemv, EveryPathDecodesAllStates) {
  const int K = 8;
  for (Exl3Codebook cb : kCodebooks) {
    Matrix m = random_matrix(K, cb, 256, 512, 1);
    for (int64_t i = 0; i < 512; ++i) {
      uint16_t v[256], states[256];
      for (int t = 0; t < 256; ++t) v[t] = uint16_t(t % 2 ? (t / 2) + 128 * (i / 256) : i % 256);
      for (int t = 0; t < 256; ++t) states[t] = uint16_t(v[(t + 255) % 256] << 8 | v[t]);
      ASSERT_TRUE(exl3_pack_tile(states, K, m.trellis.data() + i * 16 * K));
    }
    const std::vector<float> ref = reference(m.w);
    for (Exl3GemvPath p : kPaths)
      if (exl3_gemv_path_supported(p)) expect_exact_weights(p, m.w, ref);
  }
}

TEST(Exl3Gemv, EveryPathMatchesDoubleSums) {
  for (Exl3GemvPath p : kPaths) {
    if (!exl3_gemv_path_supported(p)) continue;
    for (int K : {2, 3, 4}) {
      Matrix m = random_matrix(K, Exl3Codebook::Mul1, 256, 128, uint32_t(K));
      const std::vector<float> ref = reference(m.w);
      for (int64_t n = 1; n <= kExl3GemvMaxRows; ++n) {
        std::mt19937 rng{uint32_t(n)};
        std::normal_distribution<float> nd;
        std::vector<float> x(size_t(n * m.w.in_pad));
        for (auto& v : x) v = nd(rng);
        const std::vector<float> y = gemv(p, m.w, x, n);
        for (int64_t r = 0; r < n; ++r)
          for (int64_t c = 0; c < m.w.out_pad; ++c) {
            double s = 0, mag = 0;
            for (int64_t k = 0; k < m.w.in_pad; ++k) {
              s += double(x[size_t(r * m.w.in_pad + k)]) * ref[size_t(k * m.w.out_pad + c)];
              mag += std::abs(double(x[size_t(r * m.w.in_pad + k)]) * ref[size_t(k * m.w.out_pad + c)]);
            }
            ASSERT_NEAR(y[size_t(r * m.w.out_pad + c)], s, 1e-6 * mag)
                << exl3_gemv_path_name(p) << " K=" << K << " n=" << n << " r " << r << " c " << c;
          }
      }
    }
  }
}

// Avx512Int8 (opt-in) against double sums of the exact fp16 weights, within its stated error: each weight without
// its fp16 rounding (<= 2^-11 relative, 2^-25 absolute below fp16's normal range), each input off by <= 1/64516 of
// its 128-block's largest, and fp32 sums (1e-6 of the magnitudes, the constant term's included).
TEST(Exl3Gemv, Int8PathStaysWithinItsBound) {
  if (!exl3_gemv_path_supported(Exl3GemvPath::Avx512Int8)) GTEST_SKIP() << "no AVX-512 VBMI + VNNI here";
  const double kConst = 3.46;  // |C| of Mul1's A * bs + C, the constant term's magnitude per unit input
  double worst = 0;            // largest error over its bound
  for (int K : {1, 2, 3, 4, 6, 8})
    for (int64_t in : {128, 1024}) {
      Matrix m = random_matrix(K, Exl3Codebook::Mul1, in, 64, uint32_t(K * 31 + in));
      ASSERT_EQ(exl3_gemv_path_for(Exl3GemvPath::Avx512Int8, m.w), Exl3GemvPath::Avx512Int8);
      const std::vector<float> ref = reference(m.w);
      for (int64_t n : {1, 3, 8}) {
        std::mt19937 rng{uint32_t(n * 7 + K)};
        std::normal_distribution<float> nd;
        std::vector<float> x(size_t(n * in));
        for (auto& v : x) v = nd(rng);
        x[size_t(in / 2)] = 40.0f;  // an outlier: its block's other inputs lose precision, within the bound
        const std::vector<float> y = gemv(Exl3GemvPath::Avx512Int8, m.w, x, n);
        for (int64_t r = 0; r < n; ++r) {
          const float* xr = x.data() + r * in;
          std::vector<double> block_max(size_t(in / 128), 0.0);
          for (int64_t k = 0; k < in; ++k)
            block_max[size_t(k / 128)] = std::max(block_max[size_t(k / 128)], double(std::abs(xr[k])));
          for (int64_t c = 0; c < m.w.out_pad; ++c) {
            double s = 0, bound = 0, mag = 0;
            for (int64_t k = 0; k < in; ++k) {
              const double wk = ref[size_t(k * m.w.out_pad + c)], xk = xr[k];
              const double we = std::ldexp(std::abs(wk), -11) + std::ldexp(1.0, -25);
              s += xk * wk;
              bound += std::abs(xk) * we + block_max[size_t(k / 128)] / 64516.0 * (std::abs(wk) + we);
              mag += std::abs(xk) * (std::abs(wk) + kConst);
            }
            bound += 1e-6 * mag;
            const double err = std::abs(double(y[size_t(r * m.w.out_pad + c)]) - s);
            worst = std::max(worst, err / bound);
            ASSERT_LE(err, bound) << "K=" << K << " in " << in << " n=" << n << " r " << r << " c " << c;
          }
        }
      }
    }
  printf("avx512-int8: largest error %.2f of its bound\n", worst);
}

TEST(Exl3Gemv, Int8PathGivesNanForNonFiniteInputs) {
  if (!exl3_gemv_path_supported(Exl3GemvPath::Avx512Int8)) GTEST_SKIP() << "no AVX-512 VBMI + VNNI here";
  Matrix m = random_matrix(4, Exl3Codebook::Mul1, 256, 32, 5);
  std::vector<float> x(256, 0.5f);
  x[200] = std::numeric_limits<float>::infinity();
  for (float v : gemv(Exl3GemvPath::Avx512Int8, m.w, x, 1)) EXPECT_TRUE(std::isnan(v));
}

TEST(Exl3Gemv, Int8PathHandsOtherWeightsToVbmi) {
  Matrix mcg = random_matrix(4, Exl3Codebook::Mcg, 128, 32, 1), odd = random_matrix(4, Exl3Codebook::Mul1, 144, 32, 2);
  EXPECT_EQ(exl3_gemv_path_for(Exl3GemvPath::Avx512Int8, mcg.w), Exl3GemvPath::Avx512Vbmi);
  EXPECT_EQ(exl3_gemv_path_for(Exl3GemvPath::Avx512Int8, odd.w), Exl3GemvPath::Avx512Vbmi);
  EXPECT_EQ(exl3_gemv_path_for(Exl3GemvPath::Avx512Vbmi, mcg.w), Exl3GemvPath::Avx512Vbmi);
  EXPECT_EQ(exl3_gemv_path_for(Exl3GemvPath::Avx2, mcg.w), Exl3GemvPath::Avx2);
  EXPECT_EQ(exl3_gemv_path_for(Exl3GemvPath::Avx512Fp16, mcg.w), Exl3GemvPath::Avx512Fp16);  // every codebook
  EXPECT_EQ(exl3_gemv_path_for(Exl3GemvPath::Avx512Fp16, odd.w), Exl3GemvPath::Avx512Fp16);  // any input width
}

TEST(Exl3Gemv, BestPathIsSupported) {
  EXPECT_TRUE(exl3_gemv_path_supported(exl3_gemv_best_path()));
  EXPECT_TRUE(exl3_gemv_path_supported(exl3_gemv_default_path()));
  printf("best path here: %s\n", exl3_gemv_path_name(exl3_gemv_best_path()));
}
