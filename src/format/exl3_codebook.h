// EXL3 procedural codebooks: a 16-bit trellis state -> one fp16 weight (in the rotated basis).
// Bit-exact emulation of the GPU arithmetic: 3INST/MCG end in one fp16 add, MUL1 in one fp16 fma
// (each rounded once, to nearest even).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace moesrv {

enum class Exl3Codebook { Inst3, Mcg, Mul1 };

constexpr uint32_t kExl3Inst3Mult = 89226354u, kExl3Inst3Add = 64248484u;
constexpr uint32_t kExl3McgMult = 0xCBAC1FEDu;   // value of the `<prefix>.mcg` marker tensor
constexpr uint32_t kExl3Mul1Mult = 0x83DCD12Du;  // value of the `<prefix>.mul1` marker tensor

std::string_view exl3_codebook_name(Exl3Codebook cb);             // "3inst", "mcg", "mul1"
bool parse_exl3_codebook(std::string_view s, Exl3Codebook& out);  // false for unknown names

// Exact fp16 arithmetic on bit patterns, round to nearest even (finite inputs).
uint16_t f64_to_f16_rne(double v);
uint16_t f16_add_rne(uint16_t a, uint16_t b);
uint16_t f16_fma_rne(uint16_t a, uint16_t b, uint16_t c);  // a*b+c, one rounding (exact for codebook operands)

// Decoded value of one state (only the low 16 bits of `state` are used), as fp16 bits.
uint16_t exl3_decode_state_f16(uint32_t state, Exl3Codebook cb);

// 65536-entry fp32 table of exl3_decode_state_f16 for a codebook; built once, thread-safe, never freed.
const float* exl3_codebook_table(Exl3Codebook cb);

}  // namespace moesrv
