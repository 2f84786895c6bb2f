// Grouped EXL3 GEMM for prefill experts (exl3_ops.h: exl3_grouped_gemm): the trellis is decoded inside the GEMM's
// main loop, straight into tensor-core fragments, so a weight tile crosses HBM once per tile of tokens (64-256 rows)
// and never exists as an fp16 matrix; one launch covers every grouped expert piece of a wave (by default the
// pieces of <= 512 rows: CudaEngineOptions::exl3_grouped_rows). Kernels: form 4 (exl3_gemm_wgmma.cu: Hopper's
// warpgroup MMA, the default where the build and the device have it), form 1 (the default elsewhere: register B,
// the output rotation optionally in its epilogue), form 2 (the same at 5 blocks per SM), form 3 (warp pairs sharing
// decoded tiles; slower on an H100) and form 0 (session 12's, B through shared memory); docs/perf-cuda.md, sixth,
// nineteenth, twentieth and twenty-fourth rounds.
#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "backend/cuda/exl3_gemm.cuh"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

using namespace exl3;
using namespace exl3gemm;

namespace {

constexpr int kWarps = 8;
constexpr int kBStageWords = kStageTiles * 8 * 32 * 4;  // W_hat: [k-tile][column tile][lane][4 fragment words]
template <int BM>
constexpr int kAStageHalves = kStageTiles * 16 * BM;  // x: [row][64 k], 16-byte chunks XOR-swizzled by row

// Stage st of the block's x rows (zeros past the tile's rows) into a: BM rows x 8 chunks of 8 halves.
template <int BM>
__device__ __forceinline__ void load_x_stage(const GemmArgs& g, const Exl3GemmTile& t, int st, half* a) {
  for (int i = threadIdx.x; i < BM * 8; i += kWarps * 32) {
    const int r = i >> 3, c = i & 7;
    const bool live = r < t.rows;
    const uint16_t* src = g.xh + size_t(t.row0 + (live ? r : 0)) * g.in_pad + st * kStageTiles * 16 + c * 8;
    cp_async16(a + r * 64 + ((c ^ (r & 7)) << 3), src, live);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// The warp's trellis words of stage st (its column tile, kStageTiles k-tiles) in registers.
template <int K>
struct StageWords {
  static constexpr int kChunks = 2 * K, kLoads = (kStageTiles * kChunks + 31) / 32;
  uint4 r[kLoads];
  __device__ __forceinline__ void load(const uint4* trellis, int tiles_n, int nt, int st, int lane) {
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int c = lane + 32 * j, u = c / kChunks;
      if (c < kStageTiles * kChunks)
        r[j] = __ldg(trellis + (size_t(st * kStageTiles + u) * tiles_n + nt) * kChunks + (c - u * kChunks));
    }
  }
};

// Decodes the warp's staged words (via its scratch ws) into the B fragments of its column tile: per k-tile, lane l's
// uint4 holds (rows 2t, 2t+1 | 2t+8, 2t+9) of column l/4, then of column l/4 + 8 (t = l % 4), the m16n8k16 layout.
template <int K, int CB>
__device__ __forceinline__ void decode_stage(const StageWords<K>& w, uint32_t* ws, int lane, uint32_t* b, int ct) {
  constexpr int kChunks = StageWords<K>::kChunks;
#pragma unroll
  for (int j = 0; j < StageWords<K>::kLoads; ++j) {
    const int c = lane + 32 * j;
    if (c < kStageTiles * kChunks) reinterpret_cast<uint4*>(ws)[c] = w.r[j];
  }
  __syncwarp();
  const LanePos<K> pos(lane);
#pragma unroll
  for (int u = 0; u < kStageTiles; ++u) {
    uint32_t s[8];
    pos.states(ws + u * 8 * K, s);
    const uint4 f = make_uint4(decode_state2<CB>(s[0], s[1]), decode_state2<CB>(s[2], s[3]),
                               decode_state2<CB>(s[4], s[5]), decode_state2<CB>(s[6], s[7]));
    reinterpret_cast<uint4*>(b)[(u * 8 + ct) * 32 + lane] = f;
  }
  __syncwarp();
}

// Grid (out_pad / 128, tiles), 8 warps: warp w decodes column tile w of the block; for the MMAs the warps form
// WM = BM / 32 rows x WN = 8 / WM columns: warp (wm, wn) owns rows 32 wm .. + 31 and CT = 8 / WN column tiles from
// CT wn (2 x 2 CT m16n8k16 products per k-tile).
template <int K, int CB, int BM>
__global__ __launch_bounds__(kWarps * 32) void grouped_gemm_kernel(GemmArgs g) {
  constexpr int WM = BM / 32, WN = kWarps / WM, CT = 8 / WN;
  pdl_enter();
  extern __shared__ __align__(16) uint32_t smem[];
  half* as = reinterpret_cast<half*>(smem);  // [2][kAStageHalves]
  uint32_t* bs = smem + kAStageHalves<BM>;   // [2][kBStageWords] (2 x kAStageHalves halves = kAStageHalves words)
  uint32_t* wsc = bs + 2 * kBStageWords;     // [warps][kStageTiles * 8K] trellis scratch
  const Exl3GemmTile t = g.tiles[blockIdx.y];
  const Exl3Dev& w = g.tab[t.e];
  const uint4* trellis = static_cast<const uint4*>(w.trellis);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm = warp / WN, wn = warp % WN;
  const int tiles_n = g.out_pad / 16, nt = blockIdx.x * 8 + warp, stages = g.in_pad / (kStageTiles * 16);
  uint32_t* ws = wsc + warp * kStageTiles * 8 * K;

  StageWords<K> words;
  words.load(trellis, tiles_n, nt, 0, lane);
  load_x_stage<BM>(g, t, 0, as);
  decode_stage<K, CB>(words, ws, lane, bs, warp);
  asm volatile("cp.async.wait_all;\n" ::);
  __syncthreads();

  float acc[2][2 * CT][4] = {};
  for (int st = 0; st < stages; ++st) {
    const int cur = st & 1, nxt = cur ^ 1;
    const bool more = st + 1 < stages;
    if (more) {
      words.load(trellis, tiles_n, nt, st + 1, lane);
      load_x_stage<BM>(g, t, st + 1, as + nxt * kAStageHalves<BM>);
    }
    const half* a = as + cur * kAStageHalves<BM>;
    const uint32_t* b = bs + cur * kBStageWords;
#pragma unroll
    for (int u = 0; u < kStageTiles; ++u) {
      uint32_t af[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {  // rows 32 wm + 16 m + (lane % 16), k chunk 2u + lane / 16
        const int r = wm * 32 + m * 16 + (lane & 15), c = 2 * u + (lane >> 4);
        ldmatrix_x4(a + r * 64 + ((c ^ (r & 7)) << 3), af[m][0], af[m][1], af[m][2], af[m][3]);
      }
#pragma unroll
      for (int q = 0; q < CT; ++q) {  // column tile CT wn + q: its two n8 halves
        const uint4 f = reinterpret_cast<const uint4*>(b)[(u * 8 + CT * wn + q) * 32 + lane];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          mma_m16n8k16_f16(acc[m][2 * q], af[m][0], af[m][1], af[m][2], af[m][3], f.x, f.y);
          mma_m16n8k16_f16(acc[m][2 * q + 1], af[m][0], af[m][1], af[m][2], af[m][3], f.z, f.w);
        }
      }
    }
    if (more) decode_stage<K, CB>(words, ws, lane, bs + nxt * kBStageWords, warp);
    asm volatile("cp.async.wait_all;\n" ::);
    __syncthreads();
  }
  // acc[m][n][0..1]: row 32 wm + 16 m + lane / 4, columns 2 (lane % 4) + {0, 1} of n8 block n; [2..3]: row + 8
  const int col0 = blockIdx.x * kCols + wn * CT * 16 + 2 * (lane & 3);
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * 32 + m * 16 + (lane >> 2) + 8 * h;
      if (r >= t.rows) continue;
      float* y = g.yr + size_t(t.row0 + r) * g.out_pad + col0;
#pragma unroll
      for (int n = 0; n < 2 * CT; ++n)
        *reinterpret_cast<float2*>(y + (n >> 1) * 16 + (n & 1) * 8) =
            make_float2(acc[m][n][2 * h], acc[m][n][2 * h + 1]);
    }
}

// Form 1 (register B): a warp decodes the B fragments it multiplies itself, so they never pass through shared memory,
// and each of its A fragments (ldmatrix from the staged x rows) serves 2 x 2 products. Block: kRbWarps warps x
// kRbTiles column tiles = 128 output columns, BM rows; the x rows and each warp's trellis words arrive by cp.async
// in a ring of kRbStages stages (kStageTiles k-tiles each); a k-tile's decode sits right before its products, so
// the decode of one warp overlaps the tensor cores of the others.
constexpr int kRbWarps = 4, kRbTiles = 2, kRbStages = 3;
template <int K>
constexpr int kRbWordsPerStage = kStageTiles* kRbTiles * 8 * K;  // one warp's trellis words per stage

template <int BM, int kThreads = kRbWarps * 32>
__device__ __forceinline__ void rb_load_x(const GemmArgs& g, const Exl3GemmTile& t, int st, half* a) {
  for (int i = threadIdx.x; i < BM * 8; i += kThreads) {
    const int r = i >> 3, c = i & 7;
    const bool live = r < t.rows;
    const uint16_t* src = g.xh + size_t(t.row0 + (live ? r : 0)) * g.in_pad + st * kStageTiles * 16 + c * 8;
    cp_async16(a + r * 64 + ((c ^ (r & 7)) << 3), src, live);
  }
}
// The register-B kernels' epilogue: a warp's acc[m][n] (rows r0 + 16 m + lane / 4 (+ 8), block columns c0 + 16 (n / 2)
// + 8 (n % 2) + {0, 1}; c0 includes 2 (lane % 4)) into yr, or with g.y the block's 128 columns (one Hadamard block)
// through shared memory `ot`, a warp per row: rotated, scaled by svh, into y (rotate_out's math).
template <int MT, int kWarps>
__device__ __forceinline__ void store_rb_out(const GemmArgs& g, const Exl3GemmTile& t, const float (&acc)[MT][4][4],
                                             int r0, int c0, float* ot) {
  const int lane = threadIdx.x & 31;
  if (g.y) {
    __syncthreads();  // every warp is done with the stages
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + m * 16 + (lane >> 2) + 8 * h;
#pragma unroll
        for (int n = 0; n < 4; ++n)
          *reinterpret_cast<float2*>(ot + r * kOutLd + c0 + (n >> 1) * 16 + (n & 1) * 8) =
              make_float2(acc[m][n][2 * h], acc[m][n][2 * h + 1]);
      }
    __syncthreads();
    store_out_rows(g, t, ot, kWarps);
    return;
  }
  const int col0 = blockIdx.x * kCols + c0;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + m * 16 + (lane >> 2) + 8 * h;
      if (r >= t.rows) continue;
      float* y = g.yr + size_t(t.row0 + r) * g.out_pad + col0;
#pragma unroll
      for (int n = 0; n < 4; ++n)
        *reinterpret_cast<float2*>(y + (n >> 1) * 16 + (n & 1) * 8) =
            make_float2(acc[m][n][2 * h], acc[m][n][2 * h + 1]);
    }
}

