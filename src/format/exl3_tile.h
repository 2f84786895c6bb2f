// EXL3 16x16 tiles: the tail-biting bitstream and the tensor-core element order.
//
// A tile at K bits/weight is 16*K int16 values, read as 8*K little-endian uint32 words, each MSB-first,
// forming a cyclic stream of 256*K bits. Element t (0..255) has the 16-bit state ending at bit (t+1)*K
// (mod 256*K), so consecutive states overlap in 16-K bits: state_t = (state_{t-1} << K | v_t) & 0xFFFF,
// v_t = bits [t*K, (t+1)*K). Element t sits at (row, col) = exl3_tile_pos(t) / 16, % 16 of the tile,
// row = input (k) offset, col = output (n) offset.
#pragma once
#include <cstdint>

#include "format/exl3_codebook.h"

namespace moesrv {

constexpr int kExl3MaxK = 8;

// Row-major position (row * 16 + col) of stream element t: t = 8*lane + i, rows {r0, r0+1, r0+8, r0+9}
// with r0 = 2*(lane%4), column lane/4 for i < 4 and lane/4 + 8 for i >= 4.
constexpr int exl3_tile_pos(int t) {
  int lane = t >> 3, i = t & 7;
  int r0 = (lane & 3) * 2;
  constexpr int kRowOff[4] = {0, 1, 8, 9};
  return (r0 + kRowOff[i & 3]) * 16 + (lane >> 2) + (i >= 4 ? 8 : 0);
}

// ext = [last word, words..., first word] of a tile (16*K uint16 = 8K 32-bit words, MSB-first bit order): a 16-bit
// window may start up to 32 bits before bit 0 and end past the last bit without wrapping arithmetic. ext holds at
// least 8K + 2 words.
inline void exl3_tile_words(const uint16_t* tile, int K, uint32_t* ext) {
  const int nw = 8 * K;
  auto word = [&](int i) { return uint32_t(tile[2 * i]) | uint32_t(tile[2 * i + 1]) << 16; };
  ext[0] = word(nw - 1);
  for (int i = 0; i < nw; ++i) ext[i + 1] = word(i);
  ext[nw + 1] = word(0);
}

// The 256 states of one tile (16*K uint16 words), in stream order.
void exl3_tile_states(const uint16_t* tile, int K, uint16_t states[256]);

// Inverse: packs a cyclically consistent state sequence into 16*K words. Only the low K bits of each state
// are stored; returns false when the sequence is not consistent (state_t >> K != state_{t-1} & mask).
bool exl3_pack_tile(const uint16_t states[256], int K, uint16_t* tile);

// Decodes one tile into row-major [16][16] fp32 (rows = k offset) through a codebook table.
void exl3_decode_tile(const uint16_t* tile, int K, const float* table, float out[256]);

// Same result, computing the codebook directly (AVX-512 when compiled for it: 16 states per step, exact fp16
// rounding through vcvtps2ph); falls back to exl3_decode_tile with the codebook's table.
void exl3_decode_tile_fast(const uint16_t* tile, int K, Exl3Codebook cb, float out[256]);

}  // namespace moesrv
