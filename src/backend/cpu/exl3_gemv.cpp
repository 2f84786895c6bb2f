#include "backend/cpu/exl3_gemv.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
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

}  // namespace

#if defined(MOESRV_HAS_AVX512_PATH)
MOESRV_AVX512_BEGIN
namespace {

#define MOESRV_AVX2_FN __attribute__((target("avx2,fma,f16c,avxvnni")))
#define MOESRV_VBMI_FN __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx512vnni,f16c,fma")))

// Tiles ahead of the current one that a strip prefetches: a strip's tiles lie out_pad * 2K bytes apart, a new page
// each, which the hardware prefetchers do not follow.
constexpr int64_t kPrefetchTiles = 6;

inline void prefetch_tile(const uint16_t* tile, int K) {
  const char* p = reinterpret_cast<const char*>(tile);
  for (int o = 0; o < 32 * K; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
  _mm_prefetch(p + 32 * K - 1, _MM_HINT_T0);
}

// Mul1: (1024 + byte sum) * k_inv + k_bias, exact in fp32, then one rounding to fp16. The byte sum is added to the
// bits of 2^23 + 1024 (the float's integer part, no conversion); the fma takes the 2^23 * k_inv back out in its
// constant, and its exact result is the same value (|v| < 4 on a 2^-18 grid), so no extra rounding.
const float kMul1Inv = f16_to_f32(0x1eee);
const float kMul1Offset = f16_to_f32(0xc931) - 8388608.0f * kMul1Inv;  // exact: a multiple of 2^-7 below 2^16
constexpr int kMul1Bits = 0x4B000000 + 1024;                           // float bits of 2^23 + 1024

constexpr uint32_t mcg_mult(Exl3Codebook cb) { return cb == Exl3Codebook::Mcg ? kExl3McgMult : kExl3Inst3Mult; }

// ---- AVX2: 8 states per step ----------------------------------------------------------------------------------
// The one target string includes AVX-VNNI for both instantiations; the kVnni = false one emits no VNNI instruction.

template <Exl3Codebook CB, bool kVnni>
MOESRV_AVX2_FN inline __m256 decode8(const uint32_t* ext, int K, __m256i laneK, int t0) {
  const int s0 = t0 * K + K + 16;  // ext bit (MSB-first) where state t0's window starts
  const __m256i s = _mm256_add_epi32(laneK, _mm256_set1_epi32(s0 & 31));
  const __m256i wi = _mm256_srli_epi32(s, 5), sh = _mm256_and_si256(s, _mm256_set1_epi32(31));
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ext + (s0 >> 5)));
  const __m256i a = _mm256_permutevar8x32_epi32(words, wi);
  const __m256i b = _mm256_permutevar8x32_epi32(words, _mm256_add_epi32(wi, _mm256_set1_epi32(1)));
  const __m256i hi32 =
      _mm256_or_si256(_mm256_sllv_epi32(a, sh), _mm256_srlv_epi32(b, _mm256_sub_epi32(_mm256_set1_epi32(32), sh)));
  const __m256i st = _mm256_srli_epi32(hi32, 16);
  __m256 v;
  if constexpr (CB == Exl3Codebook::Mul1) {
    const __m256i x = _mm256_mullo_epi32(st, _mm256_set1_epi32(int(kExl3Mul1Mult)));
    __m256i bits;
    if constexpr (kVnni) {
      bits = _mm256_dpbusd_avx_epi32(_mm256_set1_epi32(kMul1Bits), x, _mm256_set1_epi32(0x01010101));
    } else {
      const __m256i m = _mm256_set1_epi32(0x00FF00FF);
      const __m256i y = _mm256_add_epi32(_mm256_and_si256(x, m), _mm256_and_si256(_mm256_srli_epi32(x, 8), m));
      bits =
          _mm256_add_epi32(_mm256_add_epi32(_mm256_and_si256(y, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(y, 16)),
                           _mm256_set1_epi32(kMul1Bits));
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
  const __m256i laneK = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(K));
  __m256 acc[NR][8];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 8; ++j) acc[r][j] = _mm256_setzero_ps();
  alignas(32) uint32_t ext[exl3_simd::kExtWords] = {};
  for (int64_t kt = 0; kt < tk; ++kt) {
    const uint16_t* tile = w.tile(kt, nt);
    if (kt + kPrefetchTiles < tk) prefetch_tile(tile + kPrefetchTiles * stride, K);
    exl3_tile_words(tile, K, ext);
    const float* x = xs + kt * 32;
#pragma GCC unroll 32
    for (int g = 0; g < 32; ++g) {
      const __m256 v = decode8<CB, kVnni>(ext, K, laneK, 8 * g);
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
  for (int64_t r = 0; r < n; ++r)
    for (int j = 0; j < 8; ++j) {
      yr[r * ldy + nt * 16 + j] = _mm512_mask_reduce_add_ps(0x0F0F, acc[r][j]);
      yr[r * ldy + nt * 16 + j + 8] = _mm512_mask_reduce_add_ps(0xF0F0, acc[r][j]);
    }
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

const VbmiPlan& vbmi_plan(int K) {
  static const auto plans = [] {
    std::vector<VbmiPlan> v;
    for (int k = 1; k <= kExl3MaxK; ++k) v.push_back(make_vbmi_plan(k));
    return v;
  }();
  return plans[size_t(K - 1)];
}

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

template <Exl3Codebook CB, int NR>
MOESRV_VBMI_FN void strip_vbmi(const Exl3Weights& w, const float* xs, int64_t nt, float* yr, int64_t ldy) {
  const int K = w.K, tile_bytes = 32 * K;
  const int64_t tk = w.tiles_k(), stride = w.tiles_n() * 16 * K;
  const uint8_t* end = reinterpret_cast<const uint8_t*>(w.trellis) + w.trellis_bytes();
  const VbmiPlan& p = vbmi_plan(K);
  const __m512i idx0 = _mm512_load_si512(p.idx[0]), ctrl0 = _mm512_load_si512(p.ctrl[0]);
  const __m512i idx_odd = _mm512_load_si512(p.idx[1]), ctrl_odd = _mm512_load_si512(p.ctrl[1]);
  const __m512i idx_even = _mm512_load_si512(p.idx[2]), ctrl_even = _mm512_load_si512(p.ctrl[2]);
  constexpr __mmask64 kLow16 = 0x3333333333333333ull;  // bytes 0-1 of each 32-bit lane
  __m512 acc[NR][8];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 8; ++j) acc[r][j] = _mm512_setzero_ps();
  alignas(64) uint8_t safe[32 * kExl3MaxK + 64] = {};
  for (int64_t kt = 0; kt < tk; ++kt) {
    const uint16_t* tile16 = w.tile(kt, nt);
    if (kt + kPrefetchTiles < tk) prefetch_tile(tile16 + kPrefetchTiles * stride, K);
    const uint8_t* tile = reinterpret_cast<const uint8_t*>(tile16);
    if (tile + tile_bytes + 64 > end) {  // a 64-byte load would pass the array's end
      std::memcpy(safe, tile, size_t(tile_bytes));
      tile = safe;
    }
    uint32_t last;
    std::memcpy(&last, tile + tile_bytes - 4, 4);
    const __m512i src0 = _mm512_mask_set1_epi32(_mm512_loadu_si512(tile), 0x8000, int(last));
    const float* x = xs + kt * 32;
#pragma GCC unroll 16
    for (int m = 0; m < 16; ++m) {
      const __m512i src = m == 0 ? src0 : _mm512_loadu_si512(tile + p.base[m]);
      const __m512i idx = m == 0 ? idx0 : (m % 2 ? idx_odd : idx_even);
      const __m512i ctrl = m == 0 ? ctrl0 : (m % 2 ? ctrl_odd : ctrl_even);
      const __m512i st = _mm512_maskz_multishift_epi64_epi8(kLow16, ctrl, _mm512_permutexvar_epi8(idx, src));
      const __m512 v = codebook16<CB>(st);
      for (int r = 0; r < NR; ++r)
        acc[r][m / 2] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + r * tk * 32 + 16 * (m % 2)), acc[r][m / 2]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 8; ++j) {
      yr[r * ldy + nt * 16 + j] = _mm512_mask_reduce_add_ps(0x0F0F, acc[r][j]);
      yr[r * ldy + nt * 16 + j + 8] = _mm512_mask_reduce_add_ps(0xF0F0, acc[r][j]);
    }
}

// Rows go through in groups whose accumulators fit the registers (2 rows: 16 zmm; 1 row: 8 ymm), each group
// decoding the tiles again: cheaper than accumulators spilled to memory. Each row's sums are the same either way.
template <Exl3Codebook CB>
void strip_simd(Exl3GemvPath path, const Exl3Weights& w, const float* xs, int64_t n, int64_t nt, float* yr,
                int64_t ldy) {
  static const bool avx_vnni = __builtin_cpu_supports("avxvnni");
  const bool vbmi = path == Exl3GemvPath::Avx512Vbmi;
  const int64_t group = vbmi ? 2 : 1, tk = w.tiles_k();
  for (int64_t r0 = 0; r0 < n; r0 += group) {
    const float* x = xs + r0 * tk * 32;
    float* y = yr + r0 * ldy;
    if (!vbmi) {
      if (avx_vnni) strip_avx2<CB, true, 1>(w, x, nt, y, ldy);
      else strip_avx2<CB, false, 1>(w, x, nt, y, ldy);
    } else if (n - r0 >= 2) {
      strip_vbmi<CB, 2>(w, x, nt, y, ldy);
    } else {
      strip_vbmi<CB, 1>(w, x, nt, y, ldy);
    }
  }
}

}  // namespace
MOESRV_AVX512_END
#endif  // MOESRV_HAS_AVX512_PATH

const char* exl3_gemv_path_name(Exl3GemvPath p) {
  switch (p) {
    case Exl3GemvPath::Scalar: return "scalar";
    case Exl3GemvPath::Avx2: return "avx2";
    case Exl3GemvPath::Avx512: return "avx512";
    case Exl3GemvPath::Avx512Vbmi: return "avx512-vbmi";
  }
  return "?";
}

bool exl3_gemv_path_supported(Exl3GemvPath p) {
#if defined(MOESRV_HAS_AVX512_PATH)
  switch (p) {
    case Exl3GemvPath::Scalar: return true;
    case Exl3GemvPath::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Exl3GemvPath::Avx512: return exl3_simd::cpu_has_avx512();
    case Exl3GemvPath::Avx512Vbmi:
      return exl3_simd::cpu_has_avx512() && __builtin_cpu_supports("avx512vbmi") &&
             __builtin_cpu_supports("avx512vnni");
  }
  return false;
#else
  return p == Exl3GemvPath::Scalar;
#endif
}

int64_t exl3_gemv_fast_rows(Exl3GemvPath p) {
  return p == Exl3GemvPath::Scalar ? 0 : p == Exl3GemvPath::Avx2 ? 1 : kExl3GemvMaxRows;
}

Exl3GemvPath exl3_gemv_best_path() {
  static const Exl3GemvPath best = [] {
    for (auto p : {Exl3GemvPath::Avx512Vbmi, Exl3GemvPath::Avx512, Exl3GemvPath::Avx2})
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
    for (auto q : {Exl3GemvPath::Scalar, Exl3GemvPath::Avx2, Exl3GemvPath::Avx512, Exl3GemvPath::Avx512Vbmi})
      if (std::string_view(env) == exl3_gemv_path_name(q) && exl3_gemv_path_supported(q)) chosen = q;
  g_default_path.store(int(chosen), std::memory_order_relaxed);
  return chosen;
}

void exl3_gemv_set_default_path(Exl3GemvPath p) {
  MOESRV_CHECK(exl3_gemv_path_supported(p), "exl3 gemv: path {} is not supported on this CPU", exl3_gemv_path_name(p));
  g_default_path.store(int(p), std::memory_order_relaxed);
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
  if (path == Exl3GemvPath::Avx2 || path == Exl3GemvPath::Avx512Vbmi) {
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
