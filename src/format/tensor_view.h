// A read-only view of one stored tensor (usually inside an mmap'd safetensors file).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "format/dtype.h"

namespace moesrv {

struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
  int64_t dim(int i) const { return shape.at(size_t(i < 0 ? int(shape.size()) + i : i)); }
  std::string shape_str() const;
  // Element i converted to fp32 (float and integer types).
  float at(int64_t i) const;
  // Whole tensor converted to fp32.
  std::vector<float> to_f32() const;
  // Row-major slice [row_begin, row_end) of a 2-D+ tensor's first dimension, converted to fp32 into out.
  void rows_to_f32(int64_t row_begin, int64_t row_end, float* out) const;
};

}  // namespace moesrv
