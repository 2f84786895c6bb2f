#include "format/exl3_weights.h"

#include <algorithm>
#include <cstring>

#include "format/exl3_hadamard.h"
#include "format/exl3_tile.h"
#include "util/error.h"
#include "util/numeric.h"

namespace moesrv {

std::vector<float> exl3_unpack_signs(const uint16_t* words, int64_t n_elems) {
  std::vector<float> s(static_cast<size_t>(n_elems));
  for (int64_t i = 0; i < n_elems; ++i) s[size_t(i)] = (words[i / 16] >> (i % 16) & 1) ? -1.0f : 1.0f;
  return s;
}

namespace {

std::vector<float> load_scales(const ModelPackage& pkg, const std::string& prefix, const char* h_name,
                               const char* packed_name, int64_t n) {
  if (const TensorView* t = pkg.find(prefix + h_name)) {
    MOESRV_CHECK(t->shape.size() == 1 && t->dim(0) == n, "{}: {}{} has shape {}, expected [{}]", pkg.dir(),
                 prefix, h_name, t->shape_str(), n);
    return t->to_f32();
  }
  if (const TensorView* t = pkg.find(prefix + packed_name)) {
    MOESRV_CHECK((t->dtype == DType::I16 || t->dtype == DType::U16) && t->numel() * 16 == n,
                 "{}: {}{} is {} {}, expected int16 [{}]", pkg.dir(), prefix, packed_name, dtype_name(t->dtype),
                 t->shape_str(), n / 16);
    return exl3_unpack_signs(reinterpret_cast<const uint16_t*>(t->data), n);
  }
  fail("{}: EXL3 tensor {}.trellis has neither {}{} nor {}{}", pkg.dir(), prefix, prefix, h_name, prefix, packed_name);
}

}  // namespace

Exl3Weights load_exl3_weights(const ModelPackage& pkg, const std::string& prefix) {
  const TensorView& tr = pkg.require(prefix + ".trellis");
  MOESRV_CHECK(tr.shape.size() == 3 && (tr.dtype == DType::I16 || tr.dtype == DType::U16),
               "{}: {}.trellis is {} {}, expected int16 [in/16, out/16, 16*K]", pkg.dir(), prefix,
               dtype_name(tr.dtype), tr.shape_str());
  int64_t words = tr.dim(2);
  MOESRV_CHECK(words % 16 == 0, "{}: {}.trellis has {} words per tile: half-integer bitrates are not supported",
               pkg.dir(), prefix, words);
  Exl3Weights w;
  w.K = int(words / 16);
  MOESRV_CHECK(w.K >= 1 && w.K <= kExl3MaxK, "{}: {}.trellis implies K={} (supported: 1..8)", pkg.dir(), prefix, w.K);
  w.in_pad = tr.dim(0) * 16;
  w.out_pad = tr.dim(1) * 16;
  MOESRV_CHECK(w.in_pad % 128 == 0 && w.out_pad % 128 == 0,
               "{}: {}.trellis covers {}x{} weights; EXL3 needs multiples of 128", pkg.dir(), prefix, w.in_pad,
               w.out_pad);
  w.trellis = reinterpret_cast<const uint16_t*>(tr.data);
  bool mcg = pkg.has(prefix + ".mcg"), mul1 = pkg.has(prefix + ".mul1");
  MOESRV_CHECK(!(mcg && mul1), "{}: {} has both .mcg and .mul1 codebook markers", pkg.dir(), prefix);
  w.codebook = mcg ? Exl3Codebook::Mcg : mul1 ? Exl3Codebook::Mul1 : Exl3Codebook::Inst3;
  w.suh = load_scales(pkg, prefix, ".suh", ".su", w.in_pad);
  w.svh = load_scales(pkg, prefix, ".svh", ".sv", w.out_pad);
  return w;
}

void exl3_decode_rotated(const Exl3Weights& w, int64_t n0, int64_t n1, float* out) {
  const int64_t cols = n1 - n0;
  const float* table = w.table();
  float tile[256];
  for (int64_t kt = 0; kt < w.tiles_k(); ++kt)
    for (int64_t nt = n0 / 16; nt < n1 / 16; ++nt) {
      exl3_decode_tile(w.tile(kt, nt), w.K, table, tile);
      for (int r = 0; r < 16; ++r)
        std::memcpy(out + (kt * 16 + r) * cols + (nt * 16 - n0), tile + r * 16, 16 * sizeof(float));
    }
}

void exl3_dequant_out_rows(const Exl3Weights& w, int64_t o0, int64_t o1, int64_t in_cols, float* out) {
  MOESRV_CHECK(0 <= o0 && o0 <= o1 && o1 <= w.out_pad && in_cols <= w.in_pad, "exl3 dequant: rows [{}, {}) x {} out of range",
               o0, o1, in_cols);
  std::vector<float> blk(size_t(w.in_pad) * 128), col(size_t(w.in_pad));
  for (int64_t b0 = o0 / 128 * 128; b0 < o1; b0 += 128) {
    exl3_decode_rotated(w, b0, b0 + 128, blk.data());
    for (int64_t i = 0; i < w.in_pad; ++i) exl3_hadamard128(blk.data() + i * 128);  // right H (output side)
    for (int64_t o = std::max(o0, b0); o < std::min(o1, b0 + 128); ++o) {
      for (int64_t i = 0; i < w.in_pad; ++i) col[size_t(i)] = blk[size_t(i * 128 + (o - b0))];
      exl3_hadamard128(col.data(), w.in_pad);  // left H (input side)
      float* dst = out + (o - o0) * in_cols;
      for (int64_t i = 0; i < in_cols; ++i) dst[i] = w.suh[size_t(i)] * col[size_t(i)] * w.svh[size_t(o)];
    }
  }
}

}  // namespace moesrv
