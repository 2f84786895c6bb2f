// Grouped EXL3 GEMM for prefill experts (exl3_ops.h: exl3_grouped_gemm): the trellis is decoded inside the GEMM's
// main loop, straight into tensor-core B fragments, so a weight tile crosses HBM once per 64- (or 128-) row tile of
// tokens and never exists as an fp16 matrix; one launch covers every expert piece of a wave. Opt-in for now
// (MOESRV_EXL3_GROUPED_GEMM=1): see docs/perf-cuda.md, sixth round.
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "backend/cuda/exl3_device.cuh"
#include "backend/cuda/exl3_ops.h"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

using namespace exl3;

namespace {

constexpr int kCols = 128;      // output columns per block: 8 EXL3 column tiles, one decoded by each warp
constexpr int kStageTiles = 4;  // k-tiles (of 16) per pipeline stage
constexpr int kWarps = 8;
constexpr int kBStageWords = kStageTiles * 8 * 32 * 4;  // W_hat: [k-tile][column tile][lane][4 fragment words]
template <int BM>
constexpr int kAStageHalves = kStageTiles * 16 * BM;  // x: [row][64 k], 16-byte chunks XOR-swizzled by row

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool fill) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(fill ? 16 : 0));
}

struct GemmArgs {
  const Exl3Dev* tab;
  const Exl3GemmTile* tiles;
  const uint16_t* xh;  // fp16 [rows][in_pad]
  float* yr;           // [rows][out_pad]
  int in_pad, out_pad;
};

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

using GemmFn = void (*)(GemmArgs);
#define EXL3_GEMM_K_TABLE(cb, bm)                                                                          \
  {                                                                                                        \
    &grouped_gemm_kernel<1, cb, bm>, &grouped_gemm_kernel<2, cb, bm>, &grouped_gemm_kernel<3, cb, bm>,     \
        &grouped_gemm_kernel<4, cb, bm>, &grouped_gemm_kernel<5, cb, bm>, &grouped_gemm_kernel<6, cb, bm>, \
        &grouped_gemm_kernel<7, cb, bm>, &grouped_gemm_kernel<8, cb, bm>                                   \
  }
const GemmFn kGemm[2][3][8] = {{EXL3_GEMM_K_TABLE(0, 64), EXL3_GEMM_K_TABLE(1, 64), EXL3_GEMM_K_TABLE(2, 64)},
                               {EXL3_GEMM_K_TABLE(0, 128), EXL3_GEMM_K_TABLE(1, 128), EXL3_GEMM_K_TABLE(2, 128)}};
#undef EXL3_GEMM_K_TABLE

}  // namespace

int exl3_gemm_tile_rows() {
  static const int rows = [] {
    const char* v = std::getenv("MOESRV_EXL3_GEMM_ROWS");
    return v && std::atoi(v) == kExl3GemmRows ? kExl3GemmRows : 64;
  }();
  return rows;
}

void exl3_grouped_gemm(const Exl3Dev& shape, const Exl3Dev* tab, const Exl3GemmTile* tiles, int n_tiles,
                       const uint16_t* xh16, float* yr, void* stream, int tile_rows) {
  if (shape.K < 1 || shape.K > 8 || shape.cb < 0 || shape.cb > 2 || shape.in_pad % 128 || shape.out_pad % 128 ||
      (tile_rows != 64 && tile_rows != 128))
    throw std::runtime_error("EXL3 grouped GEMM: unsupported shape, K, codebook or tile rows");
  if (n_tiles <= 0) return;
  const GemmFn fn = kGemm[tile_rows == 128][shape.cb][shape.K - 1];
  const size_t a_words = tile_rows == 128 ? kAStageHalves<128> : kAStageHalves<64>;
  const size_t smem = (a_words + 2 * size_t(kBStageWords) + size_t(kWarps) * kStageTiles * 8 * shape.K) * 4;
  reserve_dynamic_smem(fn, smem, "EXL3 grouped GEMM");
  launch(fn, dim3(shape.out_pad / kCols, n_tiles), kWarps * 32, smem, static_cast<cudaStream_t>(stream),
         GemmArgs{tab, tiles, reinterpret_cast<const uint16_t*>(xh16), yr, shape.in_pad, shape.out_pad});
  EXL3_CHECK(cudaGetLastError());
}

}  // namespace moesrv::cuda
