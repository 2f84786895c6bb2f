#include "backend/cpu/exl3_gemv.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string_view>

#include "format/exl3_tile.h"
#include "format/exl3_tile_simd.h"
#include "util/error.h"
#include "util/numeric.h"

namespace moesrv {

namespace {

// Row (k offset) of tile state t; the same for t and t + 32.
constexpr int state_row(int t) { return exl3_tile_pos(t) / 16; }

void strip_scalar(const Exl3Weights& w, const float* xs, int64_t n, int64_t nt, float* yr, int64_t ldy) {
  const int64_t tk = w.tiles_k();
  const float* table = w.table();
  float acc[kExl3GemvMaxRows][16] = {};
  uint16_t st[256];
  for (int64_t kt = 0; kt < tk; ++kt) {
    exl3_tile_states(w.tile(kt, nt), w.K, st);
    for (int t = 0; t < 256; ++t) {
      const float v = table[st[t]];
      const int c = exl3_tile_pos(t) % 16;
      for (int64_t r = 0; r < n; ++r) acc[r][c] += xs[(r * tk + kt) * 32 + t % 32] * v;
    }
  }
  for (int64_t r = 0; r < n; ++r) std::memcpy(yr + r * ldy + nt * 16, acc[r], sizeof(acc[r]));
}

// Avx512Int8's activations of 128 inputs (8 k-tiles) of one row: input k is scale * (hi_k + lo_k / 254). A tile's
// 16 state groups read one of two 16-lane activation sets (even groups states 0-15's rows, odd groups 16-31's);
// a tile's 64 bytes hold, in 128-bit lane q, hi of lanes 4q..4q+3 of the even set, of the odd set, then lo of both,
// which one in-lane byte shuffle each spreads to four bytes per lane (the layout VNNI multiplies by).
struct Int8Block {
  int8_t act[8][64];
  float scale;  // NaN when an input is not finite: the outputs come out NaN
  float sum;    // sum_k scale * (hi_k + lo_k / 254): the constant term of the codebook multiplies it
  float pad[14];
};
static_assert(sizeof(Int8Block) % 64 == 0);
constexpr int64_t kInt8BlockFloats = int64_t(sizeof(Int8Block) / sizeof(float));

void prepare_int8_block(const float* v, Int8Block& out) {
  float mx = 0.0f;
  bool finite = true;
  for (int64_t k = 0; k < kExl3ActivationBlock; ++k) {
    finite = finite && std::isfinite(v[k]);
    mx = std::max(mx, std::abs(v[k]));
  }
  const float inv = finite && mx > 0.0f ? 127.0f / mx : 0.0f;
  int8_t hi[kExl3ActivationBlock], lo[kExl3ActivationBlock];
  double sum = 0.0;
  for (int64_t k = 0; k < kExl3ActivationBlock; ++k) {
    const float q = v[k] * inv, h = std::clamp(std::nearbyint(q), -127.0f, 127.0f);
    const float l = std::clamp(std::nearbyint((q - h) * 254.0f), -127.0f, 127.0f);
    hi[k] = int8_t(h);
    lo[k] = int8_t(l);
    sum += double(h) + double(l) / 254.0;
  }
  out.scale = finite ? mx / 127.0f : std::numeric_limits<float>::quiet_NaN();
  out.sum = float(sum * double(out.scale));
  for (int kt = 0; kt < 8; ++kt)
    for (int t = 0; t < 32; ++t) {
      const int k = 16 * kt + state_row(t), lane = t % 16, at = 16 * (lane / 4) + 4 * (t / 16) + lane % 4;
      out.act[kt][at] = hi[k];
      out.act[kt][at + 8] = lo[k];
    }
}

}  // namespace

#if defined(MOESRV_HAS_AVX512_PATH)
MOESRV_AVX512_BEGIN
namespace {

#define MOESRV_AVX2_FN __attribute__((target("avx2,fma,f16c,avxvnni")))
#define MOESRV_VBMI_FN __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx512vnni,f16c,fma")))

// Tiles ahead of the current one that a strip prefetches: a strip's tiles lie out_pad * 2K bytes apart, a new page
// each, which the hardware prefetchers do not follow. 16 rather than 6: on the 2-core development VM, experts from
// memory ran 10-40% faster at 16-32 (exl3_expert_bench, noisy), where one tile computes in ~20 ns.
constexpr int64_t kPrefetchTiles = 16;

inline void prefetch_tile(const uint16_t* tile, int K) {
  const char* p = reinterpret_cast<const char*>(tile);
  for (int o = 0; o < 32 * K; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
  _mm_prefetch(p + 32 * K - 1, _MM_HINT_T0);
}

// The first tiles of strip nt, which the loop's prefetches (kPrefetchTiles ahead) do not reach.
inline void prefetch_strip_start(const Exl3Weights& w, int64_t nt) {
  for (int64_t kt = 0; kt < std::min(kPrefetchTiles, w.tiles_k()); ++kt) prefetch_tile(w.tile(kt, nt), w.K);
}

// Mul1: (1024 + byte sum) * k_inv + k_bias, exact in fp32, then one rounding to fp16. The byte sum is added to the
// bits of 2^23 + 1024 (the float's integer part, no conversion); the fma takes the 2^23 * k_inv back out in its
// constant, and its exact result is the same value (|v| < 4 on a 2^-18 grid), so no extra rounding.
const float kMul1Inv = f16_to_f32(0x1eee);
const float kMul1Offset = f16_to_f32(0xc931) - 8388608.0f * kMul1Inv;  // exact: a multiple of 2^-7 below 2^16
const float kMul1Const = f16_to_f32(0xc931) + 1024.0f * kMul1Inv;      // the value at byte sum 0 (exact)
constexpr int kMul1Bits = 0x4B000000 + 1024;                           // float bits of 2^23 + 1024

constexpr uint32_t mcg_mult(Exl3Codebook cb) { return cb == Exl3Codebook::Mcg ? kExl3McgMult : kExl3Inst3Mult; }

// ---- AVX2: 8 states per step ----------------------------------------------------------------------------------
// The one target string includes AVX-VNNI for both instantiations; the kVnni = false one emits no VNNI instruction.

// A tile as a byte stream (stream byte j = bits 8j .. 8j + 7, MSB first): its last word's 4 bytes, the tile's
// 32K bytes, its first word's 4 bytes, then zeros, so that state t's 16-bit window starts at stream bit
// tK + K + 16. Tile words are little-endian uint32 with MSB-first bits, so each word is byte-swapped.
constexpr int kStreamBytes = 32 * kExl3MaxK + 8 + 32;

MOESRV_AVX2_FN inline void tile_stream(const uint16_t* tile, int K, uint8_t* sb) {
  const __m256i bswap = _mm256_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12, 3, 2, 1, 0, 7, 6, 5, 4,
                                         11, 10, 9, 8, 15, 14, 13, 12);
  const uint8_t* t = reinterpret_cast<const uint8_t*>(tile);
  for (int o = 0; o < 32 * K; o += 32)  // K <= 8: 32 K bytes, whole 32-byte loads
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sb + 4 + o),
                        _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + o)), bswap));
  std::memcpy(sb, sb + 32 * K, 4);          // the last word before the first
  std::memcpy(sb + 4 + 32 * K, sb + 4, 4);  // the first word after the last
}

