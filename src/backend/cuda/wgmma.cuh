// Hopper warpgroup MMA (wgmma, sm_90a only: guard users with __CUDA_ARCH_FEAT_SM90_ALL): fence / commit / wait,
// 128-byte-swizzled K-major and N-major shared-memory descriptors, and D[64][N] += A[64][16] . B[16][N] in fp32 with
// A (fp16) in registers (the m16n8k16 A fragment of rows 16 w .. 16 w + 15 in warp w of the warpgroup) and B (fp16)
// in shared memory, for N = 64, 128, 192, 256 (and 256 with B N-major), or both in shared memory (MmaSS, N = 32, 64).
// d[4 j + i] = D[16 w + lane / 4 + 8 (i / 2)][8 j + 2 (lane % 4) + i % 2].
#pragma once
#include <cstdint>

namespace moesrv::cuda::wgmma {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of the accumulators across the asynchronous MMAs.
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte swizzle (16-byte chunk c of row r at
// c ^ (r % 8); the rows' base 1,024-byte aligned), 8-row groups 1,024 bytes apart; saddr: the k16 step's start
// (the base + 32 bytes per step).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr) {
  return uint64_t((saddr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// N-major descriptor, 128-byte swizzle: rows of 64 N-elements (128 bytes) per K index, 8 K rows 1,024 bytes apart
// (SBO), N blocks of 64 mn_stride bytes apart (LBO); the rows' base 1,024-byte aligned, as for sw128_desc.
__device__ __forceinline__ uint64_t sw128_mn_desc(uint32_t saddr, uint32_t mn_stride) {
  return uint64_t((saddr & 0x3FFFF) >> 4) | (uint64_t(mn_stride >> 4) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

template <int N, int TransB = 0>
struct Mma;
// One specialisation per N (and B's major-ness: TransB 1 = B is N-major, i.e. its N dimension contiguous): the
// accumulators are operands 0 .. N/2 - 1, then A's 4 registers, the descriptor and the scale-d flag (1: D += A . B).
#define MOESRV_WGMMA_ACC8(i)                                                                                  \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define MOESRV_WGMMA_ACC32(i) \
  MOESRV_WGMMA_ACC8(i), MOESRV_WGMMA_ACC8(i + 8), MOESRV_WGMMA_ACC8(i + 16), MOESRV_WGMMA_ACC8(i + 24)
#define MOESRV_WGMMA_MMA_T(N, TB, D_REGS, A_REGS, DESC, SCALE, ...)                                        \
  template <>                                                                                              \
  struct Mma<N, TB> {                                                                                      \
    static __device__ __forceinline__ void mma(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N  \
                   "k16.f32.f16.f16 {" D_REGS "}, {" A_REGS "}, " DESC ", p, 1, 1, " #TB ";\n}\n"          \
                   : __VA_ARGS__                                                                           \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));                       \
    }                                                                                                      \
  };
#define MOESRV_WGMMA_MMA(N, D_REGS, A_REGS, DESC, SCALE, ...) \
  MOESRV_WGMMA_MMA_T(N, 0, D_REGS, A_REGS, DESC, SCALE, __VA_ARGS__)
// The 128 accumulator operands of N = 256.
#define MOESRV_WGMMA_R128                                                                                          \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, " \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, " \
  "%68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, " \
  "%90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, " \
  "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
MOESRV_WGMMA_MMA(64,
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
                 "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
                 "%32, %33, %34, %35", "%36", "%37", MOESRV_WGMMA_ACC32(0))
MOESRV_WGMMA_MMA(
    128,
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
    "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "
    "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63",
    "%64, %65, %66, %67", "%68", "%69", MOESRV_WGMMA_ACC32(0), MOESRV_WGMMA_ACC32(32))
MOESRV_WGMMA_MMA(192,
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
                 "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "
                 "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "
                 "%62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "
                 "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95",
                 "%96, %97, %98, %99", "%100", "%101", MOESRV_WGMMA_ACC32(0), MOESRV_WGMMA_ACC32(32),
                 MOESRV_WGMMA_ACC32(64))
MOESRV_WGMMA_MMA(256, MOESRV_WGMMA_R128, "%128, %129, %130, %131", "%132", "%133", MOESRV_WGMMA_ACC32(0),
                 MOESRV_WGMMA_ACC32(32), MOESRV_WGMMA_ACC32(64), MOESRV_WGMMA_ACC32(96))
// B N-major (V rows of a key tile: value dims contiguous per key)
MOESRV_WGMMA_MMA_T(256, 1, MOESRV_WGMMA_R128, "%128, %129, %130, %131", "%132", "%133", MOESRV_WGMMA_ACC32(0),
                   MOESRV_WGMMA_ACC32(32), MOESRV_WGMMA_ACC32(64), MOESRV_WGMMA_ACC32(96))

// D[64][N] += A[64][16] . B[16][N] with both operands in shared memory, K-major (descriptors as sw128_desc).
template <int N>
struct MmaSS;
#define MOESRV_WGMMA_SS(N, D_REGS, DESCS, SCALE, ...)                                                     \
  template <>                                                                                             \
  struct MmaSS<N> {                                                                                       \
    static __device__ __forceinline__ void mma(float (&d)[N / 2], uint64_t a_desc, uint64_t b_desc) {     \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N \
                   "k16.f32.f16.f16 {" D_REGS "}, " DESCS ", p, 1, 1, 0, 0;\n}\n"                         \
                   : __VA_ARGS__                                                                          \
                   : "l"(a_desc), "l"(b_desc), "r"(1));                                                   \
    }                                                                                                     \
  };
MOESRV_WGMMA_SS(32, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15", "%16, %17", "%18",
                MOESRV_WGMMA_ACC8(0), MOESRV_WGMMA_ACC8(8))
MOESRV_WGMMA_SS(64,
                "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
                "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
                "%32, %33", "%34", MOESRV_WGMMA_ACC32(0))
#undef MOESRV_WGMMA_SS
#undef MOESRV_WGMMA_MMA
#undef MOESRV_WGMMA_MMA_T
#undef MOESRV_WGMMA_R128
#undef MOESRV_WGMMA_ACC32
#undef MOESRV_WGMMA_ACC8
#endif

}  // namespace moesrv::cuda::wgmma
