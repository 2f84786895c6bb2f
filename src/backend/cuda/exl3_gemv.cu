// EXL3 CUDA kernels: codebook decode, Hadamard butterflies, on-the-fly GEMV, dequant + cuBLAS GEMM.
// Errors throw std::runtime_error (util/error.h's fmt headers do not compile under nvcc in C++20 mode).
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <stdexcept>
#include <string>

#include "backend/cuda/exl3_cuda.h"

namespace moesrv {

namespace {

#define EXL3_CUDA_CHECK(expr)                                                                             \
  do {                                                                                                    \
    cudaError_t err_ = (expr);                                                                            \
    if (err_ != cudaSuccess) throw std::runtime_error(std::string("CUDA error in ") + #expr + ": " + cudaGetErrorString(err_)); \
  } while (0)
#define EXL3_CUBLAS_CHECK(expr)                                                                   \
  do {                                                                                            \
    cublasStatus_t st_ = (expr);                                                                  \
    if (st_ != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string("cuBLAS error ") + std::to_string(int(st_)) + " in " + #expr); \
  } while (0)

constexpr int kGemvWarps = 4;        // warps per GEMV block, each on every 4th k-tile of the block's range
constexpr int kGemvUnroll = 4;       // tiles a warp loads before decoding (loads in flight)
constexpr int kMaxTilesPerBlock = 64;

// ---- codebooks (CB: 0 = 3INST, 1 = MCG, 2 = MUL1); bit-exact with src/format/exl3_codebook.cpp ----
template <int CB>
__device__ __forceinline__ half decode_state(uint32_t s) {
  if constexpr (CB == 2) {
    uint32_t x = s * 0x83DCD12Du;
    uint32_t byte_sum = __dp4a(x, 0x01010101u, 0u);
    return __hfma(__ushort_as_half((unsigned short)(0x6400u + byte_sum)), __ushort_as_half((unsigned short)0x1eee),
                  __ushort_as_half((unsigned short)0xc931));
  } else {
    uint32_t x = CB == 0 ? s * 89226354u + 64248484u : s * 0xCBAC1FEDu;
    x = (x & 0x8FFF8FFFu) ^ 0x3B603B60u;
    return __hadd(__ushort_as_half((unsigned short)(x & 0xFFFF)), __ushort_as_half((unsigned short)(x >> 16)));
  }
}

// Two states at once, packed as half2 (low = s0): the paired fp16 op rounds each half exactly like decode_state.
template <int CB>
__device__ __forceinline__ uint32_t decode_state2(uint32_t s0, uint32_t s1) {
  if constexpr (CB == 2) {
    uint32_t a = __dp4a(s0 * 0x83DCD12Du, 0x01010101u, 0x6400u), b = __dp4a(s1 * 0x83DCD12Du, 0x01010101u, 0x6400u);
    uint32_t h = __byte_perm(a, b, 0x5410);
    half2 r = __hfma2(*reinterpret_cast<half2*>(&h), __half2half2(__ushort_as_half((unsigned short)0x1eee)),
                      __half2half2(__ushort_as_half((unsigned short)0xc931)));
    return *reinterpret_cast<uint32_t*>(&r);
  } else {
    uint32_t x0 = CB == 0 ? s0 * 89226354u + 64248484u : s0 * 0xCBAC1FEDu;
    uint32_t x1 = CB == 0 ? s1 * 89226354u + 64248484u : s1 * 0xCBAC1FEDu;
    x0 = (x0 & 0x8FFF8FFFu) ^ 0x3B603B60u;
    x1 = (x1 & 0x8FFF8FFFu) ^ 0x3B603B60u;
    uint32_t lo = __byte_perm(x0, x1, 0x5410), hi = __byte_perm(x0, x1, 0x7632);
    half2 r = __hadd2(*reinterpret_cast<half2*>(&lo), *reinterpret_cast<half2*>(&hi));
    return *reinterpret_cast<uint32_t*>(&r);
  }
}

template <int CB>
__global__ void codebook_kernel(uint16_t* out) {
  uint32_t s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s < 65536) out[s] = __half_as_ushort(decode_state<CB>(s));
}

// Where lane `lane`'s 8 states sit in a tile's 8K words. For K <= 4 the lane's 7K+16 bits fit one 64-bit
// window (w[j0] : w[j1]); otherwise state i = bits >> sh[i] of (w[i0[i]] : w[i1[i]]).
template <int K>
struct LanePos {
  static constexpr bool kOneWindow = K <= 4;
  int i0[kOneWindow ? 1 : 8], i1[kOneWindow ? 1 : 8], sh[8];
  __device__ __forceinline__ explicit LanePos(int lane) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      int b0 = (8 * lane + i) * K + K - 16 + 256 * K;  // window start, kept positive for the wrap
      if constexpr (kOneWindow) {
        int w0 = (8 * lane * K + K - 16 + 256 * K);
        i0[0] = (w0 >> 5) % (8 * K);
        i1[0] = (i0[0] + 1) % (8 * K);
        sh[i] = 48 - (w0 & 31) - i * K;
      } else {
        i0[i] = (b0 >> 5) % (8 * K);
        i1[i] = (i0[i] + 1) % (8 * K);
        sh[i] = 48 - (b0 & 31);
      }
    }
  }
  __device__ __forceinline__ void states(const uint32_t* w, uint32_t st[8]) const {
    if constexpr (kOneWindow) {
      uint64_t v = (uint64_t(w[i0[0]]) << 32) | w[i1[0]];
#pragma unroll
      for (int i = 0; i < 8; ++i) st[i] = uint32_t(v >> sh[i]) & 0xFFFF;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) st[i] = uint32_t(((uint64_t(w[i0[i]]) << 32) | w[i1[i]]) >> sh[i]) & 0xFFFF;
    }
  }
};

