// Form 4 of the grouped EXL3 GEMM (exl3_ops.h: exl3_grouped_gemm), on Hopper's warpgroup MMA: the weights are the
// A operand and the tokens the B operand (D[output column][row] = W_hat^T x^T). Each warp decodes the trellis of one
// 16-column tile straight into wgmma's register A fragment (the m16n8k16 layout, which the decode already makes for
// mma.sync's B), and one m64nNk16 per warpgroup multiplies it by the tile's N token rows (64, 128, 192 or 256: the
// smallest that holds them) that cp.async staged in shared memory (K-major, 128-byte swizzle). So a decoded weight
// serves up to R rows (form 1: 64, through mma.sync), and the tensor cores rather than the decode set the pace.
// Block: 2 warpgroups (128 output columns, one Hadamard block) x one tile of <= R rows (R = 128: two blocks per
// multiprocessor; R = 256: one, the decode per MMA halved); the output rotation optionally in the epilogue. Needs
// sm_90a (the build's CUDA architectures 90a); elsewhere exl3_gemm_wgmma_built() is false.
#include <algorithm>
#include <atomic>
#include <stdexcept>

#include "backend/cuda/exl3_gemm.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/wgmma.cuh"

namespace moesrv::cuda {

using namespace exl3;
using namespace exl3gemm;

namespace {

constexpr int kWgWarps = 8;                   // 2 warpgroups; warp w decodes column tile w of the block
constexpr int kWgStages = 4;                  // ring of stages (x rows + trellis words)
[[maybe_unused]] constexpr int kWgAhead = 2;  // stages loaded ahead: a stage's buffers are reused 2 stages
                                              // after its last MMA was waited for
template <int R>
constexpr int kWgXBytes = R* kStageTiles * 16 * 2;  // one stage's x rows: R rows x 64 halves
template <int K>
constexpr int kWgWords = kStageTiles * 8 * K;  // one warp's trellis words per stage (one column tile)

template <int K, int R>
constexpr size_t wg_smem_bytes() {  // 1 KB for the alignment of the swizzled stages
  return 1024 + std::max(size_t(kWgStages) * (kWgXBytes<R> + kWgWarps * kWgWords<K> * 4), size_t(R) * kOutLd * 4);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// One tile of t.rows <= N rows: the main loop and the epilogue. acc[4 j + i] (wgmma.cuh): output column 16 w + g
// (+ 8 for i >= 2) of the block (w the block's warp, g = lane / 4), row 8 j + 2 (lane % 4) + i % 2 of the tile.
template <int K, int CB, int R, int N>
__device__ __forceinline__ void wg_tile(const GemmArgs& g, const Exl3GemmTile& t, uint8_t* xs, uint32_t* wsm) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tiles_n = g.out_pad / 16, stages = g.in_pad / (kStageTiles * 16);
  // x: thread i stages chunk i % 8 of rows i / 8 + 32 j (one swizzled destination column for all its rows)
  const int xc = threadIdx.x & 7, xr = threadIdx.x >> 3;
  const uint16_t* xsrc = g.xh + size_t(t.row0) * g.in_pad + xc * 8;
  const int xdst = xr * 128 + ((xc ^ (xr & 7)) << 4);
  // trellis words: lane's chunks c = lane + 32 j of a stage ([k-tile][2K uint4]); per stage they move by
  // kStageTiles k-tiles
  constexpr int kChunks = 2 * K, kWordLoads = (kStageTiles * kChunks + 31) / 32;
  const uint4* wsrc = static_cast<const uint4*>(g.tab[t.e].trellis) + size_t(blockIdx.x * kWgWarps + warp) * kChunks;
  const size_t wstage = size_t(kStageTiles) * tiles_n * kChunks;
  int woff[kWordLoads];
#pragma unroll
  for (int j = 0; j < kWordLoads; ++j) {
    const int c = lane + 32 * j, u = c / kChunks;
    woff[j] = u * tiles_n * kChunks + (c - u * kChunks);
  }
  auto words_at = [&](int st) { return wsm + ((st % kWgStages) * kWgWarps + warp) * kWgWords<K>; };
  auto load_stage = [&](int st) {
    if (st < stages) {
      uint8_t* x = xs + (st % kWgStages) * kWgXBytes<R> + xdst;
#pragma unroll
      for (int j = 0; j < N / 32; ++j) {
        const int r = xr + 32 * j;
        const bool live = r < t.rows;
        cp_async16(x + j * 32 * 128, xsrc + size_t(live ? r : 0) * g.in_pad + st * kStageTiles * 16, live);
      }
      uint32_t* w = words_at(st);
#pragma unroll
      for (int j = 0; j < kWordLoads; ++j)
        if (lane + 32 * j < kStageTiles * kChunks)
          cp_async16(w + 4 * (lane + 32 * j), wsrc + st * wstage + woff[j], true);
    }
    asm volatile("cp.async.commit_group;\n" ::);  // (empty past the end: the group count stays uniform)
  };
  for (int st = 0; st < kWgAhead; ++st) load_stage(st);
  const LanePos<K> pos(lane);
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  uint32_t a[2][4];
  const uint32_t xs_addr = static_cast<uint32_t>(__cvta_generic_to_shared(xs));
  for (int st = 0; st < stages; ++st) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kWgAhead - 1));
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // this thread's x rows visible to the wgmma
    __syncthreads();  // stage st in place; stage st - 2's MMAs done in both warpgroups (wait below)
    load_stage(st + kWgAhead);
    const uint32_t* ws = words_at(st);
    const uint32_t x_addr = xs_addr + (st % kWgStages) * kWgXBytes<R>;
#pragma unroll
    for (int u = 0; u < kStageTiles; ++u) {
      uint32_t s[8];
      pos.states(ws + u * 8 * K, s);
      // form 1's B fragments ((k 2t, 2t+1 | 2t+8, 2t+9) of columns g, then g + 8) as the A fragment of rows (output
      // columns) g, g + 8
      uint32_t(&f)[4] = a[u & 1];
      f[0] = decode_state2<CB>(s[0], s[1]);
      f[1] = decode_state2<CB>(s[4], s[5]);
      f[2] = decode_state2<CB>(s[2], s[3]);
      f[3] = decode_state2<CB>(s[6], s[7]);
      wgmma::fence();
      wgmma::fence_acc(acc);
      wgmma::Mma<N>::mma(acc, f, wgmma::sw128_desc(x_addr + u * 32));
      wgmma::commit();
      wgmma::wait<1>();  // the MMA before this one is done: its A registers may be decoded into again
    }
  }
  wgmma::wait<0>();
  wgmma::fence_acc(acc);
  asm volatile("cp.async.wait_all;\n" ::);
  __syncthreads();  // every warp is done with the stages: the output rows reuse them
  float* ot = reinterpret_cast<float*>(xs);
  const int c = 16 * warp + (lane >> 2), r0 = 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    float* o = ot + (8 * j + r0) * kOutLd + c;
    o[0] = acc[4 * j], o[kOutLd] = acc[4 * j + 1], o[8] = acc[4 * j + 2], o[kOutLd + 8] = acc[4 * j + 3];
  }
  __syncthreads();
  store_out_rows(g, t, ot, kWgWarps);
}
#endif