// MINB: blocks per multiprocessor the registers must allow with 64-row tiles (4: 128 registers; 5 (form 2): 96, a few
// spilled at K=3). 128-row tiles hold twice the accumulators (~200 registers): 2 blocks, whatever MINB says.
template <int K, int CB, int BM, int MINB>
__global__ __launch_bounds__(kRbWarps * 32, BM == 64 ? MINB : 2) void grouped_gemm_rb_kernel(GemmArgs g) {
  constexpr int MT = BM / 16;  // m16 row blocks
  pdl_enter();
  extern __shared__ __align__(16) uint32_t smem[];
  half* as = reinterpret_cast<half*>(smem);                  // [kRbStages][kAStageHalves]
  uint32_t* wsm = smem + kRbStages * kAStageHalves<BM> / 2;  // [kRbStages][warps][words per stage]
  const Exl3GemmTile t = g.tiles[blockIdx.y];
  const uint4* trellis = static_cast<const uint4*>(g.tab[t.e].trellis);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tiles_n = g.out_pad / 16, nt0 = (blockIdx.x * kRbWarps + warp) * kRbTiles;
  const int stages = g.in_pad / (kStageTiles * 16);
  auto words_at = [&](int st) { return wsm + ((st % kRbStages) * kRbWarps + warp) * kRbWordsPerStage<K>; };
  auto load_stage = [&](int st) {
    if (st < stages) {
      rb_load_x<BM>(g, t, st, as + (st % kRbStages) * kAStageHalves<BM>);
      load_stage_words<K, kRbTiles>(trellis, tiles_n, nt0, st, lane, words_at(st));
    }
    asm volatile("cp.async.commit_group;\n" ::);  // (empty past the end: the group count stays uniform)
  };
  for (int st = 0; st < kRbStages - 1; ++st) load_stage(st);
  const LanePos<K> pos(lane);
  float acc[MT][2 * kRbTiles][4] = {};
  for (int st = 0; st < stages; ++st) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kRbStages - 2));
    __syncthreads();  // stage st is in place for every warp; stage st - 1's buffers are free
    load_stage(st + kRbStages - 1);
    const half* a = as + (st % kRbStages) * kAStageHalves<BM>;
    const uint32_t* ws = words_at(st);