// D += A . B for one m16n8k16 tensor-core tile (fp16 inputs, fp32 accumulate)
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- 128-point Hadamard: lane holds elements 4*lane..4*lane+3 of a block ----
__device__ __forceinline__ void hadamard128_lane(float4& v, int lane) {
  float s0 = v.x + v.y, d0 = v.x - v.y, s1 = v.z + v.w, d1 = v.z - v.w;
  v = make_float4(s0 + s1, d0 + d1, s0 - s1, d0 - d1);
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    float4 p;
    p.x = __shfl_xor_sync(0xffffffffu, v.x, m);
    p.y = __shfl_xor_sync(0xffffffffu, v.y, m);
    p.z = __shfl_xor_sync(0xffffffffu, v.z, m);
    p.w = __shfl_xor_sync(0xffffffffu, v.w, m);
    bool hi = lane & m;
    v.x = hi ? p.x - v.x : v.x + p.x;
    v.y = hi ? p.y - v.y : v.y + p.y;
    v.z = hi ? p.z - v.z : v.z + p.z;
    v.w = hi ? p.w - v.w : v.w + p.w;
  }
  const float r = 0.08838834764831845f;  // 1/sqrt(128)
  v.x *= r; v.y *= r; v.z *= r; v.w *= r;
}

// out[row][...] = H(x[row] ⊙ suh) for rows < n, zeros for n <= row < rows. 4 warps per block, one 128-block each.
template <bool kHalfOut>
__global__ void had_in_kernel(const float* __restrict__ x, const half* __restrict__ suh, int dim, int n, void* out) {
  int lane = threadIdx.x & 31, blk = blockIdx.x * 4 + (threadIdx.x >> 5), row = blockIdx.y;
  if (blk * 128 >= dim) return;
  int e = blk * 128 + lane * 4;
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (row < n) {
    v = *reinterpret_cast<const float4*>(x + size_t(row) * dim + e);
    v.x *= __half2float(suh[e]); v.y *= __half2float(suh[e + 1]);
    v.z *= __half2float(suh[e + 2]); v.w *= __half2float(suh[e + 3]);
  }
  hadamard128_lane(v, lane);
  if constexpr (kHalfOut) {
    half2* o = reinterpret_cast<half2*>(static_cast<half*>(out) + size_t(row) * dim + e);
    o[0] = __floats2half2_rn(v.x, v.y);
    o[1] = __floats2half2_rn(v.z, v.w);
  } else {
    *reinterpret_cast<float4*>(static_cast<float*>(out) + size_t(row) * dim + e) = v;
  }
}

