// A weight matrix as the model stores it (bf16/fp16/fp32, fp8 with block scales, EXL3 trellis): its shape, storage,
// dequantized rows, and the host reference product y = x W^T (+ bias). The model layer holds these; backends make
// them from a package (LinearLoader: backend/cpu/linear.h's load_linear) and upload or run them as they need.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace moesrv {

class ModelPackage;

class Linear {
 public:
  virtual ~Linear() = default;
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  virtual void forward(const float* x, int64_t n, float* y) const = 0;
  // Dequantized weight rows [row_begin, row_end) of W (out x in), fp32: for reference paths and GPU upload.
  virtual void dequant_rows(int64_t row_begin, int64_t row_end, float* out) const = 0;
  virtual std::string kind() const = 0;     // "bf16", "fp8", "exl3-k3-mul1", ...
  virtual size_t stored_bytes() const = 0;  // bytes of weights as stored
  const std::vector<float>& bias() const { return bias_; }

 protected:
  int64_t in_ = 0, out_ = 0;
  std::vector<float> bias_;
};

// Makes the Linear stored under `prefix` (`.weight`, or `.trellis` + scales for EXL3; optional `.bias`).
using LinearLoader = std::function<std::unique_ptr<Linear>(const ModelPackage& pkg, const std::string& prefix)>;

}  // namespace moesrv