#pragma unroll
    for (int u = 0; u < kStageTiles; ++u) {
      uint4 f[kRbTiles];
#pragma unroll
      for (int q = 0; q < kRbTiles; ++q) {
        uint32_t s[8];
        pos.states(ws + (u * kRbTiles + q) * 8 * K, s);
        f[q] = make_uint4(decode_state2<CB>(s[0], s[1]), decode_state2<CB>(s[2], s[3]), decode_state2<CB>(s[4], s[5]),
                          decode_state2<CB>(s[6], s[7]));
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {  // rows 16 m + (lane % 16), k chunk 2u + lane / 16
        const int r = m * 16 + (lane & 15), c = 2 * u + (lane >> 4);
        uint32_t af[4];
        ldmatrix_x4(a + r * 64 + ((c ^ (r & 7)) << 3), af[0], af[1], af[2], af[3]);
#pragma unroll
        for (int q = 0; q < kRbTiles; ++q) {
          mma_m16n8k16_f16(acc[m][2 * q], af[0], af[1], af[2], af[3], f[q].x, f[q].y);
          mma_m16n8k16_f16(acc[m][2 * q + 1], af[0], af[1], af[2], af[3], f[q].z, f[q].w);
        }
      }
    }
  }
  asm volatile("cp.async.wait_all;\n" ::);
  store_rb_out<MT, kRbWarps>(g, t, acc, 0, warp * kRbTiles * 16 + 2 * (lane & 3), reinterpret_cast<float*>(smem));
}

