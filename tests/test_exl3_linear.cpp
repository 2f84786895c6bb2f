// EXL3 linear layers: encoder round trip, Exl3Linear forward vs a dense reference, package load path.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "backend/cpu/exl3_linear.h"
#include "format/exl3_encode.h"
#include "format/safetensors.h"
#include "util/error.h"
#include "util/numeric.h"

using namespace moesrv;

namespace {

std::vector<float> randn(size_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return num / den;
}

std::vector<float> dequant(const Linear& l) {
  std::vector<float> w(size_t(l.out_features() * l.in_features()));
  l.dequant_rows(0, l.out_features(), w.data());
  return w;
}

// y = x W^T + b in double
std::vector<float> dense_ref(const std::vector<float>& w, const std::vector<float>& bias, const float* x, int64_t n,
                             int64_t out, int64_t in) {
  std::vector<float> y(size_t(n * out));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double s = bias.empty() ? 0.0 : bias[size_t(o)];
      for (int64_t i = 0; i < in; ++i) s += double(x[r * in + i]) * w[size_t(o * in + i)];
      y[size_t(r * out + o)] = float(s);
    }
  return y;
}

std::string temp_dir(const std::string& name) {
  auto d = std::filesystem::temp_directory_path() / ("moesrv_test_exl3_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(d);
  return d.string();
}

}  // namespace

TEST(Exl3Encode, ErrorMatchesBitrateAndFallsWithK) {
  const int64_t out = 256, in = 256;
  auto w = randn(size_t(out * in), 1, 0.02f);
  double prev = 1e9;
  for (int K : {2, 3, 4, 5}) {
    Exl3EncodeOptions opt;
    opt.K = K;
    auto enc = exl3_encode(w.data(), out, in, opt);
    Exl3Linear lin(enc.weights, {}, in, out);
    double e = rel_err(dequant(lin), w);
    printf("K=%d mul1: relative MSE %.5f (rotated basis %.5f)\n", K, e, enc.rotated_rel_mse);
    EXPECT_LT(e, prev) << K;
    EXPECT_NEAR(e, enc.rotated_rel_mse, 0.15 * e + 1e-4) << "orthogonal rotation keeps the error";
    if (K == 2) {
      EXPECT_LT(e, 0.09);
    }
    if (K == 4) {
      EXPECT_LT(e, 0.015);
    }
    prev = e;
  }
}

TEST(Exl3Encode, AllCodebooksRoundTrip) {
  const int64_t out = 128, in = 128;
  auto w = randn(size_t(out * in), 2);
  for (auto cb : {Exl3Codebook::Inst3, Exl3Codebook::Mcg, Exl3Codebook::Mul1}) {
    Exl3EncodeOptions opt;
    opt.K = 3;
    opt.codebook = cb;
    auto enc = exl3_encode(w.data(), out, in, opt);
    Exl3Linear lin(enc.weights, {}, in, out);
    double e = rel_err(dequant(lin), w);
    printf("K=3 %s: relative MSE %.5f\n", std::string(exl3_codebook_name(cb)).c_str(), e);
    EXPECT_LT(e, 0.04);
  }
}

TEST(Exl3Linear, ForwardMatchesDenseReferenceIncludingPadding) {
  struct Shape { int64_t out, in; };
  for (Shape sh : {Shape{128, 128}, Shape{96, 200}, Shape{384, 256}, Shape{32, 128}}) {
    auto w = randn(size_t(sh.out * sh.in), 3, 0.05f);
    auto bias = randn(size_t(sh.out), 4);
    Exl3EncodeOptions opt;
    opt.K = 3;
    opt.scale_search = false;
    auto enc = exl3_encode(w.data(), sh.out, sh.in, opt);
    EXPECT_EQ(enc.weights.in_pad % 128, 0);
    EXPECT_EQ(enc.weights.out_pad % 128, 0);
    Exl3Linear lin(enc.weights, bias, sh.in, sh.out);
    EXPECT_EQ(lin.in_features(), sh.in);
    EXPECT_EQ(lin.out_features(), sh.out);
    auto wd = dequant(lin);
    for (int64_t n : {1, 3, 8, 11}) {
      auto x = randn(size_t(n * sh.in), uint32_t(5 + n));
      std::vector<float> y(size_t(n * sh.out), NAN);
      lin.forward(x.data(), n, y.data());
      auto ref = dense_ref(wd, bias, x.data(), n, sh.out, sh.in);
      EXPECT_LT(rel_err(y, ref), 1e-10) << sh.out << "x" << sh.in << " n=" << n;
    }
    // partial dequant rows agree with the full one
    std::vector<float> part(size_t(5 * sh.in));
    lin.dequant_rows(sh.out - 5, sh.out, part.data());
    for (int64_t i = 0; i < 5 * sh.in; ++i) ASSERT_EQ(part[size_t(i)], wd[size_t((sh.out - 5) * sh.in + i)]);
  }
}

