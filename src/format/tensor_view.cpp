#include "format/tensor_view.h"

#include <cstring>

#include "util/error.h"
#include "util/numeric.h"

namespace moesrv {

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

float TensorView::at(int64_t i) const {
  const uint8_t* p = data + size_t(i) * dtype_size(dtype);
  switch (dtype) {
    case DType::F32: { float f; std::memcpy(&f, p, 4); return f; }
    case DType::F64: { double d; std::memcpy(&d, p, 8); return float(d); }
    case DType::BF16: { uint16_t h; std::memcpy(&h, p, 2); return bf16_to_f32(h); }
    case DType::F16: { uint16_t h; std::memcpy(&h, p, 2); return f16_to_f32(h); }
    case DType::F8_E4M3: return f8e4m3_to_f32(*p);
    case DType::I64: { int64_t v; std::memcpy(&v, p, 8); return float(v); }
    case DType::I32: { int32_t v; std::memcpy(&v, p, 4); return float(v); }
    case DType::I16: { int16_t v; std::memcpy(&v, p, 2); return float(v); }
    case DType::I8: return float(int8_t(*p));
    case DType::U8: case DType::BOOL: return float(*p);
    default: fail("tensor {}: cannot convert dtype {} to fp32", name, dtype_name(dtype));
  }
}

void TensorView::rows_to_f32(int64_t row_begin, int64_t row_end, float* out) const {
  int64_t row = shape.empty() ? 1 : numel() / shape[0];
  int64_t n = (row_end - row_begin) * row, base = row_begin * row;
  if (dtype == DType::F32) {
    std::memcpy(out, data + size_t(base) * 4, size_t(n) * 4);
  } else if (dtype == DType::BF16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(data) + base;
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = at(base + i);
  }
}

std::vector<float> TensorView::to_f32() const {
  std::vector<float> out(static_cast<size_t>(numel()));
  if (!out.empty()) rows_to_f32(0, shape.empty() ? 1 : shape[0], out.data());
  return out;
}

}  // namespace moesrv
