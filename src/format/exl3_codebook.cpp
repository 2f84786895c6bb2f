#include "format/exl3_codebook.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "util/numeric.h"

namespace moesrv {

std::string_view exl3_codebook_name(Exl3Codebook cb) {
  switch (cb) {
    case Exl3Codebook::Inst3: return "3inst";
    case Exl3Codebook::Mcg: return "mcg";
    case Exl3Codebook::Mul1: return "mul1";
  }
  return "?";
}

bool parse_exl3_codebook(std::string_view s, Exl3Codebook& out) {
  if (s == "3inst" || s == "3INST") out = Exl3Codebook::Inst3;
  else if (s == "mcg" || s == "MCG") out = Exl3Codebook::Mcg;
  else if (s == "mul1" || s == "MUL1") out = Exl3Codebook::Mul1;
  else return false;
  return true;
}

uint16_t f64_to_f16_rne(double v) {
  uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  double a = std::fabs(v);
  if (std::isnan(v)) return sign | 0x7e00;
  if (a >= 65520.0) return sign | 0x7c00;  // 65520 is the midpoint above 65504: ties to even -> inf
  if (a < 0x1p-14) {                      // subnormal range: quantum 2^-24 (a value of 1024 encodes the min normal)
    return uint16_t(sign | uint16_t(std::nearbyint(a * 0x1p24)));
  }
  int e;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  int exp = e - 1;
  double m = std::nearbyint(std::ldexp(a, 10 - exp));  // [1024, 2048], ties to even (default rounding mode)
  if (m == 2048.0) { m = 1024.0; ++exp; }
  if (exp > 15) return sign | 0x7c00;
  return uint16_t(sign | uint16_t((exp + 15) << 10) | uint16_t(int(m) - 1024));
}

// Sums and products of two or three fp16 values are exact in double for the operands used here.
uint16_t f16_add_rne(uint16_t a, uint16_t b) {
  return f64_to_f16_rne(double(f16_to_f32(a)) + double(f16_to_f32(b)));
}

uint16_t f16_fma_rne(uint16_t a, uint16_t b, uint16_t c) {
  return f64_to_f16_rne(double(f16_to_f32(a)) * double(f16_to_f32(b)) + double(f16_to_f32(c)));
}

namespace {

inline uint16_t sum_of_masked_halves(uint32_t x) {
  x = (x & 0x8FFF8FFFu) ^ 0x3B603B60u;  // keep sign + 12 low bits, force exponent into [2^-3, 2)
  return f16_add_rne(uint16_t(x & 0xFFFF), uint16_t(x >> 16));
}

std::vector<float> build_table(Exl3Codebook cb) {
  std::vector<float> t(65536);
  for (uint32_t s = 0; s < 65536; ++s) t[s] = f16_to_f32(exl3_decode_state_f16(s, cb));
  return t;
}

}  // namespace

uint16_t exl3_decode_state_f16(uint32_t state, Exl3Codebook cb) {
  uint32_t s = state & 0xFFFF;
  switch (cb) {
    case Exl3Codebook::Inst3: return sum_of_masked_halves(s * kExl3Inst3Mult + kExl3Inst3Add);
    case Exl3Codebook::Mcg: return sum_of_masked_halves(s * kExl3McgMult);
    case Exl3Codebook::Mul1: {
      uint32_t x = s * kExl3Mul1Mult;
      uint32_t byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24);  // 0..1020
      // (1024 + byte_sum) * 0x1eee (~1/147.7) + 0xc931 (~-10.38), one fp16 fma
      return f16_fma_rne(uint16_t(0x6400 + byte_sum), 0x1eee, 0xc931);
    }
  }
  return 0;
}

const float* exl3_codebook_table(Exl3Codebook cb) {
  static const std::vector<float> inst3 = build_table(Exl3Codebook::Inst3);
  static const std::vector<float> mcg = build_table(Exl3Codebook::Mcg);
  static const std::vector<float> mul1 = build_table(Exl3Codebook::Mul1);
  switch (cb) {
    case Exl3Codebook::Inst3: return inst3.data();
    case Exl3Codebook::Mcg: return mcg.data();
    case Exl3Codebook::Mul1: return mul1.data();
  }
  return inst3.data();
}

}  // namespace moesrv
