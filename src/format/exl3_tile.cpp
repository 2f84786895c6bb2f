#include "format/exl3_tile.h"

#include <immintrin.h>

#include <cstring>

#include "format/exl3_tile_simd.h"
#include "util/numeric.h"

namespace moesrv {

namespace {

constexpr auto make_pos_table() {
  struct T { uint8_t v[256]; } t{};
  for (int i = 0; i < 256; ++i) t.v[i] = uint8_t(exl3_tile_pos(i));
  return t;
}
constexpr auto kPos = make_pos_table();

}  // namespace

void exl3_tile_states(const uint16_t* tile, int K, uint16_t states[256]) {
  uint32_t ext[8 * kExl3MaxK + 2];
  exl3_tile_words(tile, K, ext);
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

#if defined(MOESRV_HAS_AVX512_PATH)
MOESRV_AVX512_BEGIN
namespace {
MOESRV_AVX512_FN void decode_tile_avx512(const uint16_t* tile, int K, Exl3Codebook cb, float out[256]) {
  alignas(64) uint32_t ext[exl3_simd::kExtWords] = {};
  exl3_tile_words(tile, K, ext);
  for (int t0 = 0; t0 < 256; t0 += 16) {
    const __m512 v = exl3_simd::decode16(ext, K, cb, t0);
    const __m512i pos = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kPos.v + t0)));
    _mm512_i32scatter_ps(out, pos, v, 4);
  }
}
}  // namespace
MOESRV_AVX512_END
#endif

void exl3_decode_tile_fast(const uint16_t* tile, int K, Exl3Codebook cb, float out[256]) {
#if defined(MOESRV_HAS_AVX512_PATH)
  if (exl3_simd::cpu_has_avx512()) return decode_tile_avx512(tile, K, cb, out);
#endif
  exl3_decode_tile(tile, K, exl3_codebook_table(cb), out);
}

}  // namespace moesrv
