// Small device helpers shared by the engine's kernels.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include <stdexcept>

namespace moesrv::cuda {

#define MOESRV_CUDA_LAUNCH_CHECK()                                                                      \
  do {                                                                                                  \
    cudaError_t e_ = cudaGetLastError();                                                                \
    if (e_ != cudaSuccess)                                                                              \
      throw std::runtime_error(std::string("CUDA launch failed (") + __func__ + ", " + __FILE__ + ":" + \
                               std::to_string(__LINE__) + "): " + cudaGetErrorString(e_));              \
  } while (0)

__device__ __forceinline__ float bf16_to_f32(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }
__device__ __forceinline__ uint16_t f32_to_bf16(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }

// One element of a KV cache row as fp32: bf16 bits, or an int8 value (its per-token scale applied by the caller).
template <typename T>
__device__ __forceinline__ float cache_elem(const T* p, int64_t i);
template <>
__device__ __forceinline__ float cache_elem<uint16_t>(const uint16_t* p, int64_t i) {
  return bf16_to_f32(p[i]);
}
template <>
__device__ __forceinline__ float cache_elem<int8_t>(const int8_t* p, int64_t i) {
  return float(p[i]);
}

// D += A . B for one m16n8k16 tensor-core tile (fp16 inputs, fp32 accumulation). Fragments (g = lane / 4,
// t = lane % 4): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]; b0 = B[2t, 2t+1][g],
// b1 = B[2t+8, 2t+9][g]; d = D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]. Pairs: the lower index in the low half.
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D += A . B for one m16n8k32 integer tile: A unsigned bytes, B signed bytes, int32 accumulation. Fragments (g, t
// as above): a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][4t+16..], a3 = A[g+8][4t+16..] (the lowest k in the
// lowest byte); b0 = B[4t..4t+3][g], b1 = B[4t+16..4t+19][g]; d as mma_m16n8k16_f16's.
__device__ __forceinline__ void mma_m16n8k32_u8s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                  uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices from shared memory (lane l gives row l % 8 of matrix l / 8): r_i = lane (g, t)'s pair
// M_i[g][2t, 2t + 1]; _trans: M_i[2t][g], M_i[2t + 1][g] (a B fragment of m16n8k16 from a [k][n] row-major tile).
__device__ __forceinline__ void ldmatrix_x4(const void* p, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(const void* p, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x2_trans(const void* p, uint32_t& r0, uint32_t& r1) {  // lanes 0-15 give rows
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(a));
}

// 16 bytes global -> shared without registers (cp.async, L2 only); fill false: 16 zero bytes, src not read.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool fill) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(fill ? 16 : 0));
}

__device__ __forceinline__ uint32_t pack_half2(half lo, half hi) {
  return uint32_t(__half_as_ushort(lo)) | (uint32_t(__half_as_ushort(hi)) << 16);
}

// 8 bf16 -> 8 fp16 (16 bytes; exact for magnitudes in fp16's normal range)
__device__ __forceinline__ uint4 bf16x8_to_half(uint4 raw) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t hw[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)  // two bf16 -> two fp16
    hw[j] =
        pack_half2(__float2half_rn(__uint_as_float(w[j] << 16)), __float2half_rn(__uint_as_float(w[j] & 0xFFFF0000u)));
  return make_uint4(hw[0], hw[1], hw[2], hw[3]);
}

// (x, y) as fp16 pairs hi = fp16(v) and lo = fp16(v - hi): hi + lo carries ~22 bits, so products of split operands
// (hi.hi + hi.lo + lo.hi) reach fp32-like accuracy on fp16 tensor cores.
__device__ __forceinline__ void split_half2(float x, float y, uint32_t& hi, uint32_t& lo) {
  const half hx = __float2half_rn(x), hy = __float2half_rn(y);
  hi = pack_half2(hx, hy);
  lo = pack_half2(__float2half_rn(x - __half2float(hx)), __float2half_rn(y - __half2float(hy)));
}

// The most shared memory a block may have on the current device (opt-in limit: 99 KB on an RTX 3090 / 4090, 227 KB
// on an H100 / H200); 0 when it cannot be read.
inline size_t device_block_smem_limit() {
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return 0;
  return size_t(optin);
}

// Lets `kernel` launch with `bytes` of dynamic shared memory on the current device. A host-side call, legal while a
// graph is captured; per device, so each pipeline stage's device gets it. Throws naming `who`.
template <typename Kernel>
void reserve_dynamic_smem(Kernel kernel, size_t bytes, const char* who) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)) != cudaSuccess)
    throw std::runtime_error(std::string(who) + ": cannot reserve " + std::to_string(bytes) + " B of shared memory");
}
// Asks for the largest shared-memory carveout for `kernel`, so that several of its blocks with large shared memory can
// share a multiprocessor. A hint: if the call fails the kernel still runs, at fewer blocks per multiprocessor.
template <typename Kernel>
void prefer_max_shared_carveout(Kernel kernel) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           int(cudaSharedmemCarveoutMaxShared)) != cudaSuccess)
    (void)cudaGetLastError();
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
  __shared__ float total;
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < int(blockDim.x >> 5) ? part[lane] : 0.0f;
    t = warp_sum(t);
    if (lane == 0) total = t;
  }
  __syncthreads();
  return total;
}

// Dot product of a bf16 row and an fp32 vector by one warp (lanes stride the row); all lanes get the sum.
__device__ __forceinline__ float warp_dot_bf16(const uint16_t* w, const float* x, int n) {
  float acc = 0.0f;
  const int lane = threadIdx.x & 31;
  if ((n & 7) == 0 && (reinterpret_cast<uintptr_t>(w) & 15) == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    for (int i = lane * 8; i < n; i += 256) {
      uint4 p = *reinterpret_cast<const uint4*>(w + i);
      float4 a = *reinterpret_cast<const float4*>(x + i), b = *reinterpret_cast<const float4*>(x + i + 4);
      acc += __uint_as_float(p.x << 16) * a.x + __uint_as_float(p.x & 0xffff0000u) * a.y;
      acc += __uint_as_float(p.y << 16) * a.z + __uint_as_float(p.y & 0xffff0000u) * a.w;
      acc += __uint_as_float(p.z << 16) * b.x + __uint_as_float(p.z & 0xffff0000u) * b.y;
      acc += __uint_as_float(p.w << 16) * b.z + __uint_as_float(p.w & 0xffff0000u) * b.w;
    }
  } else {
    for (int i = lane; i < n; i += 32) acc += bf16_to_f32(w[i]) * x[i];
  }
  return warp_sum(acc);
}

// Dot product of n float4s (shared memory, typically) in four independent chains, summed as (c0 + c1) + (c2 + c3).
__device__ __forceinline__ float dot_float4(const float4* a, const float4* b, int n) {
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
  for (int i = 0; i < n; ++i) {
    const float4 x = a[i], y = b[i];
    c[0] += x.x * y.x;
    c[1] += x.y * y.y;
    c[2] += x.z * y.z;
    c[3] += x.w * y.w;
  }
  return (c[0] + c[1]) + (c[2] + c[3]);
}

// Whether p is 16-byte aligned (null counts: float4 paths check their optional pointers with it).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether the comparison switch `name` (an environment variable) is set to a nonzero number.
inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && std::atoi(v) != 0;
}

// The comparison switch `name` as a number in [lo, hi]; `fallback` when unset or outside.
inline int env_choice(const char* name, int lo, int hi, int fallback) {
  const char* v = std::getenv(name);
  const int n = v ? std::atoi(v) : fallback;
  return n >= lo && n <= hi ? n : fallback;
}

inline int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

}  // namespace moesrv::cuda