// States 8g .. 8g + 7 span 7K + 16 bits from bit 8gK + K + 16, a whole number gK of bytes further each g: one
// pattern per K. Lanes 0-3 read 16 bytes from byte gK + lo, lanes 4-7 from gK + hi; each lane's 4 bytes, big-endian,
// hold its window at bit 16 - phase, which one variable shift brings down.
struct Avx2Plan {
  alignas(32) uint8_t shuffle[32];
  alignas(32) int32_t shift[8];
  int lo, hi;
};

Avx2Plan make_avx2_plan(int K) {
  Avx2Plan p{};
  p.lo = (K + 16) / 8;
  p.hi = (5 * K + 16) / 8;
  for (int i = 0; i < 8; ++i) {
    const int bit = (i < 4 ? (K + 16) % 8 : (5 * K + 16) % 8) + (i % 4) * K;  // from the half's first byte
    for (int k = 0; k < 4; ++k) p.shuffle[4 * i + k] = uint8_t(bit / 8 + 3 - k);
    p.shift[i] = 16 - bit % 8;
  }
  return p;
}

// make(K) for every K = 1 .. kExl3MaxK, made once; the one for K.
template <class Plan, Plan (*make)(int)>
const Plan& plan_for(int K) {
  static const auto plans = [] {
    std::vector<Plan> v;
    for (int k = 1; k <= kExl3MaxK; ++k) v.push_back(make(k));
    return v;
  }();
  return plans[size_t(K - 1)];
}

const Avx2Plan& avx2_plan(int K) { return plan_for<Avx2Plan, make_avx2_plan>(K); }

template <Exl3Codebook CB, bool kVnni>
MOESRV_AVX2_FN inline __m256 decode8(const uint8_t* sb, int K, const Avx2Plan& p, __m256i shuffle, __m256i shift,
                                     int g) {
  const __m256i bytes = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(sb + g * K + p.hi),
                                            reinterpret_cast<const __m128i*>(sb + g * K + p.lo));
  const __m256i st =
      _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(bytes, shuffle), shift), _mm256_set1_epi32(0xFFFF));
  __m256 v;
  if constexpr (CB == Exl3Codebook::Mul1) {
    const __m256i x = _mm256_mullo_epi32(st, _mm256_set1_epi32(int(kExl3Mul1Mult)));
    __m256i bits;
    if constexpr (kVnni) {
      bits = _mm256_dpbusd_avx_epi32(_mm256_set1_epi32(kMul1Bits), x, _mm256_set1_epi32(0x01010101));
    } else {  // byte pairs, then the pairs: 2 multiply-adds
      const __m256i pairs = _mm256_maddubs_epi16(x, _mm256_set1_epi8(1));
      bits = _mm256_add_epi32(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)), _mm256_set1_epi32(kMul1Bits));
    }
    v = _mm256_fmadd_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(kMul1Inv), _mm256_set1_ps(kMul1Offset));
  } else {
    __m256i x = _mm256_mullo_epi32(st, _mm256_set1_epi32(int(mcg_mult(CB))));
    if constexpr (CB == Exl3Codebook::Inst3) x = _mm256_add_epi32(x, _mm256_set1_epi32(int(kExl3Inst3Add)));
    x = _mm256_xor_si256(_mm256_and_si256(x, _mm256_set1_epi32(int(0x8FFF8FFFu))), _mm256_set1_epi32(0x3B603B60));
    // both fp16 halves of each lane, packed: [lo 0-3, hi 0-3 | lo 4-7, hi 4-7] -> [lo 0-7 | hi 0-7]
    const __m256i halves = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(x, 16)), 0xD8);
    v = _mm256_add_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(halves)),
                      _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)));  // exact in fp32
  }
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

