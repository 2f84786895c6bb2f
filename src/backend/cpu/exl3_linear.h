// EXL3 (ExLlamaV3 trellis) linear layers on the CPU: see src/format/exl3*.h for the format.
#pragma once
#include <memory>
#include <string>

#include "backend/cpu/linear.h"
#include "format/exl3_weights.h"

namespace moesrv {

// y = ((x ⊙ suh) · H) · W_hat · H ⊙ svh + bias. forward() rotates the input once, then multiplies against
// tiles decoded on the fly (a few at a time, per 16-column strip), parallel over strips.
// Logical shapes may be smaller than the stored (128-padded) ones: inputs are zero-padded, outputs cut.
class Exl3Linear : public Linear {
 public:
  Exl3Linear(Exl3Weights w, std::vector<float> bias, int64_t in_features, int64_t out_features);
  void forward(const float* x, int64_t n, float* y) const override;
  void dequant_rows(int64_t row_begin, int64_t row_end, float* out) const override;
  std::string kind() const override;  // "exl3-k4-mul1"
  size_t stored_bytes() const override;
  const Exl3Weights& weights() const { return w_; }

  // Rotated-basis product only: yr[n, out_pad] = xr[n, in_pad] · W_hat (exposed for tests and benches).
  void gemm_rotated(const float* xr, int64_t n, float* yr) const;

 private:
  Exl3Weights w_;
};

// Builds an EXL3 linear from `<prefix>.trellis`, `.suh`, `.svh` (or legacy `.su`/`.sv`), optional `.mcg`/`.mul1`
// and `.bias`. Logical shape: the stored one, unless the shard's metadata holds "exl3.shape.<prefix>" =
// "<out>,<in>" (written by exl3_convert for padded tensors). Throws when pieces are missing or shapes disagree.
std::unique_ptr<Linear> make_exl3_linear(const ModelPackage& pkg, const std::string& prefix);
// Same, with the logical shape given by the caller (out <= out_pad, in <= in_pad).
std::unique_ptr<Exl3Linear> make_exl3_linear(const ModelPackage& pkg, const std::string& prefix, int64_t in_features,
                                             int64_t out_features);

}  // namespace moesrv