// y[row] = H(yr[row]) ⊙ svh
__global__ void had_out_kernel(const float* __restrict__ yr, const half* __restrict__ svh, int dim, float* __restrict__ y) {
  int lane = threadIdx.x & 31, blk = blockIdx.x * 4 + (threadIdx.x >> 5), row = blockIdx.y;
  if (blk * 128 >= dim) return;
  int e = blk * 128 + lane * 4;
  float4 v = *reinterpret_cast<const float4*>(yr + size_t(row) * dim + e);
  hadamard128_lane(v, lane);
  v.x *= __half2float(svh[e]); v.y *= __half2float(svh[e + 1]);
  v.z *= __half2float(svh[e + 2]); v.w *= __half2float(svh[e + 3]);
  *reinterpret_cast<float4*>(y + size_t(row) * dim + e) = v;
}

// ---- GEMV: yr[b][16*nt + c] += sum_k xh[b][k] * W_hat[k][16*nt + c] over the block's k-tiles ----
// grid (tiles_n, ksplit), kGemvWarps warps. Each warp decodes whole tiles in tensor-core order: lane l holds
// rows {r0, r0+1, r0+8, r0+9} (r0 = 2*(l%4)) of columns l/4 and l/4+8, so a tile costs 8 decodes per lane.
template <int K, int CB>
__global__ __launch_bounds__(kGemvWarps * 32) void gemv_kernel(const uint4* __restrict__ trellis,
                                                                const float* __restrict__ xh, int in_pad, int nb,
                                                                int tiles_k, int tiles_n, int tiles_per_block,
                                                                float* __restrict__ yr, int out_pad) {
  constexpr int kWords = 8 * K, kChunks = 2 * K;  // per tile: uint32 words, 16-byte chunks
  constexpr int kLoads = (kGemvUnroll * kChunks + 31) / 32;
  extern __shared__ __align__(16) float smem[];
  const int xs_stride = tiles_per_block * 16;
  float* xs = smem;                                                    // [nb][xs_stride]
  uint32_t* ws = reinterpret_cast<uint32_t*>(xs + nb * xs_stride);     // [warps][unroll][kWords]
  float* red = reinterpret_cast<float*>(ws + kGemvWarps * kGemvUnroll * kWords);  // [warps][8][16]

  const int nt = blockIdx.x, kt0 = blockIdx.y * tiles_per_block;
  const int kt1 = min(tiles_k, kt0 + tiles_per_block), span = (kt1 - kt0) * 16;
  for (int i = threadIdx.x; i < nb * span; i += blockDim.x) {
    int b = i / span, k = i - b * span;
    xs[b * xs_stride + k] = xh[size_t(b) * in_pad + kt0 * 16 + k];
  }
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = (lane & 3) * 2, c0 = lane >> 2;
  uint32_t* wsw = ws + warp * kGemvUnroll * kWords;
  const LanePos<K> pos(lane);
  float acc[8][2];
#pragma unroll
  for (int b = 0; b < 8; ++b) acc[b][0] = acc[b][1] = 0.f;

  for (int base = kt0 + warp; base < kt1; base += kGemvWarps * kGemvUnroll) {
    uint4 regs[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      int c = lane + 32 * j, u = c / kChunks, kt = base + u * kGemvWarps;
      if (c < kGemvUnroll * kChunks && kt < kt1)
        regs[j] = __ldg(trellis + (size_t(kt) * tiles_n + nt) * kChunks + (c - u * kChunks));
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      int c = lane + 32 * j;
      if (c < kGemvUnroll * kChunks) reinterpret_cast<uint4*>(wsw)[c] = regs[j];
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      int kt = base + u * kGemvWarps;
      if (kt < kt1) {
        const uint32_t* tw = wsw + u * kWords;
        uint32_t st[8];
        pos.states(tw, st);
        float w[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = __half2float(decode_state<CB>(st[i]));
        const float* xk = xs + (kt - kt0) * 16;
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          if (b < nb) {
            float2 xa = *reinterpret_cast<const float2*>(xk + b * xs_stride + r0);
            float2 xc = *reinterpret_cast<const float2*>(xk + b * xs_stride + r0 + 8);
            acc[b][0] += xa.x * w[0] + xa.y * w[1] + xc.x * w[2] + xc.y * w[3];
            acc[b][1] += xa.x * w[4] + xa.y * w[5] + xc.x * w[6] + xc.y * w[7];
          }
        }
      }
    }
    __syncwarp();
  }
#pragma unroll
  for (int b = 0; b < 8; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v = acc[b][h];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      acc[b][h] = v;
    }
  if ((lane & 3) == 0)
#pragma unroll
    for (int b = 0; b < 8; ++b)
      if (b < nb) {
        red[(warp * 8 + b) * 16 + c0] = acc[b][0];
        red[(warp * 8 + b) * 16 + c0 + 8] = acc[b][1];
      }
  __syncthreads();
  for (int i = threadIdx.x; i < nb * 16; i += blockDim.x) {
    int b = i >> 4, c = i & 15;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kGemvWarps; ++w) s += red[(w * 8 + b) * 16 + c];
    atomicAdd(yr + size_t(b) * out_pad + nt * 16 + c, s);
  }
}

