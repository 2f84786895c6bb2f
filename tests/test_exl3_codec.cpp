// EXL3 format pieces: codebooks (bit-exact), tile bitstream + element order, Hadamard, tile quantizer.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "format/exl3_codebook.h"
#include "format/exl3_encode.h"
#include "format/exl3_hadamard.h"
#include "format/exl3_tile.h"
#include "util/numeric.h"

using namespace moesrv;

namespace {

uint64_t fnv1a_table(Exl3Codebook cb) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint32_t s = 0; s < 65536; ++s) {
    uint16_t v = exl3_decode_state_f16(s, cb);
    for (uint8_t b : {uint8_t(v & 255), uint8_t(v >> 8)}) { h ^= b; h *= 0x100000001b3ull; }
  }
  return h;
}

}  // namespace

// Expected values computed independently (Python: exact rational arithmetic, struct 'e' RNE packing).
TEST(Exl3Codebook, HandVerifiedValues) {
  struct Row { uint32_t s; uint16_t inst3, mcg, mul1; };
  const Row rows[] = {{0x0000, 0x3a25, 0x3f60, 0xc2e8}, {0x0001, 0xbb5b, 0x304e, 0x3921},
                      {0x1234, 0xc066, 0x3e0f, 0xb89e}, {0x8000, 0xb7f8, 0xb915, 0xbaf2},
                      {0xffff, 0xb110, 0x3acd, 0xb936}, {0xbeef, 0x424b, 0xc293, 0x3124}};
  for (const auto& r : rows) {
    EXPECT_EQ(exl3_decode_state_f16(r.s, Exl3Codebook::Inst3), r.inst3) << std::hex << r.s;
    EXPECT_EQ(exl3_decode_state_f16(r.s, Exl3Codebook::Mcg), r.mcg) << std::hex << r.s;
    EXPECT_EQ(exl3_decode_state_f16(r.s, Exl3Codebook::Mul1), r.mul1) << std::hex << r.s;
  }
}

TEST(Exl3Codebook, WholeTablesMatchIndependentReference) {
  EXPECT_EQ(fnv1a_table(Exl3Codebook::Inst3), 0xfad431e7e9266898ull);
  EXPECT_EQ(fnv1a_table(Exl3Codebook::Mcg), 0x7bb36b05a3b885a7ull);
  EXPECT_EQ(fnv1a_table(Exl3Codebook::Mul1), 0x55e1c748ed9f0cd7ull);
}

TEST(Exl3Codebook, TablesAgreeWithScalarDecodeAndRms) {
  for (auto cb : {Exl3Codebook::Inst3, Exl3Codebook::Mcg, Exl3Codebook::Mul1}) {
    const float* t = exl3_codebook_table(cb);
    double sq = 0;
    for (uint32_t s = 0; s < 65536; ++s) {
      ASSERT_EQ(t[s], f16_to_f32(exl3_decode_state_f16(s, cb)));
      sq += double(t[s]) * t[s];
    }
    double rms = std::sqrt(sq / 65536);
    EXPECT_NEAR(rms, cb == Exl3Codebook::Mul1 ? 1.00031 : cb == Exl3Codebook::Mcg ? 1.24411 : 1.24371, 1e-4);
  }
}

TEST(Exl3Codebook, Fp16RoundingIsNearestEven) {
  EXPECT_EQ(f64_to_f16_rne(1.0), 0x3c00);
  EXPECT_EQ(f64_to_f16_rne(1.0 + 0x1p-11), 0x3c00);                // tie -> even
  EXPECT_EQ(f64_to_f16_rne(1.0 + 3 * 0x1p-11), 0x3c02);            // tie -> even (up)
  EXPECT_EQ(f64_to_f16_rne(1.0 + 0x1p-11 + 0x1p-30), 0x3c01);      // just above tie
  EXPECT_EQ(f64_to_f16_rne(65504.0), 0x7bff);
  EXPECT_EQ(f64_to_f16_rne(65520.0), 0x7c00);
  EXPECT_EQ(f64_to_f16_rne(-0x1p-24), 0x8001);
  EXPECT_EQ(f64_to_f16_rne(0x1p-25), 0x0000);                      // tie between 0 and min subnormal -> 0
  EXPECT_EQ(f64_to_f16_rne(2047.5), 0x6800);                       // 2047.5 -> 2048 (even)
  std::mt19937 rng(1);
  for (int i = 0; i < 20000; ++i) {  // agrees with the project's fp32->fp16 where fp32 holds the value exactly
    float f = std::ldexp(float(rng() % 4096) / 2048.0f, int(rng() % 30) - 20) * ((rng() & 1) ? -1.0f : 1.0f);
    ASSERT_EQ(f64_to_f16_rne(f), f32_to_f16(f)) << f;
  }
}

TEST(Exl3Tile, ElementOrderIsAPermutationMatchingTensorCoreLayout) {
  std::set<int> seen;
  for (int t = 0; t < 256; ++t) seen.insert(exl3_tile_pos(t));
  EXPECT_EQ(seen.size(), 256u);
  EXPECT_EQ(exl3_tile_pos(0), 0 * 16 + 0);
  EXPECT_EQ(exl3_tile_pos(1), 1 * 16 + 0);
  EXPECT_EQ(exl3_tile_pos(2), 8 * 16 + 0);
  EXPECT_EQ(exl3_tile_pos(3), 9 * 16 + 0);
  EXPECT_EQ(exl3_tile_pos(4), 0 * 16 + 8);
  EXPECT_EQ(exl3_tile_pos(8), 2 * 16 + 0);       // lane 1: r0 = 2
  EXPECT_EQ(exl3_tile_pos(8 * 4), 0 * 16 + 1);   // lane 4: column 1
  EXPECT_EQ(exl3_tile_pos(255), 15 * 16 + 15);   // lane 31, i 7: row 6+9, column 7+8
}

