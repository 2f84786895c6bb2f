#include "backend/cpu/exl3_linear.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "backend/cpu/exl3_gemv.h"
#include "format/exl3_hadamard.h"
#include "format/exl3_tile.h"
#include "util/error.h"
#include "util/thread_pool.h"

namespace moesrv {

namespace {

constexpr int64_t kTilesPerChunk = 32;  // k-tiles decoded at once per strip: 512 x 16 fp32 = 32 KiB
constexpr int64_t kRowGroup = 8;        // activation rows accumulated together

// acc[r][0..16) += sum_k x[r][k] * w[k][0..16) for r < rows (<= kRowGroup), k < nk; x rows have stride ldx.
inline void strip_fma(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t nk, float* acc) {
#if defined(__AVX512F__)
  __m512 a[kRowGroup];
  for (int64_t r = 0; r < rows; ++r) a[r] = _mm512_loadu_ps(acc + r * 16);
  for (int64_t k = 0; k < nk; ++k) {
    __m512 wv = _mm512_loadu_ps(w + k * 16);
    for (int64_t r = 0; r < rows; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wv, a[r]);
  }
  for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(acc + r * 16, a[r]);
#elif defined(__AVX2__)
  __m256 a[kRowGroup][2];
  for (int64_t r = 0; r < rows; ++r) {
    a[r][0] = _mm256_loadu_ps(acc + r * 16);
    a[r][1] = _mm256_loadu_ps(acc + r * 16 + 8);
  }
  for (int64_t k = 0; k < nk; ++k) {
    __m256 w0 = _mm256_loadu_ps(w + k * 16), w1 = _mm256_loadu_ps(w + k * 16 + 8);
    for (int64_t r = 0; r < rows; ++r) {
      __m256 xv = _mm256_set1_ps(x[r * ldx + k]);
      a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    _mm256_storeu_ps(acc + r * 16, a[r][0]);
    _mm256_storeu_ps(acc + r * 16 + 8, a[r][1]);
  }
#else
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < nk; ++k)
      for (int c = 0; c < 16; ++c) acc[r * 16 + c] += x[r * ldx + k] * w[k * 16 + c];
#endif
}

}  // namespace

Exl3Linear::Exl3Linear(Exl3Weights w, std::vector<float> bias, int64_t in_features, int64_t out_features)
    : w_(std::move(w)) {
  MOESRV_CHECK(in_features > 0 && in_features <= w_.in_pad && out_features > 0 && out_features <= w_.out_pad,
               "EXL3 linear: logical shape {}x{} (out x in) does not fit the stored {}x{}", out_features, in_features,
               w_.out_pad, w_.in_pad);
  MOESRV_CHECK(bias.empty() || int64_t(bias.size()) >= out_features, "EXL3 linear: bias has {} entries, expected {}",
               bias.size(), out_features);
  in_ = in_features;
  out_ = out_features;
  bias.resize(bias.empty() ? 0 : size_t(out_features));
  bias_ = std::move(bias);
}

std::string Exl3Linear::kind() const {
  return fmt::format("exl3-k{}-{}", w_.K, exl3_codebook_name(w_.codebook));
}

size_t Exl3Linear::stored_bytes() const { return w_.trellis_bytes() + size_t(w_.in_pad + w_.out_pad) * 2; }

void Exl3Linear::gemm_rotated(const float* xr, int64_t n, float* yr) const {
  const int64_t kp = w_.in_pad, np = w_.out_pad, strips = w_.tiles_n();
  const Exl3GemvPath path = exl3_gemv_path_for(exl3_gemv_default_path(), w_);
  if (n <= exl3_gemv_fast_rows(path)) {
    std::vector<float> xs(size_t(n * exl3_activation_floats(path, kp)));
    exl3_prepare_activations(path, xr, n, kp, xs.data());
    ThreadPool::global().parallel_for(strips, [&](int64_t s0, int64_t s1) {
      for (int64_t nt = s0; nt < s1; ++nt) exl3_gemv_strip(path, w_, xs.data(), n, nt, yr, np);
    });
    return;
  }
  ThreadPool::global().parallel_for(strips, [&](int64_t s0, int64_t s1) {
    std::vector<float> wbuf(size_t(kTilesPerChunk) * 256), acc(size_t(kRowGroup) * 16);
    for (int64_t nt = s0; nt < s1; ++nt) {
      for (int64_t r = 0; r < n; ++r) std::memset(yr + r * np + nt * 16, 0, 16 * sizeof(float));
      for (int64_t kt0 = 0; kt0 < w_.tiles_k(); kt0 += kTilesPerChunk) {
        int64_t nkt = std::min(kTilesPerChunk, w_.tiles_k() - kt0);
        for (int64_t j = 0; j < nkt; ++j) exl3_decode_tile_fast(w_.tile(kt0 + j, nt), w_.K, w_.codebook, wbuf.data() + j * 256);
        for (int64_t r0 = 0; r0 < n; r0 += kRowGroup) {
          int64_t rows = std::min(kRowGroup, n - r0);
          for (int64_t r = 0; r < rows; ++r) std::memcpy(acc.data() + r * 16, yr + (r0 + r) * np + nt * 16, 64);
          strip_fma(xr + r0 * kp + kt0 * 16, kp, rows, wbuf.data(), nkt * 16, acc.data());
          for (int64_t r = 0; r < rows; ++r) std::memcpy(yr + (r0 + r) * np + nt * 16, acc.data() + r * 16, 64);
        }
      }
    }
  });
}

void Exl3Linear::forward(const float* x, int64_t n, float* y) const {
  if (n <= 0) return;
  const int64_t kp = w_.in_pad, np = w_.out_pad;
  std::vector<float> xr(size_t(n * kp), 0.0f), yr(size_t(n * np));
  for (int64_t r = 0; r < n; ++r) {
    float* dst = xr.data() + r * kp;
    for (int64_t i = 0; i < in_; ++i) dst[i] = x[r * in_ + i] * w_.suh[size_t(i)];
    exl3_hadamard128(dst, kp);
  }
  gemm_rotated(xr.data(), n, yr.data());
  for (int64_t r = 0; r < n; ++r) {
    float* src = yr.data() + r * np;
    exl3_hadamard128(src, np);
    for (int64_t o = 0; o < out_; ++o)
      y[r * out_ + o] = src[o] * w_.svh[size_t(o)] + (bias_.empty() ? 0.0f : bias_[size_t(o)]);
  }
}

void Exl3Linear::dequant_rows(int64_t row_begin, int64_t row_end, float* out) const {
  MOESRV_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= out_, "EXL3 dequant_rows [{}, {}) of {} rows",
               row_begin, row_end, out_);
  exl3_dequant_out_rows(w_, row_begin, row_end, in_, out);
}

