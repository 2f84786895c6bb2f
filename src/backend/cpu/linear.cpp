#include "backend/cpu/linear.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "backend/cpu/exl3_linear.h"
#include "util/error.h"
#include "util/numeric.h"
#include "util/thread_pool.h"

namespace moesrv {

namespace {

constexpr int64_t kRowBlock = 4;  // output rows handled together so each x row is loaded once per block

// Dot products of x rows [0, n) against `rows` fp32 weight rows.
inline float dot_f32(const float* a, const float* b, int64_t k) {
  int64_t i = 0;
  float s = 0;
#if defined(__AVX512F__)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i + 16 <= k; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
  s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif defined(__AVX2__)
  __m256 acc0 = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float tmp[8];
  _mm256_storeu_ps(tmp, acc0);
  for (float t : tmp) s += t;
#endif
  for (; i < k; ++i) s += a[i] * b[i];
  return s;
}

inline void bf16_row_to_f32(const uint16_t* src, int64_t k, float* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= k; i += 16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
#endif
  for (; i < k; ++i) dst[i] = bf16_to_f32(src[i]);
}

// Generic driver: converts weight rows into a per-thread fp32 buffer, then dots with every x row.
template <typename RowFn>
void gemm_rows(const float* x, int64_t n, int64_t out, int64_t in, float* y, RowFn&& row_to_f32) {
  ThreadPool::global().parallel_for(
      (out + kRowBlock - 1) / kRowBlock,
      [&](int64_t b, int64_t e) {
        std::vector<float> buf(size_t(kRowBlock * in));
        for (int64_t blk = b; blk < e; ++blk) {
          int64_t r0 = blk * kRowBlock, r1 = std::min(out, r0 + kRowBlock);
          row_to_f32(r0, r1, buf.data());
          for (int64_t t = 0; t < n; ++t)
            for (int64_t r = r0; r < r1; ++r) y[t * out + r] = dot_f32(x + t * in, buf.data() + (r - r0) * in, in);
        }
      },
      std::max<int64_t>(1, 4096 / std::max<int64_t>(1, in * n / 64)));
}

}  // namespace

void gemm_bf16(const float* x, int64_t n, const uint16_t* w, int64_t out, int64_t in, float* y) {
  gemm_rows(x, n, out, in, y, [&](int64_t r0, int64_t r1, float* buf) {
    for (int64_t r = r0; r < r1; ++r) bf16_row_to_f32(w + r * in, in, buf + (r - r0) * in);
  });
}

void gemm_f32(const float* x, int64_t n, const float* w, int64_t out, int64_t in, float* y) {
  ThreadPool::global().parallel_for(out, [&](int64_t b, int64_t e) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t r = b; r < e; ++r) y[t * out + r] = dot_f32(x + t * in, w + r * in, in);
  }, 16);
}

DenseLinear::DenseLinear(const TensorView& w, const TensorView* scale_inv, const TensorView* bias) : w_(w) {
  if (w.shape.size() != 2) fail("tensor {}: expected a 2-D weight, got {}", w.name, w.shape_str());
  out_ = w.shape[0];
  in_ = w.shape[1];
  switch (w.dtype) {
    case DType::BF16: case DType::F16: case DType::F32: break;
    case DType::F8_E4M3:
      if (!scale_inv) fail("tensor {}: FP8 weight without {}_scale_inv", w.name, w.name);
      scale_cols_ = (in_ + 127) / 128;
      if (scale_inv->numel() != ((out_ + 127) / 128) * scale_cols_)
        fail("tensor {}: scale_inv shape {} does not match 128x128 blocks of {}", scale_inv->name, scale_inv->shape_str(), w.shape_str());
      scale_inv_ = scale_inv->to_f32();
      break;
    default: fail("tensor {}: unsupported weight dtype {}", w.name, dtype_name(w.dtype));
  }
  if (bias) {
    if (bias->numel() != out_) fail("tensor {}: bias has {} elements, weight has {} rows", bias->name, bias->numel(), out_);
    bias_ = bias->to_f32();
  }
}

std::string DenseLinear::kind() const {
  switch (w_.dtype) {
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::F32: return "f32";
    default: return "fp8";
  }
}

void DenseLinear::dequant_rows(int64_t r0, int64_t r1, float* out) const {
  if (w_.dtype == DType::BF16) {
    for (int64_t r = r0; r < r1; ++r) bf16_row_to_f32(reinterpret_cast<const uint16_t*>(w_.data) + r * in_, in_, out + (r - r0) * in_);
    return;
  }
  w_.rows_to_f32(r0, r1, out);
  if (w_.dtype == DType::F8_E4M3)
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < in_; ++c) out[(r - r0) * in_ + c] *= scale_inv_[size_t((r / 128) * scale_cols_ + c / 128)];
}

void DenseLinear::forward(const float* x, int64_t n, float* y) const {
  if (w_.dtype == DType::BF16)
    gemm_bf16(x, n, reinterpret_cast<const uint16_t*>(w_.data), out_, in_, y);
  else if (w_.dtype == DType::F32)
    gemm_f32(x, n, reinterpret_cast<const float*>(w_.data), out_, in_, y);
  else
    gemm_rows(x, n, out_, in_, y, [&](int64_t r0, int64_t r1, float* buf) { dequant_rows(r0, r1, buf); });
  if (!bias_.empty())
    for (int64_t t = 0; t < n; ++t)
      for (int64_t r = 0; r < out_; ++r) y[t * out_ + r] += bias_[size_t(r)];
}

std::unique_ptr<Linear> load_linear(const ModelPackage& pkg, const std::string& prefix) {
  if (pkg.has(prefix + ".trellis")) return make_exl3_linear(pkg, prefix);
  if (!pkg.has(prefix + ".weight") && pkg.has(prefix))  // a bare matrix (e.g. index_kpool_compress_gate)
    return std::make_unique<DenseLinear>(pkg.require(prefix), nullptr, nullptr);
  const TensorView& w = pkg.require(prefix + ".weight");
  return std::make_unique<DenseLinear>(w, pkg.find(prefix + ".weight_scale_inv"), pkg.find(prefix + ".bias"));
}

}  // namespace moesrv
