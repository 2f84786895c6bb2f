// Linear layers on the CPU: y[n, out] = x[n, in] · W^T (+ bias), fp32 activations, weights in their stored format.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "format/package.h"
#include "model/linear.h"

namespace moesrv {

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

// Loads `<prefix>.weight` (dense), `<prefix>.trellis` (EXL3) or a bare 2-D tensor named `<prefix>`, with optional
// `<prefix>.bias` (a LinearLoader).
std::unique_ptr<Linear> load_linear(const ModelPackage& pkg, const std::string& prefix);

// Raw kernel: y[n, out] = x[n, in] · W^T for a bf16 weight matrix, parallel over output rows.
void gemm_bf16(const float* x, int64_t n, const uint16_t* w, int64_t out, int64_t in, float* y);
void gemm_f32(const float* x, int64_t n, const float* w, int64_t out, int64_t in, float* y);

}  // namespace moesrv