// Form 3 (paired register B, 128-row tiles only): 8 warps as 4 pairs; the pair of columns tiles 2p, 2p + 1 is
// shared by warps p (rows 0-63) and p + 4 (rows 64-127). Each warp decodes one of the pair's two tiles per k-tile
// (half of form 1's decode per product) and hands its fragments to its partner through shared memory (a named
// barrier per pair); each warp then multiplies its 64 rows by both tiles, as in form 1.
constexpr int kPairWarps = 8, kPairRows = 128;
constexpr size_t kPairBWords = size_t(kStageTiles) * 8 * 32 * 4;  // [k-tile][column tile][lane] uint4

__device__ __forceinline__ void pair_barrier(int pair) {
  asm volatile("bar.sync %0, 64;\n" ::"r"(1 + pair) : "memory");
}

template <int K, int CB>
__global__ __launch_bounds__(kPairWarps * 32) void grouped_gemm_pair_kernel(GemmArgs g) {
  constexpr int BM = kPairRows, MT = 4;        // each warp: 4 m16 row blocks
  constexpr int kWords = kStageTiles * 8 * K;  // one warp's trellis words per stage (one column tile)
  pdl_enter();
  extern __shared__ __align__(16) uint32_t smem[];
  half* as = reinterpret_cast<half*>(smem);                                     // [kRbStages][kAStageHalves<128>]
  uint32_t* wsm = smem + kRbStages * kAStageHalves<BM> / 2;                     // [kRbStages][warps][kWords]
  uint4* bs = reinterpret_cast<uint4*>(wsm + kRbStages * kPairWarps * kWords);  // [k-tile][tile][lane]
  const Exl3GemmTile t = g.tiles[blockIdx.y];
  const uint4* trellis = static_cast<const uint4*>(g.tab[t.e].trellis);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, pair = warp & 3, half_ = warp >> 2;
  const int tiles_n = g.out_pad / 16, ct0 = 2 * pair, mine = ct0 + half_;  // column tiles in the block
  const int nt_mine = blockIdx.x * 8 + mine, stages = g.in_pad / (kStageTiles * 16);
  auto words_at = [&](int st) { return wsm + ((st % kRbStages) * kPairWarps + warp) * kWords; };
  auto load_stage = [&](int st) {
    if (st < stages) {
      rb_load_x<BM, kPairWarps * 32>(g, t, st, as + (st % kRbStages) * kAStageHalves<BM>);
      load_stage_words<K, 1>(trellis, tiles_n, nt_mine, st, lane, words_at(st));
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  for (int st = 0; st < kRbStages - 1; ++st) load_stage(st);
  const LanePos<K> pos(lane);
  float acc[MT][4][4] = {};
  for (int st = 0; st < stages; ++st) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kRbStages - 2));
    __syncthreads();  // stage st in place; the previous stage's fragments read by both warps of every pair
    load_stage(st + kRbStages - 1);
    const uint32_t* ws = words_at(st);
#pragma unroll
    for (int u = 0; u < kStageTiles; ++u) {
      uint32_t sv[8];
      pos.states(ws + u * 8 * K, sv);
      bs[(u * 8 + mine) * 32 + lane] = make_uint4(decode_state2<CB>(sv[0], sv[1]), decode_state2<CB>(sv[2], sv[3]),
                                                  decode_state2<CB>(sv[4], sv[5]), decode_state2<CB>(sv[6], sv[7]));
    }
    pair_barrier(pair);  // both tiles of the pair decoded
    const half* a = as + (st % kRbStages) * kAStageHalves<BM>;
#pragma unroll
    for (int u = 0; u < kStageTiles; ++u) {
      const uint4 f[2] = {bs[(u * 8 + ct0) * 32 + lane], bs[(u * 8 + ct0 + 1) * 32 + lane]};
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const int r = half_ * 64 + m * 16 + (lane & 15), c = 2 * u + (lane >> 4);
        uint32_t af[4];
        ldmatrix_x4(a + r * 64 + ((c ^ (r & 7)) << 3), af[0], af[1], af[2], af[3]);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          mma_m16n8k16_f16(acc[m][2 * q], af[0], af[1], af[2], af[3], f[q].x, f[q].y);
          mma_m16n8k16_f16(acc[m][2 * q + 1], af[0], af[1], af[2], af[3], f[q].z, f[q].w);
        }
      }
    }
  }
  asm volatile("cp.async.wait_all;\n" ::);
  store_rb_out<MT, kPairWarps>(g, t, acc, half_ * 64, ct0 * 16 + 2 * (lane & 3), reinterpret_cast<float*>(smem));
}