MOESRV_AVX2_FN inline float sum4(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

// 8 consecutive states 32j + 8q .. +7 of a tile: lanes 0-3 column j, lanes 4-7 column j + 8, the rows of states
// 8q .. 8q + 7 of xs.
template <Exl3Codebook CB, bool kVnni, int NR>
MOESRV_AVX2_FN void strip_avx2(const Exl3Weights& w, const float* xs, int64_t nt, float* yr, int64_t ldy) {
  const int K = w.K;
  const int64_t tk = w.tiles_k(), stride = w.tiles_n() * 16 * K;
  const Avx2Plan& p = avx2_plan(K);
  const __m256i shuffle = _mm256_load_si256(reinterpret_cast<const __m256i*>(p.shuffle));
  const __m256i shift = _mm256_load_si256(reinterpret_cast<const __m256i*>(p.shift));
  __m256 acc[NR][8];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 8; ++j) acc[r][j] = _mm256_setzero_ps();
  alignas(32) uint8_t sb[kStreamBytes] = {};
  prefetch_strip_start(w, nt);
  for (int64_t kt = 0; kt < tk; ++kt) {
    const uint16_t* tile = w.tile(kt, nt);
    if (kt + kPrefetchTiles < tk) prefetch_tile(tile + kPrefetchTiles * stride, K);
    tile_stream(tile, K, sb);
    const float* x = xs + kt * 32;
#pragma GCC unroll 32
    for (int g = 0; g < 32; ++g) {
      const __m256 v = decode8<CB, kVnni>(sb, K, p, shuffle, shift, g);
      for (int r = 0; r < NR; ++r)
        acc[r][g / 4] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + r * tk * 32 + 8 * (g % 4)), acc[r][g / 4]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 8; ++j) {
      yr[r * ldy + nt * 16 + j] = sum4(_mm256_castps256_ps128(acc[r][j]));
      yr[r * ldy + nt * 16 + j + 8] = sum4(_mm256_extractf128_ps(acc[r][j], 1));
    }
}

// The lanes of acc[j] in `low` sum into column j, the others into column j + 8 (default: lanes 0-3 / 8-11 and 4-7 /
// 12-15, the decoders' state order).
MOESRV_AVX512_FN inline void store_columns(const __m512* acc, float* y, __mmask16 low = 0x0F0F) {
  for (int j = 0; j < 8; ++j) {
    y[j] = _mm512_mask_reduce_add_ps(low, acc[j]);
    y[j + 8] = _mm512_mask_reduce_add_ps(__mmask16(~low), acc[j]);
  }
}

// ---- AVX-512 F/BW/DQ/VL: the word-permute decoder (exl3_simd::decode16) ------------------------------------------

// States t0 = 32j + {0, 16} of a tile hold output columns j and j + 8 over all 16 input rows (lanes 0-3 / 8-11
// column j, lanes 4-7 / 12-15 column j + 8); each (row, column pair) keeps a lane-wise accumulator.
MOESRV_AVX512_FN void strip_avx512(const Exl3Weights& w, const float* xs, int64_t n, int64_t nt, float* yr,
                                   int64_t ldy) {
  const int64_t tk = w.tiles_k();
  __m512 acc[kExl3GemvMaxRows][8];
  for (int64_t r = 0; r < n; ++r)
    for (int j = 0; j < 8; ++j) acc[r][j] = _mm512_setzero_ps();
  alignas(64) uint32_t ext[exl3_simd::kExtWords] = {};
  for (int64_t kt = 0; kt < tk; ++kt) {
    exl3_tile_words(w.tile(kt, nt), w.K, ext);
    const float* x = xs + kt * 32;
    for (int j = 0; j < 8; ++j) {
      const __m512 v0 = exl3_simd::decode16(ext, w.K, w.codebook, 32 * j);
      const __m512 v1 = exl3_simd::decode16(ext, w.K, w.codebook, 32 * j + 16);
      for (int64_t r = 0; r < n; ++r) {
        const float* xrow = x + r * tk * 32;
        acc[r][j] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(xrow), acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(xrow + 16), acc[r][j]);
      }
    }
  }
  for (int64_t r = 0; r < n; ++r) store_columns(acc[r], yr + r * ldy + nt * 16);
}

// ---- AVX-512 VBMI + VNNI: byte permute + multishift ------------------------------------------------------------
//
// Stream byte b of a tile is memory byte b ^ 3 (little-endian words, MSB-first bits). A qword whose byte k holds
// stream byte q + 7 - k has stream bit 8q + d at bit 63 - d, so the 16-bit window [s, s + 16) is the plain field at
// bit 48 - (s - 8q). Group m (states 16m .. 16m + 15, lanes 2i and 2i + 1 in qword i) takes one 64-byte load at
// base[m]; vpermb builds each qword from it, vpmultishiftqb cuts both windows out (bytes 2-3 of each lane zeroed).
// Group 0's windows start up to 15 bits before the tile: its source has the tile's last word in bytes 60-63.
// Groups m and m + 2 (m >= 1) are 32K bits apart, so their byte pattern is the same: three patterns per K.
struct VbmiPlan {
  alignas(64) uint8_t idx[3][64];  // pattern 0: group 0, 1: odd groups, 2: even groups >= 2
  alignas(64) uint8_t ctrl[3][64];
  int32_t base[16];  // byte offset of each group's 64-byte source in the tile
};

