// Rotary position embedding tables (default and YaRN), applied in place on the CPU.
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"

namespace moesrv {

class Rope {
 public:
  explicit Rope(const RopeConfig& cfg);
  int64_t dim() const { return dim_; }
  const std::vector<float>& inv_freq() const { return inv_freq_; }
  // Rotates the first dim() values of `x` (one head) for position `pos`.
  void apply(float* x, int64_t pos, RopeLayout layout) const;

 private:
  int64_t dim_;
  float attention_factor_;
  std::vector<float> inv_freq_;
};

}  // namespace moesrv