// Grid (out_pad / 128, tiles), 256 threads; a tile takes the smallest of the m64nN MMAs (N = 64, 128, 192, 256 up
// to R) that holds its rows.
template <int K, int CB, int R>
__global__ __launch_bounds__(kWgWarps * 32, R == 128 ? 2 : 1) void grouped_gemm_wgmma_kernel(GemmArgs g) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl_enter();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* xs = smem_raw + (((base + 1023) & ~1023u) - base);                  // [kWgStages][R rows][128 bytes]
  uint32_t* wsm = reinterpret_cast<uint32_t*>(xs + kWgStages * kWgXBytes<R>);  // [kWgStages][warps][words]
  const Exl3GemmTile t = g.tiles[blockIdx.y];
  if (t.rows <= 64) wg_tile<K, CB, R, 64>(g, t, xs, wsm);
  else if (R == 128 || t.rows <= 128) wg_tile<K, CB, R, 128>(g, t, xs, wsm);
  else if constexpr (R == 256) {
    if (t.rows <= 192) wg_tile<K, CB, R, 192>(g, t, xs, wsm);
    else wg_tile<K, CB, R, 256>(g, t, xs, wsm);
  }
#endif
}

__global__ void wgmma_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

using GemmFn = void (*)(GemmArgs);
#define EXL3_GEMM_WG_TABLE(cb, r)                                                                                     \
  {                                                                                                                   \
    &grouped_gemm_wgmma_kernel<1, cb, r>, &grouped_gemm_wgmma_kernel<2, cb, r>, &grouped_gemm_wgmma_kernel<3, cb, r>, \
        &grouped_gemm_wgmma_kernel<4, cb, r>, &grouped_gemm_wgmma_kernel<5, cb, r>,                                   \
        &grouped_gemm_wgmma_kernel<6, cb, r>, &grouped_gemm_wgmma_kernel<7, cb, r>,                                   \
        &grouped_gemm_wgmma_kernel<8, cb, r>                                                                          \
  }