using GemmFn = void (*)(GemmArgs);
// [form][128-row tiles][codebook][K - 1]; form 2 = the register-B kernel at 5 blocks per multiprocessor
#define EXL3_GEMM_K_TABLE(kernel, cb, bm, ...)                                                          \
  {                                                                                                     \
    &kernel<1, cb, bm __VA_ARGS__>, &kernel<2, cb, bm __VA_ARGS__>, &kernel<3, cb, bm __VA_ARGS__>,     \
        &kernel<4, cb, bm __VA_ARGS__>, &kernel<5, cb, bm __VA_ARGS__>, &kernel<6, cb, bm __VA_ARGS__>, \
        &kernel<7, cb, bm __VA_ARGS__>, &kernel<8, cb, bm __VA_ARGS__>                                  \
  }
#define EXL3_GEMM_FORM_TABLE(kernel, ...)                                                             \
  {                                                                                                   \
    {EXL3_GEMM_K_TABLE(kernel, 0, 64, __VA_ARGS__), EXL3_GEMM_K_TABLE(kernel, 1, 64, __VA_ARGS__),    \
     EXL3_GEMM_K_TABLE(kernel, 2, 64, __VA_ARGS__)},                                                  \
    {                                                                                                 \
      EXL3_GEMM_K_TABLE(kernel, 0, 128, __VA_ARGS__), EXL3_GEMM_K_TABLE(kernel, 1, 128, __VA_ARGS__), \
          EXL3_GEMM_K_TABLE(kernel, 2, 128, __VA_ARGS__)                                              \
    }                                                                                                 \
  }