int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

VbmiPlan make_vbmi_plan(int K) {
  VbmiPlan p{};
  for (int m = 0; m < 16; ++m) p.base[m] = m == 0 ? 0 : 4 * floor_div((16 * m + 1) * K - 16, 32);
  for (int c = 0; c < 3; ++c) {
    const int m = c;
    for (int i = 0; i < 8; ++i) {
      const int s = (16 * m + 2 * i + 1) * K - 16, q = floor_div(s, 8);
      const int dmax = (s + K + 15 - 8 * q) / 8;  // last stream byte (from q) either window touches
      for (int k = 0; k < 8; ++k) {
        const int d = 7 - k, sb = q + d;
        int rb = sb < 0 ? 60 + ((sb + 4) ^ 3) : (sb ^ 3) - p.base[m];
        if (d > dmax) rb = 0;  // not part of either window
        MOESRV_CHECK(rb >= 0 && rb < (m == 0 && sb >= 0 ? 60 : 64), "exl3 vbmi plan: K={} group {} byte {}", K, m, sb);
        p.idx[c][8 * i + k] = uint8_t(rb);
      }
      const int o = 48 - (s - 8 * q), o2 = o - K;
      const uint8_t ctrl[8] = {uint8_t(o), uint8_t(o + 8), 0, 0, uint8_t(o2), uint8_t(o2 + 8), 0, 0};
      std::memcpy(p.ctrl[c] + 8 * i, ctrl, 8);
    }
  }
  return p;
}

const VbmiPlan& vbmi_plan(int K) { return plan_for<VbmiPlan, make_vbmi_plan>(K); }

template <Exl3Codebook CB>
MOESRV_VBMI_FN inline __m512 codebook16(__m512i st) {
  __m512 v;
  if constexpr (CB == Exl3Codebook::Mul1) {
    const __m512i x = _mm512_mullo_epi32(st, _mm512_set1_epi32(int(kExl3Mul1Mult)));
    const __m512i bits = _mm512_dpbusd_epi32(_mm512_set1_epi32(kMul1Bits), x, _mm512_set1_epi32(0x01010101));
    v = _mm512_fmadd_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(kMul1Inv), _mm512_set1_ps(kMul1Offset));
  } else {
    __m512i x = _mm512_mullo_epi32(st, _mm512_set1_epi32(int(mcg_mult(CB))));
    if constexpr (CB == Exl3Codebook::Inst3) x = _mm512_add_epi32(x, _mm512_set1_epi32(int(kExl3Inst3Add)));
    x = _mm512_xor_si512(_mm512_and_si512(x, _mm512_set1_epi32(int(0x8FFF8FFFu))), _mm512_set1_epi32(0x3B603B60));
    v = _mm512_add_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(x)),
                      _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16))));  // exact in fp32
  }
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The plan's patterns in registers, and a tile's 16 state groups from them.
struct VbmiRegs {
  __m512i idx0, ctrl0, idx_odd, ctrl_odd, idx_even, ctrl_even;
};

MOESRV_VBMI_FN inline VbmiRegs vbmi_regs(const VbmiPlan& p) {
  return {_mm512_load_si512(p.idx[0]),  _mm512_load_si512(p.ctrl[0]), _mm512_load_si512(p.idx[1]),
          _mm512_load_si512(p.ctrl[1]), _mm512_load_si512(p.idx[2]),  _mm512_load_si512(p.ctrl[2])};
}

// Tile (kt, nt) as bytes the group loads may read 64 at a time (copied into `safe` near the trellis' end), its next
// tiles prefetched; src0 = group 0's source (the tile's last word in bytes 60-63).
MOESRV_VBMI_FN inline const uint8_t* vbmi_tile(const Exl3Weights& w, int64_t kt, int64_t nt, uint8_t* safe,
                                               __m512i& src0) {
  const int K = w.K, tile_bytes = 32 * K;
  const uint16_t* tile16 = w.tile(kt, nt);
  if (kt + kPrefetchTiles < w.tiles_k()) prefetch_tile(tile16 + kPrefetchTiles * w.tiles_n() * 16 * K, K);
  const uint8_t* tile = reinterpret_cast<const uint8_t*>(tile16);
  if (tile + tile_bytes + 64 > reinterpret_cast<const uint8_t*>(w.trellis) + w.trellis_bytes()) {
    std::memcpy(safe, tile, size_t(tile_bytes));
    tile = safe;
  }
  uint32_t last;
  std::memcpy(&last, tile + tile_bytes - 4, 4);
  src0 = _mm512_mask_set1_epi32(_mm512_loadu_si512(tile), 0x8000, int(last));
  return tile;
}