const GemmFn kGemmWg[2][3][8] = {{EXL3_GEMM_WG_TABLE(0, 128), EXL3_GEMM_WG_TABLE(1, 128), EXL3_GEMM_WG_TABLE(2, 128)},
                                 {EXL3_GEMM_WG_TABLE(0, 256), EXL3_GEMM_WG_TABLE(1, 256), EXL3_GEMM_WG_TABLE(2, 256)}};
#undef EXL3_GEMM_WG_TABLE
template <int R>
constexpr size_t wg_smem(int K) {
  constexpr size_t s[8] = {wg_smem_bytes<1, R>(), wg_smem_bytes<2, R>(), wg_smem_bytes<3, R>(), wg_smem_bytes<4, R>(),
                           wg_smem_bytes<5, R>(), wg_smem_bytes<6, R>(), wg_smem_bytes<7, R>(), wg_smem_bytes<8, R>()};
  return s[K - 1];
}

}  // namespace

bool exl3_gemm_wgmma_built() {
  static std::atomic<int> known[64];  // per device: 0 = not probed yet, 1 = runs form 4, -1 = does not
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  int k = known[dev].load(std::memory_order_relaxed);
  if (k == 0) {  // (the engines probe while they set up, outside any graph capture)
    int major = 0, h = 0;
    int* d = nullptr;
    const bool hopper =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major == 9;
    if (hopper && cudaMalloc(&d, sizeof(int)) == cudaSuccess) {
      wgmma_probe_kernel<<<1, 1>>>(d);
      if (cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) h = 0;
      cudaFree(d);
    }
    (void)cudaGetLastError();
    k = h == 1 ? 1 : -1;
    known[dev].store(k, std::memory_order_relaxed);
  }
  return k == 1;
}

void exl3_grouped_gemm_wgmma(const Exl3Dev& shape, const Exl3Dev* tab, const Exl3GemmTile* tiles, int n_tiles,
                             int tile_rows, const uint16_t* xh16, float* yr, void* stream, float* y, int64_t y_ld) {
  if (!exl3_gemm_wgmma_built()) throw std::runtime_error("EXL3 grouped GEMM form 4: needs an sm_90a build and device");
  if (tile_rows != 128 && tile_rows != 256)
    throw std::runtime_error("EXL3 grouped GEMM form 4: needs tiles of 128 or 256 rows");
  const bool tall = tile_rows == 256;
  const GemmFn fn = kGemmWg[tall][shape.cb][shape.K - 1];
  const size_t smem = tall ? wg_smem<256>(shape.K) : wg_smem<128>(shape.K);
  reserve_dynamic_smem(fn, smem, "EXL3 grouped GEMM form 4");
  prefer_max_shared_carveout(fn);  // (two blocks per multiprocessor with 128-row tiles)
  launch(fn, dim3(shape.out_pad / kCols, n_tiles), kWgWarps * 32, smem, static_cast<cudaStream_t>(stream),
         GemmArgs{tab, tiles, xh16, yr, shape.in_pad, shape.out_pad, y, y_ld, shape.out});
  EXL3_CHECK(cudaGetLastError());
}

}  // namespace moesrv::cuda
