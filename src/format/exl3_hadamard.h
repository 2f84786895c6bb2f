// The 128-point Sylvester Hadamard transform EXL3 applies on both sides of every weight:
// H[i][j] = (-1)^popcount(i & j) / sqrt(128). H is symmetric and its own inverse.
#pragma once
#include <cstdint>

namespace moesrv {

// In place on each consecutive 128-element block of x (n a multiple of 128).
void exl3_hadamard128(float* x, int64_t n = 128);

}  // namespace moesrv