// Same work split as gemv_kernel, but the lane's 8 decoded fp16 values are exactly its B fragments of two
// m16n8k16 tensor-core products (columns c0 and c0+8), with the batch rows (<= 8, fp16) as the A operand's M.
template <int K, int CB>
__global__ __launch_bounds__(kGemvWarps * 32) void gemv_mma_kernel(const uint4* __restrict__ trellis,
                                                                    const float* __restrict__ xh, int in_pad, int nb,
                                                                    int tiles_k, int tiles_n, int tiles_per_block,
                                                                    float* __restrict__ yr, int out_pad) {
  constexpr int kWords = 8 * K, kChunks = 2 * K;
  constexpr int kLoads = (kGemvUnroll * kChunks + 31) / 32;
  extern __shared__ __align__(16) float smem[];
  const int xs_stride = tiles_per_block * 16;
  half* xs = reinterpret_cast<half*>(smem);                                       // [8][xs_stride]
  uint32_t* ws = reinterpret_cast<uint32_t*>(xs + 8 * xs_stride);                 // [warps][unroll][kWords]
  float* red = reinterpret_cast<float*>(ws + kGemvWarps * kGemvUnroll * kWords);  // [warps][8][16]

  const int nt = blockIdx.x, kt0 = blockIdx.y * tiles_per_block;
  const int kt1 = min(tiles_k, kt0 + tiles_per_block), span = (kt1 - kt0) * 16;
  for (int i = threadIdx.x; i < 8 * span; i += blockDim.x) {
    int b = i / span, k = i - b * span;
    xs[b * xs_stride + k] = b < nb ? __float2half_rn(xh[size_t(b) * in_pad + kt0 * 16 + k]) : __float2half_rn(0.f);
  }
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tid = lane & 3;  // fragment row group (= batch row) and thread-in-group
  uint32_t* wsw = ws + warp * kGemvUnroll * kWords;
  const LanePos<K> pos(lane);
  float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};

  for (int base = kt0 + warp; base < kt1; base += kGemvWarps * kGemvUnroll) {
    uint4 regs[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      int c = lane + 32 * j, u = c / kChunks, kt = base + u * kGemvWarps;
      if (c < kGemvUnroll * kChunks && kt < kt1)
        regs[j] = __ldg(trellis + (size_t(kt) * tiles_n + nt) * kChunks + (c - u * kChunks));
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      int c = lane + 32 * j;
      if (c < kGemvUnroll * kChunks) reinterpret_cast<uint4*>(wsw)[c] = regs[j];
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      int kt = base + u * kGemvWarps;
      if (kt < kt1) {
        uint32_t st[8];
        pos.states(wsw + u * kWords, st);
        const half* xk = xs + g * xs_stride + (kt - kt0) * 16 + 2 * tid;
        uint32_t a0 = *reinterpret_cast<const uint32_t*>(xk), a2 = *reinterpret_cast<const uint32_t*>(xk + 8);
        mma_16816(d0, a0, 0u, a2, 0u, decode_state2<CB>(st[0], st[1]), decode_state2<CB>(st[2], st[3]));
        mma_16816(d1, a0, 0u, a2, 0u, decode_state2<CB>(st[4], st[5]), decode_state2<CB>(st[6], st[7]));
      }
    }
    __syncwarp();
  }
  // d*[0..1]: batch row g, columns 2*tid, 2*tid+1 (d1: +8); d*[2..3] are the unused rows g+8
  float* r = red + (warp * 8 + g) * 16 + 2 * tid;
  r[0] = d0[0];
  r[1] = d0[1];
  r[8] = d1[0];
  r[9] = d1[1];
  __syncthreads();
  for (int i = threadIdx.x; i < nb * 16; i += blockDim.x) {
    int b = i >> 4, c = i & 15;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kGemvWarps; ++w) sum += red[(w * 8 + b) * 16 + c];
    atomicAdd(yr + size_t(b) * out_pad + nt * 16 + c, sum);
  }
}

