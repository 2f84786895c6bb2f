#include "format/exl3_hadamard.h"

#include <cmath>

namespace moesrv {

void exl3_hadamard128(float* x, int64_t n) {
  const float scale = 1.0f / std::sqrt(128.0f);
  for (int64_t b = 0; b < n; b += 128) {
    float* v = x + b;
    for (int h = 1; h < 128; h <<= 1)
      for (int i = 0; i < 128; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          float a = v[j], c = v[j + h];
          v[j] = a + c;
          v[j + h] = a - c;
        }
    for (int j = 0; j < 128; ++j) v[j] *= scale;
  }
}

}  // namespace moesrv
