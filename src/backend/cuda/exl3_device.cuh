// EXL3 device helpers shared by the GEMV/dequant kernels (exl3_gemv.cu) and the codebook check
// (exl3_linear_cuda.cu): codebook decode, a lane's trellis states, the m16n8k16 mma, the 128-point Hadamard,
// and the GEMV kernels' tile staging and split-K reduction; EXL3_CHECK for their host-side CUDA calls.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "backend/cuda/kernel_util.cuh"  // mma_m16n8k16_f16

// Throws std::runtime_error naming the failed CUDA call.
#define EXL3_CHECK(expr)                                                                       \
  do {                                                                                         \
    cudaError_t err_ = (expr);                                                                 \
    if (err_ != cudaSuccess) {                                                                 \
      (void)cudaGetLastError(); /* not left for the next check to report */                    \
      throw std::runtime_error(std::string("CUDA error in ") + #expr + " (" + __FILE__ + ":" + \
                               std::to_string(__LINE__) + "): " + cudaGetErrorString(err_));   \
    }                                                                                          \
  } while (0)

namespace moesrv::cuda::exl3 {

constexpr int kGemvWarps = 4;   // warps per GEMV block, each on every 4th k-tile of the block's range
constexpr int kGemvUnroll = 4;  // tiles a warp loads before decoding (loads in flight)

// ---- codebooks (CB: 0 = 3INST, 1 = MCG, 2 = MUL1); bit-exact with src/format/exl3_codebook.cpp ----
// MUL1: the fp16 bits of 1024 + the byte sum of s * 0x83DCD12D (exact), and the affine A v + C on a pair of them.
__device__ __forceinline__ uint32_t mul1_sum(uint32_t s) { return __dp4a(s * 0x83DCD12Du, 0x01010101u, 0x6400u); }
__device__ __forceinline__ uint32_t mul1_affine2(half2 v) {
  half2 r = __hfma2(v, __half2half2(__ushort_as_half((unsigned short)0x1eee)),
                    __half2half2(__ushort_as_half((unsigned short)0xc931)));
  return *reinterpret_cast<uint32_t*>(&r);
}

template <int CB>
__device__ __forceinline__ half decode_state(uint32_t s) {
  if constexpr (CB == 2) {
    return __hfma(__ushort_as_half((unsigned short)mul1_sum(s)), __ushort_as_half((unsigned short)0x1eee),
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
    uint32_t h = __byte_perm(mul1_sum(s0), mul1_sum(s1), 0x5410);
    return mul1_affine2(*reinterpret_cast<half2*>(&h));
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

// MUL1's value before decode_state's fp16 rounding is affine in the byte sum bs: w = A (1024 + bs) + C, with A and C
// decode_state's fp16 constants. mul1_raw2 packs fp16(1024 + bs) of two states (exact in fp16); a sum of products
// over these raw values times A, plus C times the sum of the inputs, is the product with the unrounded values.
constexpr float kMul1A = 0.00676727294921875f, kMul1C = -10.3828125f;  // fp16 0x1eee, 0xc931
__device__ __forceinline__ uint32_t mul1_raw2(uint32_t s0, uint32_t s1) {
  return __byte_perm(mul1_sum(s0), mul1_sum(s1), 0x5410);
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

// Bits [r, r + 16) of the word stream b (bit 0 = the most significant bit of b[0]), r a compile-time constant after
// unrolling: one shift/mask (or byte permute) inside a word, a funnel shift and a shift across two.
template <int N>
__device__ __forceinline__ uint32_t stream_bits16(const uint32_t (&b)[N], int r) {
  const int w = r >> 5, o = r & 31;
  if (o == 8) return __byte_perm(b[w], 0u, 0x4421);  // bytes 1, 2: one PRMT instead of a shift and a mask
  if (o <= 16) return (b[w] >> (16 - o)) & 0xFFFFu;
  return __funnelshift_l(b[w + 1 < N ? w + 1 : N - 1], b[w], o) >> 16;
}

// stream_bits16 with the state moved to offset 0, 8 or 16 of a word shifted by d (a funnel shift the compiler shares
// between the states of one word that pick the same d): one shift and one extraction, or one extraction at offsets
// 0, 8 and 16. At K = 4 a word's 8 states take 11 instructions instead of 13.
template <int N>
__device__ __forceinline__ uint32_t stream_bits16_shared(const uint32_t (&b)[N], int r) {
  const int w = r >> 5, o = r & 31;
  if (o == 0) return b[w] >> 16;
  if (o == 8) return __byte_perm(b[w], 0u, 0x4421);
  if (o == 16) return b[w] & 0xFFFFu;
  const int d = o < 24 ? (o & 7) : o - 16, e = o - d;  // e: the state's offset in the shifted word, 0, 8 or 16
  const uint32_t v = __funnelshift_l(b[w + 1 < N ? w + 1 : N - 1], b[w], d);
  return e == 0 ? v >> 16 : e == 8 ? __byte_perm(v, 0u, 0x4421) : v & 0xFFFFu;
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
  v.x *= r;
  v.y *= r;
  v.z *= r;
  v.w *= r;
}

// The warp's next kGemvUnroll tiles of strip nt (k-tiles base, base + kGemvWarps, ...; those >= kt1 are zeros) in
// registers: load_tiles issues all 16-byte loads; store_tiles writes them to wsw [kGemvUnroll][8K words]. The GEMV
// loops load the next group before decoding the current one, so a warp always has a group of loads in flight.
template <int K>
struct TileRegs {
  static constexpr int kChunks = 2 * K, kLoads = (kGemvUnroll * kChunks + 31) / 32;
  uint4 r[kLoads];
};
template <int K>
__device__ __forceinline__ void load_tiles(const uint4* __restrict__ trellis, int tiles_n, int nt, int base, int kt1,
                                           int lane, TileRegs<K>& t) {
  constexpr int kChunks = TileRegs<K>::kChunks;
#pragma unroll
  for (int j = 0; j < TileRegs<K>::kLoads; ++j) {
    int c = lane + 32 * j, u = c / kChunks, kt = base + u * kGemvWarps;
    t.r[j] = make_uint4(0, 0, 0, 0);
    if (c < kGemvUnroll * kChunks && kt < kt1)
      t.r[j] = __ldg(trellis + (size_t(kt) * tiles_n + nt) * kChunks + (c - u * kChunks));
  }
}
template <int K>
__device__ __forceinline__ void store_tiles(const TileRegs<K>& t, int lane, uint32_t* wsw) {
#pragma unroll
  for (int j = 0; j < TileRegs<K>::kLoads; ++j) {
    int c = lane + 32 * j;
    if (c < kGemvUnroll * TileRegs<K>::kChunks) reinterpret_cast<uint4*>(wsw)[c] = t.r[j];
  }
  __syncwarp();
}

// Split-K epilogue: red [warps][8][16] holds each warp's partial sums for nb batch rows; adds their total to
// the 16 columns of strip nt in yr (zeroed by the caller). Call after __syncthreads().
__device__ __forceinline__ void reduce_strip(const float* red, int nb, float* __restrict__ yr, int out_pad, int nt) {
  for (int i = threadIdx.x; i < nb * 16; i += blockDim.x) {
    int b = i >> 4, c = i & 15;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kGemvWarps; ++w) s += red[(w * 8 + b) * 16 + c];
    atomicAdd(yr + size_t(b) * out_pad + nt * 16 + c, s);
  }
}

}  // namespace moesrv::cuda::exl3