// ---- dequant: W_hat fp16 row-major [in_pad][out_pad]; one warp per tile ----
template <int K, int CB>
__global__ void dequant_kernel(const uint4* __restrict__ trellis, int tiles_n, half* __restrict__ out, int out_pad) {
  constexpr int kWords = 8 * K, kChunks = 2 * K;
  __shared__ __align__(16) uint32_t ws[4][kWords];
  __shared__ __align__(16) half tile[4][16][16];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nt = blockIdx.x * 4 + warp, kt = blockIdx.y;
  if (nt >= tiles_n) return;
  if (lane < kChunks) reinterpret_cast<uint4*>(ws[warp])[lane] = __ldg(trellis + (size_t(kt) * tiles_n + nt) * kChunks + lane);
  __syncwarp();
  const LanePos<K> pos(lane);
  const int r0 = (lane & 3) * 2, c0 = lane >> 2;
  const int rows[4] = {r0, r0 + 1, r0 + 8, r0 + 9};
  uint32_t st[8];
  pos.states(ws[warp], st);
#pragma unroll
  for (int i = 0; i < 8; ++i) tile[warp][rows[i & 3]][c0 + (i >= 4 ? 8 : 0)] = decode_state<CB>(st[i]);
  __syncwarp();
  int r = lane >> 1, h = lane & 1;  // each lane stores 8 halves (16 bytes) of one row
  *reinterpret_cast<uint4*>(out + size_t(kt * 16 + r) * out_pad + nt * 16 + h * 8) =
      *reinterpret_cast<const uint4*>(&tile[warp][r][h * 8]);
}

using GemvFn = void (*)(const uint4*, const float*, int, int, int, int, int, float*, int);
using DequantFn = void (*)(const uint4*, int, half*, int);

#define EXL3_K_TABLE(fn, cb) {&fn<1, cb>, &fn<2, cb>, &fn<3, cb>, &fn<4, cb>, &fn<5, cb>, &fn<6, cb>, &fn<7, cb>, &fn<8, cb>}
const GemvFn kGemv[3][8] = {EXL3_K_TABLE(gemv_kernel, 0), EXL3_K_TABLE(gemv_kernel, 1), EXL3_K_TABLE(gemv_kernel, 2)};
const GemvFn kGemvMma[3][8] = {EXL3_K_TABLE(gemv_mma_kernel, 0), EXL3_K_TABLE(gemv_mma_kernel, 1),
                               EXL3_K_TABLE(gemv_mma_kernel, 2)};
const DequantFn kDequant[3][8] = {EXL3_K_TABLE(dequant_kernel, 0), EXL3_K_TABLE(dequant_kernel, 1),
                                  EXL3_K_TABLE(dequant_kernel, 2)};
#undef EXL3_K_TABLE

int cb_index(Exl3Codebook cb) { return cb == Exl3Codebook::Inst3 ? 0 : cb == Exl3Codebook::Mcg ? 1 : 2; }

template <typename T>
struct DeviceBuffer {
  T* p = nullptr;
  size_t n = 0;
  void reserve(size_t count) {
    if (count <= n) return;
    if (p) cudaFree(p);
    p = nullptr;
    EXL3_CUDA_CHECK(cudaMalloc(&p, count * sizeof(T)));
    n = count;
  }
  ~DeviceBuffer() {
    if (p) cudaFree(p);
  }
};

}  // namespace