const GemmFn kGemm[3][2][3][8] = {EXL3_GEMM_FORM_TABLE(grouped_gemm_kernel),
                                  EXL3_GEMM_FORM_TABLE(grouped_gemm_rb_kernel, , 4),
                                  EXL3_GEMM_FORM_TABLE(grouped_gemm_rb_kernel, , 5)};
#undef EXL3_GEMM_FORM_TABLE
#undef EXL3_GEMM_K_TABLE
#define EXL3_GEMM_PAIR_TABLE(cb)                                                                              \
  {                                                                                                           \
    &grouped_gemm_pair_kernel<1, cb>, &grouped_gemm_pair_kernel<2, cb>, &grouped_gemm_pair_kernel<3, cb>,     \
        &grouped_gemm_pair_kernel<4, cb>, &grouped_gemm_pair_kernel<5, cb>, &grouped_gemm_pair_kernel<6, cb>, \
        &grouped_gemm_pair_kernel<7, cb>, &grouped_gemm_pair_kernel<8, cb>                                    \
  }
const GemmFn kGemmPair[3][8] = {EXL3_GEMM_PAIR_TABLE(0), EXL3_GEMM_PAIR_TABLE(1), EXL3_GEMM_PAIR_TABLE(2)};
#undef EXL3_GEMM_PAIR_TABLE

}  // namespace

int exl3_gemm_form_rows(int form) {
  static const int env = [] {
    const char* v = std::getenv("MOESRV_EXL3_GEMM_ROWS");
    return v ? std::atoi(v) : 0;
  }();
  if (form == 4) return env == 256 ? 256 : 128;  // (256: one block per SM; measured so far: 128)
  return form == 3 || env == 128 ? 128 : 64;
}

int exl3_gemm_tile_rows() { return exl3_gemm_form_rows(exl3_gemm_form()); }

