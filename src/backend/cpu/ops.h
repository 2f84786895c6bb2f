// Elementwise and normalisation kernels on fp32 rows (CPU).
#pragma once
#include <cstdint>

namespace moesrv::cpu {

// y = x / rms(x) * w, over rows of length d. x and y may alias. w may be null (no scale).
void rms_norm(const float* x, const float* w, int64_t rows, int64_t d, double eps, float* y);
// y = (x - mean) / sqrt(var + eps) * w + b
void layer_norm(const float* x, const float* w, const float* b, int64_t rows, int64_t d, double eps, float* y);
// out[i] = silu(gate[i]) * up[i]
void silu_mul(const float* gate, const float* up, int64_t n, float* out);
// In-place softmax over n values; -inf entries get 0.
void softmax(float* x, int64_t n);
// y += a * x
void axpy(float a, const float* x, int64_t n, float* y);
float dot(const float* a, const float* b, int64_t n);

}  // namespace moesrv::cpu