// The 16 states of group m of a tile, one per 32-bit lane.
MOESRV_VBMI_FN inline __m512i vbmi_states(const VbmiRegs& g, const VbmiPlan& p, const uint8_t* tile, __m512i src0,
                                          int m) {
  constexpr __mmask64 kLow16 = 0x3333333333333333ull;  // bytes 0-1 of each 32-bit lane
  const __m512i src = m == 0 ? src0 : _mm512_loadu_si512(tile + p.base[m]);
  const __m512i idx = m == 0 ? g.idx0 : (m % 2 ? g.idx_odd : g.idx_even);
  const __m512i ctrl = m == 0 ? g.ctrl0 : (m % 2 ? g.ctrl_odd : g.ctrl_even);
  return _mm512_maskz_multishift_epi64_epi8(kLow16, ctrl, _mm512_permutexvar_epi8(idx, src));
}

template <Exl3Codebook CB, int NR>
MOESRV_VBMI_FN void strip_vbmi(const Exl3Weights& w, const float* xs, int64_t nt, float* yr, int64_t ldy) {
  const int64_t tk = w.tiles_k();
  const VbmiPlan& p = vbmi_plan(w.K);
  const VbmiRegs g = vbmi_regs(p);
  __m512 acc[NR][8];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 8; ++j) acc[r][j] = _mm512_setzero_ps();
  alignas(64) uint8_t safe[32 * kExl3MaxK + 64] = {};
  prefetch_strip_start(w, nt);
  for (int64_t kt = 0; kt < tk; ++kt) {
    __m512i src0;
    const uint8_t* tile = vbmi_tile(w, kt, nt, safe, src0);
    const float* x = xs + kt * 32;
#pragma GCC unroll 16
    for (int m = 0; m < 16; ++m) {
      const __m512 v = codebook16<CB>(vbmi_states(g, p, tile, src0, m));
      for (int r = 0; r < NR; ++r)
        acc[r][m / 2] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + r * tk * 32 + 16 * (m % 2)), acc[r][m / 2]);
    }
  }
  for (int r = 0; r < NR; ++r) store_columns(acc[r], yr + r * ldy + nt * 16);
}

// AVX512-FP16 intrinsics under a target attribute: GCC 12 has them; clang 14 declares them only
// when the whole file is built for AVX512-FP16, so clang builds leave this path out (reported unsupported).
#if !defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 12
#define MOESRV_HAS_FP16_PATH 1
#define MOESRV_FP16_FN \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx512vnni,avx512fp16,f16c,fma")))

// Avx512Fp16: Avx512Vbmi's states; groups m and m + 1 (m even) decoded as one vector of 32 fp16 values whose one fp16
// operation rounds as the codebook does. Mul1: the byte sums on 0x6400 are the fp16 bits of 1024 + bs; packed, one
// fp16 fma with the codebook's constants. 3INST / MCG: the masked products' low and high halves gathered into two
// vectors, one fp16 add. Lanes come in vpackusdw's order ([group m lanes 4j..4j+3, group m + 1 lanes 4j..4j+3] per
// 128 bits), so both 16-lane halves hold columns m / 2 (lanes 0-7) and m / 2 + 8 (lanes 8-15): one accumulator per
// pair takes both, with the activations permuted to match per tile.
template <Exl3Codebook CB>
MOESRV_FP16_FN inline __m512i fp16_values32(__m512i st0, __m512i st1) {
  if constexpr (CB == Exl3Codebook::Mul1) {
    const __m512i mult = _mm512_set1_epi32(int(kExl3Mul1Mult)), ones = _mm512_set1_epi32(0x01010101);
    const __m512i base = _mm512_set1_epi32(0x6400);
    const __m512i b0 = _mm512_dpbusd_epi32(base, _mm512_mullo_epi32(st0, mult), ones);
    const __m512i b1 = _mm512_dpbusd_epi32(base, _mm512_mullo_epi32(st1, mult), ones);
    const __m512h a = _mm512_castsi512_ph(_mm512_set1_epi16(0x1eee)),
                  c = _mm512_castsi512_ph(_mm512_set1_epi16(int16_t(0xc931)));
    return _mm512_castph_si512(_mm512_fmadd_ph(_mm512_castsi512_ph(_mm512_packus_epi32(b0, b1)), a, c));
  } else {
    const __m512i mult = _mm512_set1_epi32(int(mcg_mult(CB)));
    __m512i x0 = _mm512_mullo_epi32(st0, mult), x1 = _mm512_mullo_epi32(st1, mult);
    if constexpr (CB == Exl3Codebook::Inst3) {
      x0 = _mm512_add_epi32(x0, _mm512_set1_epi32(int(kExl3Inst3Add)));
      x1 = _mm512_add_epi32(x1, _mm512_set1_epi32(int(kExl3Inst3Add)));
    }
    const __m512i mask = _mm512_set1_epi32(int(0x8FFF8FFFu)), flip = _mm512_set1_epi32(0x3B603B60);
    x0 = _mm512_ternarylogic_epi32(x0, mask, flip, 0x6A);  // (x & mask) ^ flip
    x1 = _mm512_ternarylogic_epi32(x1, mask, flip, 0x6A);
    alignas(64) static constexpr auto kLow =
        [] {  // vpackusdw's order of the low halves (words 2d of x0, 32 + 2d of x1)
          std::array<uint16_t, 32> idx{};
          for (int w = 0; w < 32; ++w) {
            const int j = w / 8, i = w % 8;
            idx[size_t(w)] = uint16_t(i < 4 ? 2 * (4 * j + i) : 32 + 2 * (4 * j + i - 4));
          }
          return idx;
        }();
    const __m512i lo_idx = _mm512_load_si512(kLow.data()), hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(1));
    const __m512h lo = _mm512_castsi512_ph(_mm512_permutex2var_epi16(x0, lo_idx, x1));
    const __m512h hi = _mm512_castsi512_ph(_mm512_permutex2var_epi16(x0, hi_idx, x1));
    return _mm512_castph_si512(_mm512_add_ph(lo, hi));
  }
}

