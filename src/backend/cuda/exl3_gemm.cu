// Grouped EXL3 GEMM for prefill experts (exl3_ops.h: exl3_grouped_gemm): the trellis is decoded inside the GEMM's
// main loop, straight into tensor-core B fragments, so a weight tile crosses HBM once per 64- (or 128-) row tile of
// tokens and never exists as an fp16 matrix; one launch covers every expert piece of a wave. Opt-in for now
// (MOESRV_EXL3_GROUPED_GEMM=1): see docs/perf-cuda.md, sixth round.
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

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
__device__ __forceinline__ void ldmatrix_x4(const void* p, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a));
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

// The warp's staged words into its scratch ws (for decode_tile).
template <int K>
__device__ __forceinline__ void stage_to_scratch(const StageWords<K>& w, uint32_t* ws, int lane) {
  constexpr int kChunks = StageWords<K>::kChunks;
#pragma unroll
  for (int j = 0; j < StageWords<K>::kLoads; ++j) {
    const int c = lane + 32 * j;
    if (c < kStageTiles * kChunks) reinterpret_cast<uint4*>(ws)[c] = w.r[j];
  }
  __syncwarp();
}
// Decodes k-tile u of the scratch into the B fragments of column tile ct: lane l's uint4 holds (rows 2t, 2t+1 |
// 2t+8, 2t+9) of column l/4, then of column l/4 + 8 (t = l % 4), the m16n8k16 layout.
template <int K, int CB>
__device__ __forceinline__ void decode_tile(const uint32_t* ws, const LanePos<K>& pos, int lane, uint32_t* b, int ct,
                                            int u) {
  uint32_t s[8];
  pos.states(ws + u * 8 * K, s);
  const uint4 f = make_uint4(decode_state2<CB>(s[0], s[1]), decode_state2<CB>(s[2], s[3]),
                             decode_state2<CB>(s[4], s[5]), decode_state2<CB>(s[6], s[7]));
  reinterpret_cast<uint4*>(b)[(u * 8 + ct) * 32 + lane] = f;
}
// Decodes the warp's staged words (via its scratch ws) into the B fragments of its column tile, every k-tile.
template <int K, int CB>
__device__ __forceinline__ void decode_stage(const StageWords<K>& w, uint32_t* ws, int lane, uint32_t* b, int ct) {
  stage_to_scratch<K>(w, ws, lane);
  const LanePos<K> pos(lane);
#pragma unroll
  for (int u = 0; u < kStageTiles; ++u) decode_tile<K, CB>(ws, pos, lane, b, ct, u);
  __syncwarp();
}

