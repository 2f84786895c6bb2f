// AVX-512 pieces of EXL3 tile decoding shared by the tile decoder (format/exl3_tile.cpp) and the CPU GEMV
// (backend/cpu/exl3_linear.cpp): the tile's words with a wrap-around word each side, and 16 consecutive states
// decoded through the codebook with exact fp16 rounding (the values exl3_decode_tile writes). x86-64 with GCC or
// Clang: the functions carry their own target (MOESRV_AVX512_FN), so a portable build (e.g. -march=x86-64-v3 for
// the GPU machine) still uses them where cpu_has_avx512() says the CPU can.
#pragma once
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MOESRV_HAS_AVX512_PATH 1
#include <immintrin.h>

#include <cstdint>

#include "format/exl3_codebook.h"
#include "format/exl3_tile.h"
#include "util/numeric.h"

// GCC 12 flags the _mm512_undefined_epi32() inside some AVX-512 intrinsics as uninitialized once they are inlined
// (GCC bug 105593, fixed in 13); the files using these helpers wrap their AVX-512 code in these two macros.
#if defined(__GNUC__) && !defined(__clang__)
#define MOESRV_AVX512_BEGIN                                                            \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wuninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define MOESRV_AVX512_END _Pragma("GCC diagnostic pop")
#else
#define MOESRV_AVX512_BEGIN
#define MOESRV_AVX512_END
#endif
MOESRV_AVX512_BEGIN

#define MOESRV_AVX512_FN __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c,fma")))

namespace moesrv::exl3_simd {

// The CPU runs AVX-512 F/BW/DQ/VL (checked once).
inline bool cpu_has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return yes;
}

// Words of an ext buffer (exl3_tile_words): the tile's 8K words, one wrap-around word each side, and 16 zero words
// so that a 16-word load from any window start stays inside it.
constexpr int kExtWords = 8 * kExl3MaxK + 2 + 16;

// fp32 values of states t0 .. t0+15 of the tile whose words are in `ext` (kExtWords, stream order). The 16 windows
// span at most 16K + 16 bits, i.e. 6 consecutive words: one 16-word load and two in-register permutes fetch each
// window's two words (no gathers).
MOESRV_AVX512_FN inline __m512 decode16(const uint32_t* ext, int K, Exl3Codebook cb, int t0) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // window start (ext bits, MSB-first) of each element: t*K + K - 16 + 32
  const int s0 = t0 * K + K + 16;
  const __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32(K)), _mm512_set1_epi32(s0 & 31));
  const __m512i wi = _mm512_srli_epi32(s, 5), sh = _mm512_and_si512(s, _mm512_set1_epi32(31));
  const __m512i words = _mm512_loadu_si512(ext + (s0 >> 5));
  const __m512i a = _mm512_permutexvar_epi32(wi, words);
  const __m512i b = _mm512_permutexvar_epi32(_mm512_add_epi32(wi, _mm512_set1_epi32(1)), words);
  const __m512i hi32 =
      _mm512_or_si512(_mm512_sllv_epi32(a, sh), _mm512_srlv_epi32(b, _mm512_sub_epi32(_mm512_set1_epi32(32), sh)));
  const __m512i st = _mm512_srli_epi32(hi32, 16);
  __m512 v;
  if (cb == Exl3Codebook::Mul1) {
    const __m512i x = _mm512_mullo_epi32(st, _mm512_set1_epi32(int(kExl3Mul1Mult)));
    const __m512i y = _mm512_add_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x00FF00FF)),
                                       _mm512_and_si512(_mm512_srli_epi32(x, 8), _mm512_set1_epi32(0x00FF00FF)));
    const __m512i bs = _mm512_add_epi32(_mm512_and_si512(y, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(y, 16));
    // (1024 + bs) * k_inv + k_bias is exact in fp32 (< 24 significant bits): one rounding to fp16 below
    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(bs, _mm512_set1_epi32(1024))),
                        _mm512_set1_ps(f16_to_f32(0x1eee)), _mm512_set1_ps(f16_to_f32(0xc931)));
  } else {
    __m512i x = _mm512_mullo_epi32(st, _mm512_set1_epi32(int(cb == Exl3Codebook::Mcg ? kExl3McgMult : kExl3Inst3Mult)));
    if (cb == Exl3Codebook::Inst3) x = _mm512_add_epi32(x, _mm512_set1_epi32(int(kExl3Inst3Add)));
    x = _mm512_xor_si512(_mm512_and_si512(x, _mm512_set1_epi32(int(0x8FFF8FFFu))), _mm512_set1_epi32(0x3B603B60));
    const __m512 lo = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
    const __m512 hi = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
    v = _mm512_add_ps(lo, hi);  // exact in fp32 (both in [2^-3, 2)): one rounding to fp16 below
  }
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

}  // namespace moesrv::exl3_simd

MOESRV_AVX512_END
#endif  // x86-64