template <Exl3Codebook CB, int NR>
MOESRV_FP16_FN void strip_fp16(const Exl3Weights& w, const float* xs, int64_t nt, float* yr, int64_t ldy) {
  const int64_t tk = w.tiles_k();
  const VbmiPlan& p = vbmi_plan(w.K);
  const VbmiRegs g = vbmi_regs(p);
  // lanes of the packed halves: [x 0-3, x 16-19, x 4-7, x 20-23] and [x 8-11, x 24-27, x 12-15, x 28-31]
  const __m512i perm_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i perm_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  __m512 acc[NR][8];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 8; ++j) acc[r][j] = _mm512_setzero_ps();
  alignas(64) uint8_t safe[32 * kExl3MaxK + 64] = {};
  prefetch_strip_start(w, nt);
  for (int64_t kt = 0; kt < tk; ++kt) {
    __m512i src0;
    const uint8_t* tile = vbmi_tile(w, kt, nt, safe, src0);
    __m512 xl[NR], xh[NR];
    for (int r = 0; r < NR; ++r) {
      const float* x = xs + (r * tk + kt) * 32;
      const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
      xl[r] = _mm512_permutex2var_ps(x0, perm_lo, x1);
      xh[r] = _mm512_permutex2var_ps(x0, perm_hi, x1);
    }
#pragma GCC unroll 8
    for (int m = 0; m < 16; m += 2) {
      const __m512i h = fp16_values32<CB>(vbmi_states(g, p, tile, src0, m), vbmi_states(g, p, tile, src0, m + 1));
      const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
      const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
      for (int r = 0; r < NR; ++r) {
        acc[r][m / 2] = _mm512_fmadd_ps(lo, xl[r], acc[r][m / 2]);
        acc[r][m / 2] = _mm512_fmadd_ps(hi, xh[r], acc[r][m / 2]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) store_columns(acc[r], yr + r * ldy + nt * 16, 0x00FF);
}
#endif  // MOESRV_HAS_FP16_PATH

// In-lane byte indices that spread Int8Block's bytes: lane L of set j (hi even, hi odd, lo even, lo odd) gets byte
// 4 j + L % 4 of its 128-bit lane, four times.
alignas(64) const auto kInt8Spread = [] {
  std::array<std::array<uint8_t, 64>, 4> p{};
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < 64; ++i) p[size_t(j)][size_t(i)] = uint8_t(4 * j + (i % 16) / 4);
  return p;
}();

// Avx512Int8 (Mul1): per row, VNNI sums the product bytes of s * M times the int8 activations into 32-bit lanes,
// hi and lo apart, for one 128-input block; then they join the fp32 sums at the block's scale. The output is
// A * sum_k x_k bs_k + C * sum_k x_k with the codebook's A and C = 1024 A + B (its unrounded value A * bs + C).
MOESRV_VBMI_FN void strip_int8(const Exl3Weights& w, const float* xs, int64_t n, int64_t nt, float* yr, int64_t ldy) {
  const int64_t blocks = w.tiles_k() / 8;
  const VbmiPlan& p = vbmi_plan(w.K);
  const VbmiRegs g = vbmi_regs(p);
  const __m512i mult = _mm512_set1_epi32(int(kExl3Mul1Mult));
  alignas(64) uint8_t safe[32 * kExl3MaxK + 64] = {};
  prefetch_strip_start(w, nt);
  for (int64_t r = 0; r < n; ++r) {
    const Int8Block* xb = reinterpret_cast<const Int8Block*>(xs + r * blocks * kInt8BlockFloats);
    __m512 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
    float xsum = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i hi[8], lo[8];
      for (int j = 0; j < 8; ++j) hi[j] = lo[j] = _mm512_setzero_si512();
      for (int64_t t = 0; t < 8; ++t) {
        __m512i src0;
        const uint8_t* tile = vbmi_tile(w, 8 * b + t, nt, safe, src0);
        const __m512i a = _mm512_loadu_si512(xb[b].act[t]);
        const __m512i hi_even = _mm512_shuffle_epi8(a, _mm512_load_si512(kInt8Spread[0].data()));
        const __m512i hi_odd = _mm512_shuffle_epi8(a, _mm512_load_si512(kInt8Spread[1].data()));
        const __m512i lo_even = _mm512_shuffle_epi8(a, _mm512_load_si512(kInt8Spread[2].data()));
        const __m512i lo_odd = _mm512_shuffle_epi8(a, _mm512_load_si512(kInt8Spread[3].data()));
#pragma GCC unroll 16
        for (int m = 0; m < 16; ++m) {
          const __m512i prod = _mm512_mullo_epi32(vbmi_states(g, p, tile, src0, m), mult);
          hi[m / 2] = _mm512_dpbusd_epi32(hi[m / 2], prod, m % 2 ? hi_odd : hi_even);
          lo[m / 2] = _mm512_dpbusd_epi32(lo[m / 2], prod, m % 2 ? lo_odd : lo_even);
        }
      }
      const __m512 scale = _mm512_set1_ps(xb[b].scale);
      for (int j = 0; j < 8; ++j) {
        const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[j]), _mm512_set1_ps(1.0f / 254.0f),
                                           _mm512_cvtepi32_ps(hi[j]));  // exact integers below 2^24 before
        acc[j] = _mm512_fmadd_ps(sum, scale, acc[j]);
      }
      xsum += xb[b].sum;
    }
    float* y = yr + r * ldy + nt * 16;
    store_columns(acc, y);
    for (int c = 0; c < 16; ++c) y[c] = kMul1Inv * y[c] + kMul1Const * xsum;
  }
}