TEST(Exl3Tile, StatesFollowTheBitstream) {
  // K = 4: word 0 = 0x12345678, word 31 = 0xABCD0FED; words are MSB-first, state t ends at bit 4(t+1),
  // so state 0 takes the stream's last 12 bits (0xFED) plus its first 4 (0x1).
  uint16_t tile[64] = {};
  tile[0] = 0x5678;
  tile[1] = 0x1234;
  tile[62] = 0x0FED;
  tile[63] = 0xABCD;
  uint16_t st[256];
  exl3_tile_states(tile, 4, st);
  EXPECT_EQ(st[0], 0xFED1);
  EXPECT_EQ(st[1], 0xED12);
  EXPECT_EQ(st[2], 0xD123);
  EXPECT_EQ(st[3], 0x1234);
  EXPECT_EQ(st[7], 0x5678);
  EXPECT_EQ(st[8], 0x6780);
  EXPECT_EQ(st[255], 0x0FED);
  EXPECT_EQ(st[251], 0xABCD);
}

TEST(Exl3Tile, PackAndStatesAreInverse) {
  std::mt19937 rng(7);
  for (int K = 1; K <= 8; ++K) {
    for (int rep = 0; rep < 20; ++rep) {
      std::vector<uint16_t> words(size_t(16 * K)), back(size_t(16 * K));
      for (auto& w : words) w = uint16_t(rng());
      uint16_t st[256];
      exl3_tile_states(words.data(), K, st);
      for (int t = 0; t < 256; ++t)  // tail-biting: every state, the first included, overlaps its predecessor
        ASSERT_EQ(st[t] >> K, st[(t + 255) % 256] & ((1u << (16 - K)) - 1)) << "K=" << K << " t=" << t;
      ASSERT_TRUE(exl3_pack_tile(st, K, back.data()));
      ASSERT_EQ(words, back) << "K=" << K;
    }
    uint16_t bad[256] = {};
    bad[100] = 0xFFFF;
    std::vector<uint16_t> out(size_t(16 * K));
    EXPECT_FALSE(exl3_pack_tile(bad, K, out.data())) << K;
  }
}

TEST(Exl3Tile, FastDecodeMatchesTableDecode) {
  std::mt19937 rng(21);
  for (auto cb : {Exl3Codebook::Inst3, Exl3Codebook::Mcg, Exl3Codebook::Mul1})
    for (int K = 1; K <= 8; ++K)
      for (int rep = 0; rep < 8; ++rep) {
        std::vector<uint16_t> words(size_t(16 * K));
        for (auto& w : words) w = uint16_t(rng());
        float a[256], b[256];
        exl3_decode_tile(words.data(), K, exl3_codebook_table(cb), a);
        exl3_decode_tile_fast(words.data(), K, cb, b);
        for (int i = 0; i < 256; ++i) ASSERT_EQ(a[i], b[i]) << "K=" << K << " cb=" << int(cb) << " i=" << i;
      }
}

TEST(Exl3Hadamard, MatchesSylvesterMatrixAndIsInvolution) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> x(256), y(256);
  for (auto& v : x) v = nd(rng);
  y = x;
  exl3_hadamard128(y.data(), 256);
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 128; ++i) {
      double s = 0;
      for (int j = 0; j < 128; ++j) s += ((__builtin_popcount(i & j) & 1) ? -1.0 : 1.0) * x[size_t(b * 128 + j)];
      ASSERT_NEAR(y[size_t(b * 128 + i)], s / std::sqrt(128.0), 1e-4);
    }
  exl3_hadamard128(y.data(), 256);
  for (int i = 0; i < 256; ++i) ASSERT_NEAR(y[size_t(i)], x[size_t(i)], 1e-5);
}

TEST(Exl3Quantizer, TilePathIsCyclicAndErrorFallsWithK) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.1f);
  float tgt[256];
  for (auto& v : tgt) v = nd(rng);
  double prev = 1e30;
  for (int K = 1; K <= 6; ++K) {
    uint16_t st[256];
    double err = exl3_quantize_tile(tgt, K, Exl3Codebook::Mul1, st);
    std::vector<uint16_t> words(size_t(16 * K));
    ASSERT_TRUE(exl3_pack_tile(st, K, words.data())) << K;
    // the packed bits decode to exactly the values the search scored
    float dec[256];
    exl3_decode_tile(words.data(), K, exl3_codebook_table(Exl3Codebook::Mul1), dec);
    double e2 = 0, energy = 0;
    for (int t = 0; t < 256; ++t) {
      double d = tgt[t] - dec[exl3_tile_pos(t)];
      e2 += d * d;
      energy += double(tgt[t]) * tgt[t];
    }
    EXPECT_NEAR(e2, err, 1e-3 * err + 1e-6);
    EXPECT_LT(err, prev) << K;
    prev = err;
    printf("K=%d tile rel mse %.5f\n", K, err / energy);
  }
}