struct Exl3CudaLinear::Impl {
  int K = 0, cb = 0;
  Exl3CudaLinear::GemvKernel gemv_kernel = Exl3CudaLinear::GemvKernel::Auto;
  int64_t in_pad = 0, out_pad = 0;
  DeviceBuffer<uint4> trellis;
  DeviceBuffer<half> suh, svh;
  DeviceBuffer<float> xh, yr;      // GEMV workspaces
  DeviceBuffer<half> xh16, w16;    // GEMM workspaces
  cublasHandle_t blas = nullptr;
  ~Impl() {
    if (blas) cublasDestroy(blas);
  }
  int tiles_k() const { return int(in_pad / 16); }
  int tiles_n() const { return int(out_pad / 16); }
};

Exl3CudaLinear::Exl3CudaLinear(const Exl3Weights& w) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  if (w.K < 1 || w.K > 8 || w.in_pad % 128 || w.out_pad % 128) throw std::runtime_error("Exl3CudaLinear: unsupported EXL3 shape/K");
  m.K = w.K;
  m.cb = cb_index(w.codebook);
  m.in_pad = w.in_pad;
  m.out_pad = w.out_pad;
  size_t bytes = w.trellis_bytes();
  m.trellis.reserve(bytes / 16);
  EXL3_CUDA_CHECK(cudaMemcpy(m.trellis.p, w.trellis, bytes, cudaMemcpyHostToDevice));
  auto upload_half = [](DeviceBuffer<half>& dst, const std::vector<float>& src) {
    std::vector<half> h(src.size());
    for (size_t i = 0; i < src.size(); ++i) h[i] = __float2half_rn(src[i]);  // exact: values came from fp16
    dst.reserve(h.size());
    EXL3_CUDA_CHECK(cudaMemcpy(dst.p, h.data(), h.size() * sizeof(half), cudaMemcpyHostToDevice));
  };
  upload_half(m.suh, w.suh);
  upload_half(m.svh, w.svh);
}

Exl3CudaLinear::~Exl3CudaLinear() = default;
int64_t Exl3CudaLinear::in_pad() const { return impl_->in_pad; }
int64_t Exl3CudaLinear::out_pad() const { return impl_->out_pad; }
int Exl3CudaLinear::K() const { return impl_->K; }
size_t Exl3CudaLinear::trellis_bytes() const { return size_t(impl_->in_pad / 16) * size_t(impl_->out_pad / 16) * 32 * impl_->K; }

void Exl3CudaLinear::set_gemv_kernel(GemvKernel k) { impl_->gemv_kernel = k; }

void Exl3CudaLinear::forward(const float* d_x, int n, float* d_y, void* stream) {
  if (n <= kMaxGemvBatch) forward_gemv(d_x, n, d_y, stream);
  else forward_gemm(d_x, n, d_y, stream);
}