// Rows go through in groups whose accumulators fit the registers (2 rows: 16 zmm; 1 row: 8 ymm), each group
// decoding the tiles again: cheaper than accumulators spilled to memory. Each row's sums are the same either way.
template <Exl3Codebook CB>
void strip_simd(Exl3GemvPath path, const Exl3Weights& w, const float* xs, int64_t n, int64_t nt, float* yr,
                int64_t ldy) {
  const bool vbmi = path == Exl3GemvPath::Avx512Vbmi;
  const int64_t group = vbmi ? 2 : 1, tk = w.tiles_k();
  for (int64_t r0 = 0; r0 < n; r0 += group) {
    const float* x = xs + r0 * tk * 32;
    float* y = yr + r0 * ldy;
    if (!vbmi) {
      if (path == Exl3GemvPath::Avx2Vnni) strip_avx2<CB, true, 1>(w, x, nt, y, ldy);
      else strip_avx2<CB, false, 1>(w, x, nt, y, ldy);
    } else if (n - r0 >= 2) {
      strip_vbmi<CB, 2>(w, x, nt, y, ldy);
    } else {
      strip_vbmi<CB, 1>(w, x, nt, y, ldy);
    }
  }
}

// Avx512Fp16: rows in pairs, as strip_simd's Avx512Vbmi, per codebook.
void strip_fp16_rows(const Exl3Weights& w, const float* xs, int64_t n, int64_t nt, float* yr, int64_t ldy) {
#if !defined(MOESRV_HAS_FP16_PATH)
  (void)w, (void)xs, (void)n, (void)nt, (void)yr, (void)ldy;
  MOESRV_CHECK(false, "exl3 gemv: avx512-fp16 is not built in (compiler)");
#else
  const int64_t tk = w.tiles_k();
  auto rows = [&]<Exl3Codebook CB>() {
    for (int64_t r0 = 0; r0 < n; r0 += 2) {
      if (n - r0 >= 2) strip_fp16<CB, 2>(w, xs + r0 * tk * 32, nt, yr + r0 * ldy, ldy);
      else strip_fp16<CB, 1>(w, xs + r0 * tk * 32, nt, yr + r0 * ldy, ldy);
    }
  };
  switch (w.codebook) {
    case Exl3Codebook::Mul1: return rows.operator()<Exl3Codebook::Mul1>();
    case Exl3Codebook::Mcg: return rows.operator()<Exl3Codebook::Mcg>();
    case Exl3Codebook::Inst3: return rows.operator()<Exl3Codebook::Inst3>();
  }
#endif
}

}  // namespace
MOESRV_AVX512_END
#endif  // MOESRV_HAS_AVX512_PATH

const char* exl3_gemv_path_name(Exl3GemvPath p) {
  switch (p) {
    case Exl3GemvPath::Scalar: return "scalar";
    case Exl3GemvPath::Avx2: return "avx2";
    case Exl3GemvPath::Avx2Vnni: return "avx2-vnni";
    case Exl3GemvPath::Avx512: return "avx512";
    case Exl3GemvPath::Avx512Vbmi: return "avx512-vbmi";
    case Exl3GemvPath::Avx512Int8: return "avx512-int8";
    case Exl3GemvPath::Avx512Fp16: return "avx512-fp16";
  }
  return "?";
}

bool exl3_gemv_path_supported(Exl3GemvPath p) {
#if defined(MOESRV_HAS_AVX512_PATH)
  switch (p) {
    case Exl3GemvPath::Scalar: return true;
    case Exl3GemvPath::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Exl3GemvPath::Avx2Vnni:
      return exl3_gemv_path_supported(Exl3GemvPath::Avx2) && __builtin_cpu_supports("avxvnni");
    case Exl3GemvPath::Avx512: return exl3_simd::cpu_has_avx512();
    case Exl3GemvPath::Avx512Vbmi:
    case Exl3GemvPath::Avx512Int8:
      return exl3_simd::cpu_has_avx512() && __builtin_cpu_supports("avx512vbmi") &&
             __builtin_cpu_supports("avx512vnni");
    case Exl3GemvPath::Avx512Fp16:
#if defined(MOESRV_HAS_FP16_PATH)
      return exl3_gemv_path_supported(Exl3GemvPath::Avx512Vbmi) && __builtin_cpu_supports("avx512fp16");
#else
      return false;
#endif
  }
  return false;
#else
  return p == Exl3GemvPath::Scalar;
#endif
}