// Grid (out_pad / 128, tiles), 8 warps: warp w decodes column tile w of the block; for the MMAs the warps form
// WM = BM / 32 rows x WN = 8 / WM columns: warp (wm, wn) owns rows 32 wm .. + 31 and CT = 8 / WN column tiles from
// CT wn (2 x 2 CT m16n8k16 products per k-tile).
// kForm 0: x in two stages, each stage's trellis words loaded one stage ahead and decoded after the stage's products.
// kForm 1 and 2: x in three stages (two ahead), the words two stages ahead in a register ring (their HBM latency
// hidden behind two stages of products); 1 decodes the next stage's k-tile u right after the products of k-tile u
// (decode and tensor-core work of one warp side by side), 2 after all of them.
template <int K, int CB, int BM, int kForm>
__global__ __launch_bounds__(kWarps * 32) void grouped_gemm_kernel(GemmArgs g) {
  constexpr int WM = BM / 32, WN = kWarps / WM, CT = 8 / WN, XS = kForm == 0 ? 2 : 3;  // XS: x stages
  pdl_enter();
  extern __shared__ __align__(16) uint32_t smem[];
  half* as = reinterpret_cast<half*>(smem);          // [XS][kAStageHalves]
  uint32_t* bs = smem + XS * kAStageHalves<BM> / 2;  // [2][kBStageWords]
  uint32_t* wsc = bs + 2 * kBStageWords;             // [warps][kStageTiles * 8K] trellis scratch
  const Exl3GemmTile t = g.tiles[blockIdx.y];
  const Exl3Dev& w = g.tab[t.e];
  const uint4* trellis = static_cast<const uint4*>(w.trellis);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm = warp / WN, wn = warp % WN;
  const int tiles_n = g.out_pad / 16, nt = blockIdx.x * 8 + warp, stages = g.in_pad / (kStageTiles * 16);
  uint32_t* ws = wsc + warp * kStageTiles * 8 * K;
  const LanePos<K> pos(lane);

  StageWords<K> words[2];  // kForm 0: [0] only; else stage s in [s % 2]
  words[0].load(trellis, tiles_n, nt, 0, lane);
  load_x_stage<BM>(g, t, 0, as);
  if constexpr (kForm != 0) {
    if (stages > 1) words[1].load(trellis, tiles_n, nt, 1, lane);
    if (stages > 1) load_x_stage<BM>(g, t, 1, as + kAStageHalves<BM>);
    else asm volatile("cp.async.commit_group;\n" ::);
  }
  decode_stage<K, CB>(words[0], ws, lane, bs, warp);
  if constexpr (kForm != 0) {
    if (stages > 2) words[0].load(trellis, tiles_n, nt, 2, lane);
    asm volatile("cp.async.wait_group 1;\n" ::);
  } else {
    asm volatile("cp.async.wait_all;\n" ::);
  }
  __syncthreads();

  float acc[2][2 * CT][4] = {};
  // One stage; P = st % 2 (compile time, so the register ring is indexed statically).
  auto stage = [&](int st, auto P) {
    constexpr int par = decltype(P)::value;
    const int nxt = par ^ 1;
    const bool more = st + 1 < stages;
    if constexpr (kForm == 0) {
      if (more) {
        words[0].load(trellis, tiles_n, nt, st + 1, lane);
        load_x_stage<BM>(g, t, st + 1, as + nxt * kAStageHalves<BM>);
      }
    } else {
      if (st + 2 < stages) load_x_stage<BM>(g, t, st + 2, as + ((st + 2) % 3) * kAStageHalves<BM>);
      else asm volatile("cp.async.commit_group;\n" ::);
      if (kForm == 1 && more) stage_to_scratch<K>(words[nxt], ws, lane);
    }
    const half* a = as + (kForm == 0 ? par : st % 3) * kAStageHalves<BM>;
    const uint32_t* b = bs + par * kBStageWords;
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
      if (kForm == 1 && more) decode_tile<K, CB>(ws, pos, lane, bs + nxt * kBStageWords, warp, u);
    }
    if constexpr (kForm == 0) {
      if (more) decode_stage<K, CB>(words[0], ws, lane, bs + nxt * kBStageWords, warp);
      asm volatile("cp.async.wait_all;\n" ::);
    } else {
      if (kForm == 2 && more) decode_stage<K, CB>(words[nxt], ws, lane, bs + nxt * kBStageWords, warp);
      if (kForm == 1 && more) __syncwarp();
      if (st + 3 < stages) words[nxt].load(trellis, tiles_n, nt, st + 3, lane);  // its stage st + 1 is decoded
      asm volatile("cp.async.wait_group 1;\n" ::);
    }
    __syncthreads();
  };
  for (int st = 0; st < stages; st += 2) {
    stage(st, std::integral_constant<int, 0>{});
    if (st + 1 < stages) stage(st + 1, std::integral_constant<int, 1>{});
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
#define EXL3_GEMM_K_TABLE(cb, bm, f)                                                                                \
  {                                                                                                                 \
    &grouped_gemm_kernel<1, cb, bm, f>, &grouped_gemm_kernel<2, cb, bm, f>, &grouped_gemm_kernel<3, cb, bm, f>,     \
        &grouped_gemm_kernel<4, cb, bm, f>, &grouped_gemm_kernel<5, cb, bm, f>, &grouped_gemm_kernel<6, cb, bm, f>, \
        &grouped_gemm_kernel<7, cb, bm, f>, &grouped_gemm_kernel<8, cb, bm, f>                                      \
  }
#define EXL3_GEMM_FORM(f)                                                                      \
  {                                                                                            \
    {EXL3_GEMM_K_TABLE(0, 64, f), EXL3_GEMM_K_TABLE(1, 64, f), EXL3_GEMM_K_TABLE(2, 64, f)}, { \
      EXL3_GEMM_K_TABLE(0, 128, f), EXL3_GEMM_K_TABLE(1, 128, f), EXL3_GEMM_K_TABLE(2, 128, f) \
    }                                                                                          \
  }
// [form][128-row tiles][codebook][K - 1]
const GemmFn kGemm[3][2][3][8] = {EXL3_GEMM_FORM(0), EXL3_GEMM_FORM(1), EXL3_GEMM_FORM(2)};
#undef EXL3_GEMM_FORM
#undef EXL3_GEMM_K_TABLE
// MOESRV_EXL3_GEMM_FORM=0|1|2: grouped_gemm_kernel's kForm (default 0; comparison runs), read once.
int gemm_form() {
  static const int f = env_choice("MOESRV_EXL3_GEMM_FORM", 0, 2, 0);
  return f;
}

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
  const int form = gemm_form();
  const GemmFn fn = kGemm[form][tile_rows == 128][shape.cb][shape.K - 1];
  const size_t a_words = (form == 0 ? 2 : 3) * size_t(tile_rows == 128 ? kAStageHalves<128> : kAStageHalves<64>) / 2;
  const size_t smem = (a_words + 2 * size_t(kBStageWords) + size_t(kWarps) * kStageTiles * 8 * shape.K) * 4;
  reserve_dynamic_smem(fn, smem, "EXL3 grouped GEMM");
  launch(fn, dim3(shape.out_pad / kCols, n_tiles), kWarps * 32, smem, static_cast<cudaStream_t>(stream),
         GemmArgs{tab, tiles, reinterpret_cast<const uint16_t*>(xh16), yr, shape.in_pad, shape.out_pad});
  EXL3_CHECK(cudaGetLastError());
}

}  // namespace moesrv::cuda
