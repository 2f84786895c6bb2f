// Form 4 of the grouped EXL3 GEMM (exl3_ops.h: exl3_grouped_gemm), on Hopper's warpgroup MMA: the weights are the
// A operand and the tokens the B operand (D[output column][row] = W_hat^T x^T). Each warp decodes the trellis of one
// 16-column tile straight into wgmma's register A fragment (the m16n8k16 layout, which the decode already makes for
// mma.sync's B), and one m64nNk16 per warpgroup multiplies it by N = 64 or 128 token rows that cp.async staged in
// shared memory (K-major, 128-byte swizzle). So a decoded weight serves up to 128 rows (form 1: 64, through 16
// mma.sync per 16 weights a lane), and the tensor cores, not the decode, should set the pace. Block: 2 warpgroups
// (128 output columns, one Hadamard block) x one tile of <= 128 rows; the output rotation optionally in the
// epilogue. Needs sm_90a (the build's CUDA architectures 90a); elsewhere exl3_gemm_wgmma_built() is false.
#include <algorithm>
#include <stdexcept>

#include "backend/cuda/exl3_gemm.cuh"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

using namespace exl3;
using namespace exl3gemm;

namespace {

constexpr int kWgWarps = 8;   // 2 warpgroups, warp w decodes column tile w of the block
constexpr int kWgRows = 128;  // the largest tile
constexpr int kWgStages = 4;  // ring of stages (x rows + trellis words)
[[maybe_unused]] constexpr int kWgAhead =
    2;  // stages loaded ahead: a stage's buffers are reused 2 stages after its last wgmma
constexpr int kWgXBytes = kWgRows * kStageTiles * 16 * 2;  // one stage's x rows: 128 rows x 64 halves (16 KB)
template <int K>
constexpr int kWgWords = kStageTiles * 8 * K;  // one warp's trellis words per stage (one column tile)

template <int K>
constexpr size_t wg_smem_bytes() {  // 1 KB for the alignment of the swizzled stages
  return 1024 + std::max(size_t(kWgStages) * (kWgXBytes + kWgWarps * kWgWords<K> * 4), size_t(kWgRows) * kOutLd * 4);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of the accumulators across the asynchronous MMAs.
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte swizzle (16-byte chunk c of row r at
// c ^ (r % 8)), 8-row groups 1,024 bytes apart; saddr is the k16 step's start (stage base + 32 bytes per step).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr) {
  return uint64_t((saddr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

template <int N>
struct Wgmma;
template <>
struct Wgmma<64> {  // D[64][64] += A[64][16] (registers) . B[16][64] (shared memory, K-major, 128-byte swizzle)
  static __device__ __forceinline__ void mma(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, "
        "%34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
          "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
  }
};
template <>
struct Wgmma<128> {  // D[64][128] += A[64][16] (registers) . B[16][128] (shared memory, K-major, 128-byte swizzle)
  static __device__ __forceinline__ void mma(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, "
        "%35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, "
        "%57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
          "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
          "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
          "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
          "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
  }
};

// One tile of t.rows <= N rows: the main loop and the epilogue. acc[4 j + i]: D[16 wi + g + 8 (i / 2)][8 j + 2 t +
// i % 2] of the warp's warpgroup (wi its warp there, g = lane / 4, t = lane % 4): output column 16 w + g (+ 8) of the
// block (w the block's warp), row 8 j + 2 t (+ 1) of the tile.
template <int K, int CB, int N>
__device__ __forceinline__ void wg_tile(const GemmArgs& g, const Exl3GemmTile& t, uint8_t* xs, uint32_t* wsm) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint4* trellis = static_cast<const uint4*>(g.tab[t.e].trellis);
  const int tiles_n = g.out_pad / 16, nt = blockIdx.x * kWgWarps + warp, stages = g.in_pad / (kStageTiles * 16);
  const uint32_t xs_addr = static_cast<uint32_t>(__cvta_generic_to_shared(xs));
  auto words_at = [&](int st) { return wsm + ((st % kWgStages) * kWgWarps + warp) * kWgWords<K>; };
  auto load_stage = [&](int st) {
    if (st < stages) {
      uint8_t* x = xs + (st % kWgStages) * kWgXBytes;
      for (int i = threadIdx.x; i < N * 8; i += kWgWarps * 32) {
        const int r = i >> 3, c = i & 7;
        const bool live = r < t.rows;
        cp_async16(x + r * 128 + ((c ^ (r & 7)) << 4),
                   g.xh + size_t(t.row0 + (live ? r : 0)) * g.in_pad + st * kStageTiles * 16 + c * 8, live);
      }
      load_stage_words<K, 1>(trellis, tiles_n, nt, st, lane, words_at(st));
    }
    asm volatile("cp.async.commit_group;\n" ::);  // (empty past the end: the group count stays uniform)
  };
  for (int st = 0; st < kWgAhead; ++st) load_stage(st);
  const LanePos<K> pos(lane);
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  uint32_t a[2][4];
  for (int st = 0; st < stages; ++st) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kWgAhead - 1));
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // this thread's x rows visible to the wgmma
    __syncthreads();  // stage st in place; stage st - 2's MMAs done in both warpgroups (wait_group below)
    load_stage(st + kWgAhead);
    const uint32_t* ws = words_at(st);
    const uint32_t x_addr = xs_addr + (st % kWgStages) * kWgXBytes;
#pragma unroll
    for (int u = 0; u < kStageTiles; ++u) {
      uint32_t s[8];
      pos.states(ws + u * 8 * K, s);
      // the B fragments of form 1 ((k 2t, 2t+1 | 2t+8, 2t+9) of columns g, then g + 8) as the A fragment of rows
      // (columns) g, g + 8
      uint32_t(&f)[4] = a[u & 1];
      f[0] = decode_state2<CB>(s[0], s[1]);
      f[1] = decode_state2<CB>(s[4], s[5]);
      f[2] = decode_state2<CB>(s[2], s[3]);
      f[3] = decode_state2<CB>(s[6], s[7]);
      wgmma_fence();
      fence_acc(acc);
      Wgmma<N>::mma(acc, f, sw128_desc(x_addr + u * 32));
      wgmma_commit();
      wgmma_wait<1>();  // the MMA before this one is done: its A registers may be decoded into again
    }
  }
  wgmma_wait<0>();
  fence_acc(acc);
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

// Grid (out_pad / 128, tiles), 256 threads; rows <= 64 take the m64n64 MMAs, longer tiles m64n128.
template <int K, int CB>
__global__ __launch_bounds__(kWgWarps * 32, 2) void grouped_gemm_wgmma_kernel(GemmArgs g) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl_enter();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* xs = smem_raw + (((base + 1023) & ~1023u) - base);               // [kWgStages][128 rows][128 bytes]
  uint32_t* wsm = reinterpret_cast<uint32_t*>(xs + kWgStages * kWgXBytes);  // [kWgStages][warps][words]
  const Exl3GemmTile t = g.tiles[blockIdx.y];
  if (t.rows <= 64) wg_tile<K, CB, 64>(g, t, xs, wsm);
  else wg_tile<K, CB, 128>(g, t, xs, wsm);
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
#define EXL3_GEMM_WG_TABLE(cb)                                                                                   \
  {                                                                                                              \
    &grouped_gemm_wgmma_kernel<1, cb>, &grouped_gemm_wgmma_kernel<2, cb>, &grouped_gemm_wgmma_kernel<3, cb>,     \
        &grouped_gemm_wgmma_kernel<4, cb>, &grouped_gemm_wgmma_kernel<5, cb>, &grouped_gemm_wgmma_kernel<6, cb>, \
        &grouped_gemm_wgmma_kernel<7, cb>, &grouped_gemm_wgmma_kernel<8, cb>                                     \
  }
const GemmFn kGemmWg[3][8] = {EXL3_GEMM_WG_TABLE(0), EXL3_GEMM_WG_TABLE(1), EXL3_GEMM_WG_TABLE(2)};
#undef EXL3_GEMM_WG_TABLE
constexpr size_t kWgSmem[8] = {wg_smem_bytes<1>(), wg_smem_bytes<2>(), wg_smem_bytes<3>(), wg_smem_bytes<4>(),
                               wg_smem_bytes<5>(), wg_smem_bytes<6>(), wg_smem_bytes<7>(), wg_smem_bytes<8>()};

}  // namespace

bool exl3_gemm_wgmma_built() {
  static const bool built = [] {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess || major != 9)
      return false;
    int* d = nullptr;
    int h = 0;
    if (cudaMalloc(&d, sizeof(int)) != cudaSuccess) return false;
    wgmma_probe_kernel<<<1, 1>>>(d);
    const bool ok = cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess && h == 1;
    cudaFree(d);
    (void)cudaGetLastError();
    return ok;
  }();
  return built;
}

void exl3_grouped_gemm_wgmma(const Exl3Dev& shape, const Exl3Dev* tab, const Exl3GemmTile* tiles, int n_tiles,
                             const uint16_t* xh16, float* yr, void* stream, float* y, int64_t y_ld) {
  if (!exl3_gemm_wgmma_built()) throw std::runtime_error("EXL3 grouped GEMM form 4: needs an sm_90a build and device");
  const GemmFn fn = kGemmWg[shape.cb][shape.K - 1];
  const size_t smem = kWgSmem[shape.K - 1];
  reserve_dynamic_smem(fn, smem, "EXL3 grouped GEMM form 4");
  // two blocks per multiprocessor: ask for the largest shared-memory carveout (a hint; its failure keeps one block)
  if (cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, int(cudaSharedmemCarveoutMaxShared)) !=
      cudaSuccess)
    (void)cudaGetLastError();
  launch(fn, dim3(shape.out_pad / kCols, n_tiles), kWgWarps * 32, smem, static_cast<cudaStream_t>(stream),
         GemmArgs{tab, tiles, xh16, yr, shape.in_pad, shape.out_pad, y, y_ld, shape.out});
  EXL3_CHECK(cudaGetLastError());
}

}  // namespace moesrv::cuda