void Exl3CudaLinear::forward_gemv(const float* d_x, int n, float* d_y, void* stream) {
  Impl& m = *impl_;
  if (n < 1 || n > kMaxGemvBatch) throw std::runtime_error("Exl3CudaLinear::forward_gemv: batch must be 1..8");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int in = int(m.in_pad), out = int(m.out_pad);
  m.xh.reserve(size_t(n) * in);
  m.yr.reserve(size_t(n) * out);
  had_in_kernel<false><<<dim3((in / 128 + 3) / 4, n), 128, 0, s>>>(d_x, m.suh.p, in, n, m.xh.p);
  EXL3_CUDA_CHECK(cudaGetLastError());
  EXL3_CUDA_CHECK(cudaMemsetAsync(m.yr.p, 0, size_t(n) * out * sizeof(float), s));
  // split K so that the grid has ~8 blocks per SM, each block covering at most kMaxTilesPerBlock k-tiles
  static int sms = [] {
    int dev = 0, v = 132;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    return v;
  }();
  int tk = m.tiles_k(), tn = m.tiles_n();
  int ksplit = std::clamp((sms * 8 + tn - 1) / tn, 1, std::max(1, tk / 8));
  int tpb = (tk + ksplit - 1) / ksplit;
  if (tpb > kMaxTilesPerBlock) tpb = kMaxTilesPerBlock;
  ksplit = (tk + tpb - 1) / tpb;
  const bool tc = m.gemv_kernel == GemvKernel::TensorCore || (m.gemv_kernel == GemvKernel::Auto && n >= 2);
  size_t smem = (tc ? size_t(8) * tpb * 16 * sizeof(half) : size_t(n) * tpb * 16 * sizeof(float)) +
                size_t(kGemvWarps) * kGemvUnroll * 8 * m.K * 4 + size_t(kGemvWarps) * 8 * 16 * sizeof(float);
  (tc ? kGemvMma : kGemv)[m.cb][m.K - 1]<<<dim3(tn, ksplit), kGemvWarps * 32, smem, s>>>(m.trellis.p, m.xh.p, in, n, tk,
                                                                                         tn, tpb, m.yr.p, out);
  EXL3_CUDA_CHECK(cudaGetLastError());
  had_out_kernel<<<dim3((out / 128 + 3) / 4, n), 128, 0, s>>>(m.yr.p, m.svh.p, out, d_y);
  EXL3_CUDA_CHECK(cudaGetLastError());
}

void Exl3CudaLinear::dequant_rotated_f16(uint16_t* d_out, void* stream) const {
  const Impl& m = *impl_;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  kDequant[m.cb][m.K - 1]<<<dim3((m.tiles_n() + 3) / 4, m.tiles_k()), 128, 0, s>>>(
      m.trellis.p, m.tiles_n(), reinterpret_cast<half*>(d_out), int(m.out_pad));
  EXL3_CUDA_CHECK(cudaGetLastError());
}

void Exl3CudaLinear::forward_gemm(const float* d_x, int n, float* d_y, void* stream) {
  Impl& m = *impl_;
  if (n < 1) return;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int in = int(m.in_pad), out = int(m.out_pad);
  m.xh16.reserve(size_t(n) * in);
  m.w16.reserve(size_t(in) * out);
  m.yr.reserve(size_t(n) * out);
  had_in_kernel<true><<<dim3((in / 128 + 3) / 4, n), 128, 0, s>>>(d_x, m.suh.p, in, n, m.xh16.p);
  EXL3_CUDA_CHECK(cudaGetLastError());
  dequant_rotated_f16(reinterpret_cast<uint16_t*>(m.w16.p), stream);
  if (!m.blas) EXL3_CUBLAS_CHECK(cublasCreate(&m.blas));
  EXL3_CUBLAS_CHECK(cublasSetStream(m.blas, s));
  // column-major view: Yr^T (out x n) = W_hat^T (out x in, ld out) . Xh^T (in x n, ld in)
  const float one = 1.f, zero = 0.f;
  EXL3_CUBLAS_CHECK(cublasGemmEx(m.blas, CUBLAS_OP_N, CUBLAS_OP_N, out, n, in, &one, m.w16.p, CUDA_R_16F, out, m.xh16.p,
                                 CUDA_R_16F, in, &zero, m.yr.p, CUDA_R_32F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  had_out_kernel<<<dim3((out / 128 + 3) / 4, n), 128, 0, s>>>(m.yr.p, m.svh.p, out, d_y);
  EXL3_CUDA_CHECK(cudaGetLastError());
}

void exl3_cuda_decode_codebook(Exl3Codebook cb, uint16_t* host_out) {
  DeviceBuffer<uint16_t> d;
  d.reserve(65536);
  switch (cb_index(cb)) {
    case 0: codebook_kernel<0><<<256, 256>>>(d.p); break;
    case 1: codebook_kernel<1><<<256, 256>>>(d.p); break;
    default: codebook_kernel<2><<<256, 256>>>(d.p); break;
  }
  EXL3_CUDA_CHECK(cudaGetLastError());
  EXL3_CUDA_CHECK(cudaMemcpy(host_out, d.p, 65536 * sizeof(uint16_t), cudaMemcpyDeviceToHost));
}

}  // namespace moesrv
