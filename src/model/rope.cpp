#include "model/rope.h"

#include <algorithm>
#include <cmath>

namespace moesrv {

namespace {

double correction_dim(double rotations, int64_t dim, double base, double max_pos) {
  return (double(dim) * std::log(max_pos / (rotations * 2 * M_PI))) / (2 * std::log(base));
}

}  // namespace

Rope::Rope(const RopeConfig& cfg) : dim_(cfg.dim), attention_factor_(float(cfg.attention_factor)) {
  int64_t half = dim_ / 2;
  inv_freq_.resize(size_t(half));
  for (int64_t i = 0; i < half; ++i) {
    // Same fp32 rounding as transformers: base ** (arange(0, dim, 2).float() / dim)
    float expo = float(2 * i) / float(dim_);
    float pos_freq = std::pow(float(cfg.theta), expo);
    inv_freq_[size_t(i)] = 1.0f / pos_freq;
  }
  if (!cfg.yarn) return;
  double low = correction_dim(cfg.beta_fast, dim_, cfg.theta, double(cfg.original_max_position));
  double high = correction_dim(cfg.beta_slow, dim_, cfg.theta, double(cfg.original_max_position));
  if (cfg.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, double(dim_ - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    float ramp = std::clamp(float((double(i) - low) / (high - low)), 0.0f, 1.0f);
    float extrap_factor = 1.0f - ramp;
    float pos_freq = 1.0f / inv_freq_[size_t(i)];
    float extrap = 1.0f / pos_freq, interp = 1.0f / (float(cfg.factor) * pos_freq);
    inv_freq_[size_t(i)] = interp * (1 - extrap_factor) + extrap * extrap_factor;
  }
}

void Rope::apply(float* x, int64_t pos, RopeLayout layout) const {
  int64_t half = dim_ / 2;
  for (int64_t i = 0; i < half; ++i) {
    float angle = float(pos) * inv_freq_[size_t(i)];  // fp32 product like the reference
    float c = std::cos(angle) * attention_factor_, s = std::sin(angle) * attention_factor_;
    float* a = layout == RopeLayout::Interleaved ? x + 2 * i : x + i;
    float* b = layout == RopeLayout::Interleaved ? x + 2 * i + 1 : x + i + half;
    float x0 = *a, x1 = *b;
    *a = x0 * c - x1 * s;
    *b = x1 * c + x0 * s;
  }
}

}  // namespace moesrv
