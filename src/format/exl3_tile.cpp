#include "format/exl3_tile.h"

#include <immintrin.h>

#include <cstring>

#include "util/numeric.h"

namespace moesrv {

namespace {

constexpr auto make_pos_table() {
  struct T { uint8_t v[256]; } t{};
  for (int i = 0; i < 256; ++i) t.v[i] = uint8_t(exl3_tile_pos(i));
  return t;
}
constexpr auto kPos = make_pos_table();

inline uint32_t word(const uint16_t* tile, int i) { return uint32_t(tile[2 * i]) | uint32_t(tile[2 * i + 1]) << 16; }

}  // namespace

void exl3_tile_states(const uint16_t* tile, int K, uint16_t states[256]) {
  const int nw = 8 * K;
  // ext = [last word, words..., first word] so that a 16-bit window may start up to 32 bits before bit 0
  // and end past the last bit without wrapping arithmetic.
  uint32_t ext[8 * kExl3MaxK + 2];
  ext[0] = word(tile, nw - 1);
  for (int i = 0; i < nw; ++i) ext[i + 1] = word(tile, i);
  ext[nw + 1] = word(tile, 0);
  for (int t = 0; t < 256; ++t) {
    int s = t * K + K - 16 + 32;  // window start in ext bits (MSB-first)
    int i = s >> 5, sh = s & 31;
    uint64_t v = uint64_t(ext[i]) << 32 | ext[i + 1];
    states[t] = uint16_t(v >> (48 - sh));
  }
}

bool exl3_pack_tile(const uint16_t states[256], int K, uint16_t* tile) {
  const uint32_t mask = (1u << (16 - K)) - 1;
  for (int t = 0; t < 256; ++t)
    if (uint32_t(states[t] >> K) != (states[(t + 255) & 255] & mask)) return false;
  uint32_t words[8 * kExl3MaxK] = {};
  for (int t = 0; t < 256; ++t) {
    uint32_t v = states[t] & ((1u << K) - 1);
    for (int b = 0; b < K; ++b) {  // bit b of v (MSB first) goes to stream bit t*K + b
      int pos = t * K + b;
      if (v >> (K - 1 - b) & 1) words[pos >> 5] |= 1u << (31 - (pos & 31));
    }
  }
  for (int i = 0; i < 8 * K; ++i) {
    tile[2 * i] = uint16_t(words[i]);
    tile[2 * i + 1] = uint16_t(words[i] >> 16);
  }
  return true;
}

void exl3_decode_tile(const uint16_t* tile, int K, const float* table, float out[256]) {
  uint16_t st[256];
  exl3_tile_states(tile, K, st);
  for (int t = 0; t < 256; ++t) out[kPos.v[t]] = table[st[t]];
}

void exl3_decode_tile_fast(const uint16_t* tile, int K, Exl3Codebook cb, float out[256]) {
#if defined(__AVX512F__)
  const int nw = 8 * K;
  alignas(64) uint32_t ext[8 * kExl3MaxK + 2];
  ext[0] = word(tile, nw - 1);
  for (int i = 0; i < nw; ++i) ext[i + 1] = word(tile, i);
  ext[nw + 1] = word(tile, 0);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i mask16 = _mm512_set1_epi32(0xFFFF), c32 = _mm512_set1_epi32(32);
  const __m512 k_inv = _mm512_set1_ps(f16_to_f32(0x1eee)), k_bias = _mm512_set1_ps(f16_to_f32(0xc931));
  for (int t0 = 0; t0 < 256; t0 += 16) {
    // window start (ext bits, MSB-first) of each element: t*K + K - 16 + 32
    __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(t0)), _mm512_set1_epi32(K)),
                                 _mm512_set1_epi32(K + 16));
    __m512i wi = _mm512_srli_epi32(s, 5), sh = _mm512_and_si512(s, _mm512_set1_epi32(31));
    __m512i a = _mm512_i32gather_epi32(wi, reinterpret_cast<const int*>(ext), 4);
    __m512i b = _mm512_i32gather_epi32(_mm512_add_epi32(wi, _mm512_set1_epi32(1)), reinterpret_cast<const int*>(ext), 4);
    __m512i hi32 = _mm512_or_si512(_mm512_sllv_epi32(a, sh), _mm512_srlv_epi32(b, _mm512_sub_epi32(c32, sh)));
    __m512i st = _mm512_srli_epi32(hi32, 16);
    __m512 v;
    if (cb == Exl3Codebook::Mul1) {
      __m512i x = _mm512_mullo_epi32(st, _mm512_set1_epi32(int(kExl3Mul1Mult)));
      __m512i y = _mm512_add_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x00FF00FF)),
                                   _mm512_and_si512(_mm512_srli_epi32(x, 8), _mm512_set1_epi32(0x00FF00FF)));
      __m512i bs = _mm512_add_epi32(_mm512_and_si512(y, mask16), _mm512_srli_epi32(y, 16));
      // (1024 + bs) * k_inv + k_bias is exact in fp32 (< 24 significant bits): one rounding to fp16 below
      v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(bs, _mm512_set1_epi32(1024))), k_inv, k_bias);
    } else {
      __m512i x = _mm512_mullo_epi32(st, _mm512_set1_epi32(int(cb == Exl3Codebook::Mcg ? kExl3McgMult : kExl3Inst3Mult)));
      if (cb == Exl3Codebook::Inst3) x = _mm512_add_epi32(x, _mm512_set1_epi32(int(kExl3Inst3Add)));
      x = _mm512_xor_si512(_mm512_and_si512(x, _mm512_set1_epi32(int(0x8FFF8FFFu))), _mm512_set1_epi32(0x3B603B60));
      __m512 lo = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
      __m512 hi = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
      v = _mm512_add_ps(lo, hi);  // exact in fp32 (both in [2^-3, 2)): one rounding to fp16 below
    }
    v = _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m512i pos = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kPos.v + t0)));
    _mm512_i32scatter_ps(out, pos, v, 4);
  }
#else
  exl3_decode_tile(tile, K, exl3_codebook_table(cb), out);
#endif
}

}  // namespace moesrv
