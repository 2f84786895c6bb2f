// EXL3 GEMV for a few activation rows (decode): each 16x16 trellis tile of a 16-column strip is decoded straight
// into registers and multiplied there. Several instruction-set paths, picked at run time; all but Avx512Int8 decode
// the same fp16 values as exl3_decode_tile (only the fp32 summation order differs between paths).
#pragma once
#include <cstdint>

#include "format/exl3_weights.h"

namespace moesrv {

enum class Exl3GemvPath {
  Scalar,      // table decode, scalar sums: any CPU
  Avx2,        // 8 states per step: byte shuffle + variable shift window extraction (AVX2 + FMA + F16C)
  Avx2Vnni,    // the same with AVX-VNNI byte sums
  Avx512,      // 16 states per step, word permutes and variable shifts (AVX-512 F/BW/DQ/VL)
  Avx512Vbmi,  // 16 states per step, byte permute + multishift window extraction, VNNI byte sums
  // Avx512Vbmi's state extraction with integer sums, MUL1 only (opt-in: MOESRV_EXL3_GEMV=avx512-int8). MUL1's value
  // before its fp16 rounding is A * bs + C (bs: byte sum of s * M), so VNNI multiplies the product's bytes by the
  // activations, which are int8 hi + lo/254 of a scale per 128 inputs. Not exact: the weights lack their fp16 rounding
  // (<= 2^-11 relative each) and each input is off by <= 1/64516 of its block's largest. Other codebooks, and inputs
  // not a multiple of 128, run Avx512Vbmi (exl3_gemv_path_for).
  Avx512Int8,
  // Avx512Vbmi's state extraction (exact; the default where the CPU has AVX512-FP16): 32 weights' values from one
  // fp16 operation whose rounding is the codebook's (MUL1: an fma of the byte sums with its constants; 3INST / MCG:
  // the add of the masked products' halves).
  Avx512Fp16,
};

// Every path, in the enum's order.
constexpr Exl3GemvPath kExl3GemvPaths[] = {Exl3GemvPath::Scalar,    Exl3GemvPath::Avx2,       Exl3GemvPath::Avx2Vnni,
                                           Exl3GemvPath::Avx512,    Exl3GemvPath::Avx512Vbmi, Exl3GemvPath::Avx512Int8,
                                           Exl3GemvPath::Avx512Fp16};

constexpr int64_t kExl3GemvMaxRows = 8;
// Rows up to which the path beats the decoded-tile GEMM (AVX2 decodes the tiles again for each row).
int64_t exl3_gemv_fast_rows(Exl3GemvPath p);

const char* exl3_gemv_path_name(Exl3GemvPath p);
bool exl3_gemv_path_supported(Exl3GemvPath p);
Exl3GemvPath exl3_gemv_best_path();  // the fastest path this CPU runs (checked once)
// The path Exl3Linear and the expert batch use: exl3_gemv_best_path(), unless the environment variable
// MOESRV_EXL3_GEMV names a supported one (scalar, avx2, avx2-vnni, avx512, avx512-vbmi, avx512-int8, avx512-fp16) or a
// bench set one. Scalar means the decoded-tile GEMM, the same as for more than kExl3GemvMaxRows rows.
Exl3GemvPath exl3_gemv_default_path();
void exl3_gemv_set_default_path(Exl3GemvPath p);  // p must be supported

// The path that runs w when `p` is asked for: Avx512Int8 becomes Avx512Vbmi where it does not apply, others stay.
Exl3GemvPath exl3_gemv_path_for(Exl3GemvPath p, const Exl3Weights& w);

// The activations a path's strips read, one row at a time: floats per row of kp inputs (kp a multiple of 16, of 128
// for Avx512Int8), and block b (inputs [128 b, 128 b + 128), v = their 128 values) of a row written into `row`.
constexpr int64_t kExl3ActivationBlock = 128;
int64_t exl3_activation_floats(Exl3GemvPath p, int64_t kp);
void exl3_prepare_activation_block(Exl3GemvPath p, const float* v, int64_t b, float* row);
// All blocks of rows [0, n) of xr (row stride kp) into xs (row stride exl3_activation_floats).
void exl3_prepare_activations(Exl3GemvPath p, const float* xr, int64_t n, int64_t kp, float* xs);

// Activations of rows [0, n) of xr (row stride kp, kp a multiple of 16) in tile state order, the layout the strip
// kernels read: xs[(r * kp / 16 + kt) * 32 + t] = xr[r * kp + 16 * kt + row of state t]. k-tiles [kt0, kt1) only.
void exl3_activations_in_state_order(const float* xr, int64_t n, int64_t kp, int64_t kt0, int64_t kt1, float* xs);

// yr[r * ldy + 16 * nt + c] = sum_k xr[r][k] * W_hat[k][16 * nt + c] for c < 16, r < n <= kExl3GemvMaxRows, with
// xs from exl3_prepare_activations(path, ...) (for the float paths the same as exl3_activations_in_state_order over
// all k-tiles). `path` must be supported and be exl3_gemv_path_for(path, w).
void exl3_gemv_strip(Exl3GemvPath path, const Exl3Weights& w, const float* xs, int64_t n, int64_t nt, float* yr,
                     int64_t ldy);

}  // namespace moesrv
