// Linear layers on the CPU: y[n, out] = x[n, in] · W^T (+ bias), fp32 activations, weights in their stored format.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "format/package.h"

namespace moesrv {

class Linear {
 public:
  virtual ~Linear() = default;
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  virtual void forward(const float* x, int64_t n, float* y) const = 0;
  // Dequantized weight rows [row_begin, row_end) of W (out x in), fp32: for reference paths and GPU upload.
  virtual void dequant_rows(int64_t row_begin, int64_t row_end, float* out) const = 0;
  virtual std::string kind() const = 0;        // "bf16", "fp8", "exl3-k3-mul1", ...
  virtual size_t stored_bytes() const = 0;     // bytes of weights as stored
  const std::vector<float>& bias() const { return bias_; }

 protected:
  int64_t in_ = 0, out_ = 0;
  std::vector<float> bias_;
};

// Dense weight from safetensors: BF16/F16/F32, or F8_E4M3 with 128x128 block `weight_scale_inv`.
class DenseLinear : public Linear {
 public:
  DenseLinear(const TensorView& w, const TensorView* scale_inv, const TensorView* bias);
  void forward(const float* x, int64_t n, float* y) const override;
  void dequant_rows(int64_t row_begin, int64_t row_end, float* out) const override;
  std::string kind() const override;
  size_t stored_bytes() const override { return w_.nbytes; }
  const TensorView& weight() const { return w_; }

 private:
  TensorView w_;
  std::vector<float> scale_inv_;  // [ceil(out/128), ceil(in/128)] for fp8
  int64_t scale_cols_ = 0;
};

// Loads `<prefix>.weight` (dense) or `<prefix>.trellis` (EXL3) with optional `<prefix>.bias`.
std::unique_ptr<Linear> load_linear(const ModelPackage& pkg, const std::string& prefix);

// Raw kernel: y[n, out] = x[n, in] · W^T for a bf16 weight matrix, parallel over output rows.
void gemm_bf16(const float* x, int64_t n, const uint16_t* w, int64_t out, int64_t in, float* y);
void gemm_f32(const float* x, int64_t n, const float* w, int64_t out, int64_t in, float* y);

}  // namespace moesrv