int exl3_gemm_form() {
  static const int env = [] {
    const char* v = std::getenv("MOESRV_EXL3_GEMM_FORM");
    return v && v[0] >= '0' && v[0] <= '4' && !v[1] ? v[0] - '0' : 4;  // default: form 4 where it runs
  }();
  return env == 4 && !exl3_gemm_wgmma_built() ? 1 : env;  // (per device: a mixed host falls back where needed)
}

void exl3_grouped_gemm(const Exl3Dev& shape, const Exl3Dev* tab, const Exl3GemmTile* tiles, int n_tiles,
                       const uint16_t* xh16, float* yr, void* stream, int tile_rows, int form, float* y, int64_t y_ld) {
  if (form < 0) form = exl3_gemm_form();
  if (shape.K < 1 || shape.K > 8 || shape.cb < 0 || shape.cb > 2 || shape.in_pad % 128 || shape.out_pad % 128 ||
      (tile_rows != 64 && tile_rows != 128 && (tile_rows != 256 || form != 4)))
    throw std::runtime_error("EXL3 grouped GEMM: unsupported shape, K, codebook or tile rows");
  if (n_tiles <= 0) return;
  if (form < 0 || form > 4) throw std::runtime_error("EXL3 grouped GEMM: unknown form");
  if (form == 4) {  // warpgroup MMA: 128- or 256-row tiles
    exl3_grouped_gemm_wgmma(shape, tab, tiles, n_tiles, tile_rows, xh16, yr, stream, y, y_ld);
    return;
  }
  if (form == 3) {  // paired register B: 128-row tiles
    if (tile_rows != kPairRows) throw std::runtime_error("EXL3 grouped GEMM form 3: needs 128-row tiles");
    const size_t stages = (kRbStages * size_t(kAStageHalves<kPairRows>) / 2 +
                           size_t(kRbStages) * kPairWarps * kStageTiles * 8 * shape.K + kPairBWords) *
                          4;
    const size_t smem = y ? std::max(stages, size_t(kPairRows) * kOutLd * 4) : stages;
    const GemmFn fn = kGemmPair[shape.cb][shape.K - 1];
    reserve_dynamic_smem(fn, smem, "EXL3 grouped GEMM");
    launch(fn, dim3(shape.out_pad / kCols, n_tiles), kPairWarps * 32, smem, static_cast<cudaStream_t>(stream),
           GemmArgs{tab, tiles, reinterpret_cast<const uint16_t*>(xh16), yr, shape.in_pad, shape.out_pad, y, y_ld,
                    shape.out});
    EXL3_CHECK(cudaGetLastError());
    return;
  }
  if (y && form == 0) throw std::runtime_error("EXL3 grouped GEMM: the output rotation needs the register-B kernel");
  const GemmFn fn = kGemm[form][tile_rows == 128][shape.cb][shape.K - 1];
  const size_t a_words = (tile_rows == 128 ? kAStageHalves<128> : kAStageHalves<64>) / 2;
  const size_t rb_stages =
      (kRbStages * a_words + size_t(kRbStages) * kRbWarps * kStageTiles * kRbTiles * 8 * shape.K) * 4;
  const size_t smem = form != 0
                          ? (y ? std::max(rb_stages, size_t(tile_rows) * kOutLd * 4) : rb_stages)
                          : (2 * a_words + 2 * size_t(kBStageWords) + size_t(kWarps) * kStageTiles * 8 * shape.K) * 4;
  reserve_dynamic_smem(fn, smem, "EXL3 grouped GEMM");
  launch(fn, dim3(shape.out_pad / kCols, n_tiles), (form != 0 ? kRbWarps : kWarps) * 32, smem,
         static_cast<cudaStream_t>(stream),
         GemmArgs{tab, tiles, reinterpret_cast<const uint16_t*>(xh16), yr, shape.in_pad, shape.out_pad, y, y_ld,
                  shape.out});
  EXL3_CHECK(cudaGetLastError());
}

}  // namespace moesrv::cuda