namespace {

// "exl3.shape.<prefix>" = "<out>,<in>" in the metadata of the shard holding `<prefix>.trellis`, if any.
bool find_logical_shape(const ModelPackage& pkg, const std::string& prefix, int64_t& in, int64_t& out) {
  const std::string key = "exl3.shape." + prefix;
  for (const auto& [name, shard] : pkg.shards()) {
    if (!shard->find(prefix + ".trellis")) continue;
    auto it = shard->metadata().find(key);
    if (it == shard->metadata().end()) return false;
    long long o = 0, i = 0;
    MOESRV_CHECK(std::sscanf(it->second.c_str(), "%lld,%lld", &o, &i) == 2, "{}: metadata {} = '{}' is not '<out>,<in>'",
                 shard->path(), key, it->second);
    in = i;
    out = o;
    return true;
  }
  return false;
}

std::vector<float> load_bias(const ModelPackage& pkg, const std::string& prefix) {
  const TensorView* b = pkg.find(prefix + ".bias");
  return b ? b->to_f32() : std::vector<float>{};
}

}  // namespace

std::unique_ptr<Exl3Linear> make_exl3_linear(const ModelPackage& pkg, const std::string& prefix, int64_t in_features,
                                             int64_t out_features) {
  Exl3Weights w = load_exl3_weights(pkg, prefix);
  try {
    return std::make_unique<Exl3Linear>(std::move(w), load_bias(pkg, prefix), in_features, out_features);
  } catch (const Error& e) {
    fail("{}: {}: {}", pkg.dir(), prefix, e.what());
  }
}

std::unique_ptr<Linear> make_exl3_linear(const ModelPackage& pkg, const std::string& prefix) {
  Exl3Weights w = load_exl3_weights(pkg, prefix);
  int64_t in = w.in_pad, out = w.out_pad;
  find_logical_shape(pkg, prefix, in, out);
  try {
    return std::make_unique<Exl3Linear>(std::move(w), load_bias(pkg, prefix), in, out);
  } catch (const Error& e) {
    fail("{}: {}: {}", pkg.dir(), prefix, e.what());
  }
}

}  // namespace moesrv