// Any bit pattern is a valid trellis: random streams for every codebook and K, through both CPU product paths
// (decode-in-register for <= 8 rows, decoded tiles for more) against the dequantized matrix.
TEST(Exl3Linear, ForwardMatchesDequantForEveryCodebookAndK) {
  const int64_t in = 256, out = 384;
  std::mt19937 rng(11);
  for (auto cb : {Exl3Codebook::Inst3, Exl3Codebook::Mcg, Exl3Codebook::Mul1})
    for (int K : {1, 2, 3, 4, 5, 8}) {
      auto trellis = std::make_shared<std::vector<uint16_t>>(size_t(in / 16 * out / 16 * 16 * K));
      for (auto& v : *trellis) v = uint16_t(rng());
      Exl3Weights w;
      w.K = K;
      w.codebook = cb;
      w.in_pad = in;
      w.out_pad = out;
      w.trellis = trellis->data();
      w.owner = trellis;
      w.suh = randn(size_t(in), uint32_t(K), 1.0f);
      w.svh = randn(size_t(out), uint32_t(K + 1), 0.02f);
      Exl3Linear lin(w, {}, in, out);
      auto wd = dequant(lin);
      for (int64_t n : {1, 2, 8, 9}) {
        auto x = randn(size_t(n * in), uint32_t(100 + n));
        std::vector<float> y(size_t(n * out), NAN);
        lin.forward(x.data(), n, y.data());
        EXPECT_LT(rel_err(y, dense_ref(wd, {}, x.data(), n, out, in)), 1e-10)
            << exl3_codebook_name(cb) << " K=" << K << " n=" << n;
      }
    }
}

TEST(Exl3Linear, LoadsFromPackageWithShapeMetadataAndLegacySigns) {
  const int64_t out = 96, in = 128;
  auto w = randn(size_t(out * in), 9, 0.03f);
  Exl3EncodeOptions opt;
  opt.K = 4;
  opt.codebook = Exl3Codebook::Mcg;
  opt.out_scales = false;  // svh = pure signs, so the legacy packed-sign form is exact
  opt.scale_search = false;
  auto enc = exl3_encode(w.data(), out, in, opt);
  std::vector<uint16_t> bias_f16(static_cast<size_t>(out));
  for (auto& b : bias_f16) b = f32_to_f16(0.25f);

  auto views = enc.tensor_views("blk.a");
  TensorView bv;
  bv.name = "blk.a.bias";
  bv.dtype = DType::F16;
  bv.shape = {out};
  bv.data = reinterpret_cast<const uint8_t*>(bias_f16.data());
  bv.nbytes = size_t(out) * 2;
  views.push_back(bv);
  // legacy copy of the same layer: signs packed into .sv (svh has no scale here), suh kept
  std::vector<uint16_t> sv_packed(size_t(enc.weights.out_pad / 16), 0);
  for (int64_t o = 0; o < enc.weights.out_pad; ++o)
    if (enc.weights.svh[size_t(o)] < 0) sv_packed[size_t(o / 16)] |= uint16_t(1u << (o % 16));
  for (auto v : enc.tensor_views("blk.b")) {
    if (v.name == "blk.b.svh") {
      v.name = "blk.b.sv";
      v.dtype = DType::I16;
      v.shape = {int64_t(sv_packed.size())};
      v.data = reinterpret_cast<const uint8_t*>(sv_packed.data());
      v.nbytes = sv_packed.size() * 2;
    }
    views.push_back(v);
  }
  std::string dir = temp_dir("pkg");
  write_safetensors(dir + "/model.safetensors", views, {{"exl3.shape.blk.a", "96,128"}});
  std::ofstream(dir + "/config.json") << "{}";
  auto pkg = ModelPackage::open(dir);

  auto a = load_linear(*pkg, "blk.a");
  EXPECT_EQ(a->kind(), "exl3-k4-mcg");
  EXPECT_EQ(a->out_features(), out);
  EXPECT_EQ(a->in_features(), in);
  auto b = make_exl3_linear(*pkg, "blk.b", in, out);
  auto x = randn(size_t(2 * in), 10);
  std::vector<float> ya(size_t(2 * out)), yb(size_t(2 * out)), yref(size_t(2 * out));
  a->forward(x.data(), 2, ya.data());
  b->forward(x.data(), 2, yb.data());
  Exl3Linear ref(enc.weights, std::vector<float>(size_t(out), 0.25f), in, out);
  ref.forward(x.data(), 2, yref.data());
  for (size_t i = 0; i < ya.size(); ++i) {
    ASSERT_EQ(ya[i], yref[i]);
    ASSERT_NEAR(yb[i], yref[i] - 0.25f, 1e-5);
  }
  auto unpadded = load_linear(*pkg, "blk.b");  // no metadata: stored (padded) shape
  EXPECT_EQ(unpadded->out_features(), 128);
  std::filesystem::remove_all(dir);
}

TEST(Exl3Linear, RejectsBrokenTensors) {
  auto w = randn(128 * 128, 12);
  Exl3EncodeOptions opt;
  opt.K = 2;
  opt.scale_search = false;
  auto enc = exl3_encode(w.data(), 128, 128, opt);
  auto views = enc.tensor_views("x");
  views.erase(views.begin() + 1);  // drop .suh
  std::string dir = temp_dir("broken");
  write_safetensors(dir + "/model.safetensors", views);
  std::ofstream(dir + "/config.json") << "{}";
  auto pkg = ModelPackage::open(dir);
  try {
    load_linear(*pkg, "x");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x.suh"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}