int64_t exl3_gemv_fast_rows(Exl3GemvPath p) {
  if (p == Exl3GemvPath::Scalar) return 0;
  return p == Exl3GemvPath::Avx2 || p == Exl3GemvPath::Avx2Vnni ? 1 : kExl3GemvMaxRows;
}

Exl3GemvPath exl3_gemv_best_path() {
  static const Exl3GemvPath best = [] {
    for (auto p : {Exl3GemvPath::Avx512Fp16, Exl3GemvPath::Avx512Vbmi, Exl3GemvPath::Avx512, Exl3GemvPath::Avx2Vnni,
                   Exl3GemvPath::Avx2})
      if (exl3_gemv_path_supported(p)) return p;
    return Exl3GemvPath::Scalar;
  }();
  return best;
}

namespace {
std::atomic<int> g_default_path{-1};
}

Exl3GemvPath exl3_gemv_default_path() {
  int p = g_default_path.load(std::memory_order_relaxed);
  if (p >= 0) return Exl3GemvPath(p);
  Exl3GemvPath chosen = exl3_gemv_best_path();
  if (const char* env = std::getenv("MOESRV_EXL3_GEMV"))
    for (auto q : kExl3GemvPaths)
      if (std::string_view(env) == exl3_gemv_path_name(q) && exl3_gemv_path_supported(q)) chosen = q;
  g_default_path.store(int(chosen), std::memory_order_relaxed);
  return chosen;
}

void exl3_gemv_set_default_path(Exl3GemvPath p) {
  MOESRV_CHECK(exl3_gemv_path_supported(p), "exl3 gemv: path {} is not supported on this CPU", exl3_gemv_path_name(p));
  g_default_path.store(int(p), std::memory_order_relaxed);
}

Exl3GemvPath exl3_gemv_path_for(Exl3GemvPath p, const Exl3Weights& w) {
  if (p == Exl3GemvPath::Avx512Int8 && (w.codebook != Exl3Codebook::Mul1 || w.in_pad % kExl3ActivationBlock != 0))
    return Exl3GemvPath::Avx512Vbmi;
  return p;
}

int64_t exl3_activation_floats(Exl3GemvPath p, int64_t kp) {
  return p == Exl3GemvPath::Avx512Int8 ? kp / kExl3ActivationBlock * kInt8BlockFloats : kp * 2;
}

void exl3_prepare_activation_block(Exl3GemvPath p, const float* v, int64_t b, float* row) {
  constexpr int64_t tiles = kExl3ActivationBlock / 16;
  if (p == Exl3GemvPath::Avx512Int8) return prepare_int8_block(v, reinterpret_cast<Int8Block*>(row)[b]);
  exl3_activations_in_state_order(v, 1, kExl3ActivationBlock, 0, tiles, row + b * tiles * 32);
}

void exl3_prepare_activations(Exl3GemvPath p, const float* xr, int64_t n, int64_t kp, float* xs) {
  if (p != Exl3GemvPath::Avx512Int8) return exl3_activations_in_state_order(xr, n, kp, 0, kp / 16, xs);
  MOESRV_CHECK(kp % kExl3ActivationBlock == 0, "exl3 gemv: {} inputs are not whole blocks of {}", kp,
               kExl3ActivationBlock);
  const int64_t floats = exl3_activation_floats(p, kp);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < kp / kExl3ActivationBlock; ++b)
      exl3_prepare_activation_block(p, xr + r * kp + b * kExl3ActivationBlock, b, xs + r * floats);
}

void exl3_activations_in_state_order(const float* xr, int64_t n, int64_t kp, int64_t kt0, int64_t kt1, float* xs) {
  const int64_t tk = kp / 16;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t kt = kt0; kt < kt1; ++kt)
      for (int t = 0; t < 32; ++t) xs[(r * tk + kt) * 32 + t] = xr[r * kp + kt * 16 + state_row(t)];
}

void exl3_gemv_strip(Exl3GemvPath path, const Exl3Weights& w, const float* xs, int64_t n, int64_t nt, float* yr,
                     int64_t ldy) {
#if defined(MOESRV_HAS_AVX512_PATH)
  if (path == Exl3GemvPath::Avx512) return strip_avx512(w, xs, n, nt, yr, ldy);
  if (path == Exl3GemvPath::Avx512Int8) {
    MOESRV_CHECK(exl3_gemv_path_for(path, w) == path, "exl3 gemv: avx512-int8 does not run {} weights with {} inputs",
                 exl3_codebook_name(w.codebook), w.in_pad);
    return strip_int8(w, xs, n, nt, yr, ldy);
  }
  if (path == Exl3GemvPath::Avx512Fp16) return strip_fp16_rows(w, xs, n, nt, yr, ldy);
  if (path == Exl3GemvPath::Avx2 || path == Exl3GemvPath::Avx2Vnni || path == Exl3GemvPath::Avx512Vbmi) {
    switch (w.codebook) {
      case Exl3Codebook::Mul1: return strip_simd<Exl3Codebook::Mul1>(path, w, xs, n, nt, yr, ldy);
      case Exl3Codebook::Mcg: return strip_simd<Exl3Codebook::Mcg>(path, w, xs, n, nt, yr, ldy);
      case Exl3Codebook::Inst3: return strip_simd<Exl3Codebook::Inst3>(path, w, xs, n, nt, yr, ldy);
    }
  }
#endif
  strip_scalar(w, xs, n, nt, yr, ldy);
}

}  // namespace moesrv
