// EXL3 CUDA kernels and their launchers (exl3_ops.h): Hadamard in/out, on-the-fly GEMV (fp32 and tensor-core
// variants, plain or grouped over an expert table; a one-row fp32 kernel for decode), W_hat dequant slabs and the
// fp16 cuBLAS GEMM over them.
// Errors throw std::runtime_error (util/error.h's fmt headers do not compile under nvcc in C++20 mode).
#include <cublas_v2.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "backend/cuda/exl3_device.cuh"
#include "backend/cuda/exl3_ops.h"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

using namespace exl3;

namespace {

constexpr int kMaxTilesPerBlock = 64;

// The table entry of grouped row r (Exl3Group).
__device__ __forceinline__ const Exl3Dev& group_entry(const Exl3Group& g, int r) {
  return g.tab[g.part_rows ? g.ids[r % g.part_rows] + (r / g.part_rows) * g.part_stride : g.ids[r]];
}

struct RotArgs {  // both Hadamard kernels
  Exl3Dev w;
  Exl3Group g;
  Exl3Src src;      // rotate_in only
  const float* yr;  // rotate_out only
  float* y;
  int64_t y_ld;
  const float* bias;
  void* out;    // rotate_in: xh
  float* zero;  // rotate_in: GEMV output rows to zero (out_pad floats each), or null
  int parts;    // rotate_out: yr holds this many K parts of the n rows
};

// The input row and suh of grouped row `row` (Exl3Src, Exl3Group).
struct RowIn {
  const float* x;
  const half* suh;
};
__device__ __forceinline__ RowIn row_in(const Exl3Dev& w, const Exl3Group& g, const Exl3Src& src, int row) {
  const int lrow = g.part_rows ? row % g.part_rows : row;
  return {src.x + size_t(src.rows ? src.rows[lrow] : lrow / src.div) * src.ld,
          reinterpret_cast<const half*>(g.ids ? group_entry(g, row).suh : w.suh)};
}
// (x ⊙ suh)[e..e+3], zero beyond the logical `in`; with src.swiglu x is silu_mul_clamped of the row's gate | up.
__device__ __forceinline__ float4 scaled_in4(const Exl3Dev& w, const Exl3Src& src, RowIn r, int e) {
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float xv = 0.f;
    if (e + i < w.in) {
      xv = r.x[e + i];
      if (src.swiglu) {  // silu_mul_clamped's arithmetic
        float gt = xv, up = r.x[w.in + e + i];
        if (src.limit > 0.f) gt = fminf(gt, src.limit), up = fminf(fmaxf(up, -src.limit), src.limit);
        xv = gt / (1.0f + expf(-gt)) * up;
      }
    }
    v[i] = xv * __half2float(r.suh[e + i]);
  }
  return make_float4(v[0], v[1], v[2], v[3]);
}

// y[row][o] (o < out, rows y_ld apart, grouped part rows as Exl3Group says) = (H(sum of the `parts` K parts of
// yr[row] in part order) ⊙ svh)[o] (+ bias) over the 128 outputs of block `blk`, by one warp: rotate_out_kernel's
// arithmetic, which calls it. Parts are read through L2 (`fresh`: other blocks of the running grid wrote them).
template <bool kFresh>
__device__ __forceinline__ void rotate_out_warp(const Exl3Dev& w, const Exl3Group& g, const float* yr, int rows,
                                                int row, int parts, int blk, float* y0, int64_t y_ld, const float* bias,
                                                int lane) {
  const int dim = w.out_pad, e = blk * 128 + lane * 4;
  const half* svh = reinterpret_cast<const half*>(g.ids ? group_entry(g, row).svh : w.svh);
  auto load = [&](int p) {
    const float4* q = reinterpret_cast<const float4*>(yr + (size_t(p) * rows + row) * dim + e);
    return kFresh ? __ldcg(q) : *q;
  };
  float4 h = load(0);
  for (int p = 1; p < parts; p += 8) {  // the fused GEMV's K parts, in part order: 8 loads in flight, then their sum
    float4 q[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (p + j < parts) q[j] = load(p + j);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (p + j < parts) h.x += q[j].x, h.y += q[j].y, h.z += q[j].z, h.w += q[j].w;
  }
  hadamard128_lane(h, lane);
  const float v[4] = {h.x, h.y, h.z, h.w};
  float* y = y0 + (g.part_rows ? (row % g.part_rows) * y_ld + (row / g.part_rows) * g.part_out : size_t(row) * y_ld);
  const bool whole = e + 4 <= w.out && reinterpret_cast<uintptr_t>(y + e) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(svh + e) % 8 == 0 &&
                     (!bias || reinterpret_cast<uintptr_t>(bias + e) % 16 == 0);
  if (whole) {  // one 16-byte store per lane (the scalar stores below wrote a quarter of each sector per instruction)
    const uint2 sv = *reinterpret_cast<const uint2*>(svh + e);
    const float2 s01 = __half22float2(*reinterpret_cast<const __half2*>(&sv.x)),
                 s23 = __half22float2(*reinterpret_cast<const __half2*>(&sv.y));
    const float4 b = bias ? *reinterpret_cast<const float4*>(bias + e) : make_float4(0.f, 0.f, 0.f, 0.f);
    *reinterpret_cast<float4*>(y + e) =
        make_float4(v[0] * s01.x + b.x, v[1] * s01.y + b.y, v[2] * s23.x + b.z, v[3] * s23.y + b.w);
    return;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (e + i < w.out) y[e + i] = v[i] * __half2float(svh[e + i]) + (bias ? bias[e + i] : 0.f);
}

// out[row] = H(x[src row] ⊙ suh) over in_pad (zero beyond the logical `in`). 4 warps per block, P 128-blocks per
// warp (its loads issued together, the row's table lookups made once: with one block per warp, rows of 8K tokens
// ran as tens of thousands of tiny blocks bound by those lookups' latency).
template <bool kHalfOut, int P>
__global__ void rotate_in_kernel(RotArgs a) {
  pdl_enter();
  const int dim = a.w.in_pad, lane = threadIdx.x & 31, blk0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * P;
  const int row = blockIdx.y;
  if (a.zero)  // the blocks of this row share its GEMV output row
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.w.out_pad; i += gridDim.x * blockDim.x)
      a.zero[size_t(row) * a.w.out_pad + i] = 0.f;
  if (blk0 * 128 >= dim) return;
  const RowIn rin = row_in(a.w, a.g, a.src, row);
  float4 h[P];
#pragma unroll
  for (int i = 0; i < P; ++i)
    if ((blk0 + i) * 128 < dim) h[i] = scaled_in4(a.w, a.src, rin, (blk0 + i) * 128 + lane * 4);
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if ((blk0 + i) * 128 >= dim) break;  // (warp-uniform: the Hadamard's shuffles see every lane)
    const int e = (blk0 + i) * 128 + lane * 4;
    hadamard128_lane(h[i], lane);
    if constexpr (kHalfOut) {
      half2* o = reinterpret_cast<half2*>(static_cast<half*>(a.out) + size_t(row) * dim + e);
      o[0] = __floats2half2_rn(h[i].x, h[i].y);
      o[1] = __floats2half2_rn(h[i].z, h[i].w);
    } else {
      *reinterpret_cast<float4*>(static_cast<float*>(a.out) + size_t(row) * dim + e) = h[i];
    }
  }
}

// y[row][o] = (H(yr[row]) ⊙ svh)[o] (+ bias) for o < out.
__global__ void rotate_out_kernel(RotArgs a) {
  pdl_enter();
  const int blk = blockIdx.x * 4 + (threadIdx.x >> 5);
  if (blk * 128 >= a.w.out_pad) return;
  rotate_out_warp<false>(a.w, a.g, a.yr, gridDim.y, blockIdx.y, a.parts, blk, a.y, a.y_ld, a.bias, threadIdx.x & 31);
}

// ---- GEMV: yr[b][16*nt + c] += sum_k xh[b][k] * W_hat[k][16*nt + c] over the block's k-tiles ----
// grid (tiles_n, ksplit, groups), kGemvWarps warps; z = grouped row (nb = 1) or 0. Each warp decodes whole tiles
// in tensor-core order: lane l holds rows {r0, r0+1, r0+8, r0+9} (r0 = 2*(l%4)) of columns l/4 and l/4+8.
struct GemvArgs {
  const uint4* trellis;
  Exl3Group g;
  const float* xh;
  float* yr;
  int in_pad, out_pad, nb, tiles_k, tiles_n, tiles_per_block;
};

template <class Args>
__device__ __forceinline__ const uint4* gemv_weights(const Args& a) {
  return a.g.ids ? static_cast<const uint4*>(group_entry(a.g, blockIdx.z).trellis) : a.trellis;
}

template <int K, int CB>
__global__ __launch_bounds__(kGemvWarps * 32) void gemv_kernel(GemvArgs a) {
  pdl_enter();
  constexpr int kWords = 8 * K;
  extern __shared__ __align__(16) float smem[];
  const int nb = a.nb, xs_stride = a.tiles_per_block * 16;
  float* xs = smem;                                                               // [nb][xs_stride]
  uint32_t* ws = reinterpret_cast<uint32_t*>(xs + nb * xs_stride);                // [warps][unroll][kWords]
  float* red = reinterpret_cast<float*>(ws + kGemvWarps * kGemvUnroll * kWords);  // [warps][8][16]
  const uint4* trellis = gemv_weights(a);
  const float* xh = a.xh + size_t(blockIdx.z) * nb * a.in_pad;
  float* yr = a.yr + size_t(blockIdx.z) * nb * a.out_pad;

  const int nt = blockIdx.x, kt0 = blockIdx.y * a.tiles_per_block;
  const int kt1 = min(a.tiles_k, kt0 + a.tiles_per_block), span = (kt1 - kt0) * 16;
  for (int i = threadIdx.x; i < nb * span; i += blockDim.x) {
    int b = i / span, k = i - b * span;
    xs[b * xs_stride + k] = xh[size_t(b) * a.in_pad + kt0 * 16 + k];
  }
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = (lane & 3) * 2, c0 = lane >> 2;
  uint32_t* wsw = ws + warp * kGemvUnroll * kWords;
  const LanePos<K> pos(lane);
  float acc[8][2];
#pragma unroll
  for (int b = 0; b < 8; ++b) acc[b][0] = acc[b][1] = 0.f;

  constexpr int kStep = kGemvWarps * kGemvUnroll;
  TileRegs<K> next;
  if (kt0 + warp < kt1) load_tiles<K>(trellis, a.tiles_n, nt, kt0 + warp, kt1, lane, next);
  for (int base = kt0 + warp; base < kt1; base += kStep) {
    store_tiles<K>(next, lane, wsw);
    if (base + kStep < kt1) load_tiles<K>(trellis, a.tiles_n, nt, base + kStep, kt1, lane, next);
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      int kt = base + u * kGemvWarps;
      if (kt < kt1) {
        uint32_t st[8];
        pos.states(wsw + u * kWords, st);
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
  reduce_strip(red, nb, yr, a.out_pad, nt);
}

// Same work split, but the lane's 8 decoded fp16 values are exactly its B fragments of two m16n8k16 products
// (columns c0 and c0+8), with the batch rows (<= 8, fp16) as the A operand's M.
template <int K, int CB>
__global__ __launch_bounds__(kGemvWarps * 32) void gemv_mma_kernel(GemvArgs a) {
  pdl_enter();
  constexpr int kWords = 8 * K;
  extern __shared__ __align__(16) float smem[];
  const int nb = a.nb, xs_stride = a.tiles_per_block * 16;
  half* xs = reinterpret_cast<half*>(smem);                                       // [8][xs_stride]
  uint32_t* ws = reinterpret_cast<uint32_t*>(xs + 8 * xs_stride);                 // [warps][unroll][kWords]
  float* red = reinterpret_cast<float*>(ws + kGemvWarps * kGemvUnroll * kWords);  // [warps][8][16]
  const uint4* trellis = gemv_weights(a);
  const float* xh = a.xh + size_t(blockIdx.z) * nb * a.in_pad;
  float* yr = a.yr + size_t(blockIdx.z) * nb * a.out_pad;

  const int nt = blockIdx.x, kt0 = blockIdx.y * a.tiles_per_block;
  const int kt1 = min(a.tiles_k, kt0 + a.tiles_per_block), span = (kt1 - kt0) * 16;
  for (int i = threadIdx.x; i < 8 * span; i += blockDim.x) {
    int b = i / span, k = i - b * span;
    xs[b * xs_stride + k] = b < nb ? __float2half_rn(xh[size_t(b) * a.in_pad + kt0 * 16 + k]) : __float2half_rn(0.f);
  }
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tid = lane & 3;  // fragment row group (= batch row) and thread-in-group
  uint32_t* wsw = ws + warp * kGemvUnroll * kWords;
  const LanePos<K> pos(lane);
  float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};

  constexpr int kStep = kGemvWarps * kGemvUnroll;
  TileRegs<K> next;
  if (kt0 + warp < kt1) load_tiles<K>(trellis, a.tiles_n, nt, kt0 + warp, kt1, lane, next);
  for (int base = kt0 + warp; base < kt1; base += kStep) {
    store_tiles<K>(next, lane, wsw);
    if (base + kStep < kt1) load_tiles<K>(trellis, a.tiles_n, nt, base + kStep, kt1, lane, next);
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      int kt = base + u * kGemvWarps;
      if (kt < kt1) {
        uint32_t st[8];
        pos.states(wsw + u * kWords, st);
        const half* xk = xs + g * xs_stride + (kt - kt0) * 16 + 2 * tid;
        uint32_t a0 = *reinterpret_cast<const uint32_t*>(xk), a2 = *reinterpret_cast<const uint32_t*>(xk + 8);
        mma_m16n8k16_f16(d0, a0, 0u, a2, 0u, decode_state2<CB>(st[0], st[1]), decode_state2<CB>(st[2], st[3]));
        mma_m16n8k16_f16(d1, a0, 0u, a2, 0u, decode_state2<CB>(st[4], st[5]), decode_state2<CB>(st[6], st[7]));
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
  reduce_strip(red, nb, yr, a.out_pad, nt);
}

// ---- one-row GEMV (decode; Auto/Fp32 at nb = 1, plain or grouped): yr[c] (+)= sum_k xh[k] * W_hat[k][c] ----
// The kernels above spend more on staging, syncs and reductions than on the 8 KB of weights a block reads. Here:
// - warp: one panel of P adjacent 16-column strips (P = 8 for K <= 3, else 4) over tiles_per_warp k-tiles. At one
//   k-tile the panel's P tiles are contiguous (32*P*K bytes): lane l loads N = P*K/4 consecutive words, the own bits
//   of trellis positions P*q .. P*q+P-1 (q = l % (32/P)) of tile l / (32/P), i.e. all 16 rows of P/2 of its columns.
//   With the word before that chunk (one shuffle, wrapping within the tile) the lane decodes its 8P states at
//   compile-time bit offsets and keeps whole column sums in registers: no weight staging, no per-tile reduction.
// - latency: D k-tiles of loads in flight per warp (register ring, ~2 KB; 64 KB per SM at 8 blocks), the first D
//   issued before the block stages xh.
// - block: 4 warps = 4/warps_k panels x warps_k consecutive k-ranges (summed through shared memory at the end),
//   sharing the block's xh range in shared memory (read as float4 broadcasts). gemv1_split picks the shape.
// - output: plain stores when the grid has one block row (no k split, no zeroing needed), else atomicAdd into yr.
constexpr int kGemv1Warps = 4;
constexpr int kGemv1Blocks = 8;           // resident blocks per SM the register budget allows (64 a thread)
constexpr int kGemv1MaxBlockTiles = 256;  // k-tiles of xh a block stages (16 KB)
static_assert(kGemv1Warps == 4, "gemv1_kernel splits its 4 warps by shifts");
constexpr int kGemv1ZeroWords = 8;  // after them: zeros, the tensor-core B words of the off-diagonal lanes

__host__ __device__ constexpr int gemv1_positions(int K) { return K <= 3 ? 8 : 4; }
__host__ __device__ constexpr int gemv1_depth(int K) {  // k-tiles in flight per warp (~2 KB, as registers allow)
  return gemv1_positions(K) * K / 4 <= 4 ? 4 : gemv1_positions(K) * K / 4 <= 6 ? 3 : 2;
}

template <int K>
struct Gemv1 {
  static constexpr int P = gemv1_positions(K);                   // positions per lane = tiles = strips per panel
  static constexpr int L = 32 / P;                               // lanes per tile
  static constexpr int N = P * K / 4;                            // words a lane loads per k-tile
  static constexpr int V = N % 4 == 0 ? 4 : N % 2 == 0 ? 2 : 1;  // words per load instruction
  static constexpr int D = gemv1_depth(K);                       // k-tiles in flight per warp
  static constexpr int C = P / 2;                                // output columns per lane
};

struct Gemv1Args {
  const uint4* trellis;
  Exl3Group g;
  const float* xh;
  float* yr;
  int in_pad, out_pad, tiles_k, tiles_n, tiles_per_warp, warps_k;
  // fused (src.x set): the block makes its xh range itself from src (rotate_in's math; the range is whole 128-blocks)
  // and a K split stores part p of row z at yr[p][z] (rotate_out sums the parts) instead of adding atomically.
  Exl3Dev w;
  Exl3Src src;
  // fused with tickets (exl3_gemv_out): y = rotate_out of the parts, made by the last block of each 128 outputs
  unsigned* tickets;  // [groups][out_pad / 128], zero between calls
  float* y;
  int64_t y_ld;
  const float* bias;
};

// A grouped call's entry of this block row (a stacked call's parts share their entries' sets).
__device__ __forceinline__ int gemv1_entry(const Gemv1Args& a) {
  return a.g.part_rows ? int(blockIdx.z) % a.g.part_rows : int(blockIdx.z);
}

template <int K>
__device__ __forceinline__ void gemv1_load(const uint32_t* p, uint32_t (&r)[Gemv1<K>::N]) {
  constexpr int V = Gemv1<K>::V;
#pragma unroll
  for (int j = 0; j < Gemv1<K>::N; j += V) {
    if constexpr (V == 4) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p + j));
      r[j] = v.x, r[j + 1] = v.y, r[j + 2] = v.z, r[j + 3] = v.w;
    } else if constexpr (V == 2) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p + j));
      r[j] = v.x, r[j + 1] = v.y;
    } else {
      r[j] = __ldg(p + j);
    }
  }
}

// The lane's bit stream of one k-tile: the word before its chunk (the previous lane's last), then the chunk.
template <int K>
__device__ __forceinline__ void lane_stream(const uint32_t (&w)[Gemv1<K>::N], int prev_lane,
                                            uint32_t (&b)[Gemv1<K>::N + 1]) {
  b[0] = __shfl_sync(0xffffffffu, w[Gemv1<K>::N - 1], prev_lane);
#pragma unroll
  for (int j = 0; j < Gemv1<K>::N; ++j) b[j + 1] = w[j];
}

// One k-tile: acc[c] += the lane's 8P weights times xk[0..15] (column c: (P/4)*q + c/2 + 8*(c%2) of its tile).
template <int K, int CB>
__device__ __forceinline__ void gemv1_tile(const uint32_t (&w)[Gemv1<K>::N], int prev_lane, const float* xk,
                                           float (&acc)[Gemv1<K>::C]) {
  using G = Gemv1<K>;
  uint32_t b[G::N + 1];
  lane_stream<K>(w, prev_lane, b);
  float x[16];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 v = reinterpret_cast<const float4*>(xk)[j];
    x[4 * j] = v.x, x[4 * j + 1] = v.y, x[4 * j + 2] = v.z, x[4 * j + 3] = v.w;
  }
#pragma unroll
  for (int pp = 0; pp < G::P; ++pp)
#pragma unroll
    for (int i = 0; i < 8; i += 2) {  // states i, i+1: rows r, r+1 of one column
      // weight j's state is the 16 bits ending at its own K bits: stream bit (j+1)*K - 16, +32 for b[0]
      const uint32_t h =
          decode_state2<CB>(stream_bits16(b, (8 * pp + i + 1) * K + 16), stream_bits16(b, (8 * pp + i + 2) * K + 16));
      const float2 f = __half22float2(*reinterpret_cast<const half2*>(&h));
      const int r = 2 * (pp & 3) + 4 * (i & 2), c = 2 * (pp >> 2) + (i >> 2);
      acc[c] = fmaf(x[r], f.x, acc[c]);
      acc[c] = fmaf(x[r + 1], f.y, acc[c]);
    }
}

// gemv1_tile on tensor cores: the lane's decoded pairs are A fragments of m16n8k16 products (A row g = lane/4 holds
// the even column of each pair of the lane quad's columns, row g + 8 the odd one; k = the 4 rows a lane decodes per
// product), B is the k-tile's xh split in fp16 hi and lo parts, nonzero only in lane t's own k slots: column t (hi)
// and t + 4 (lo). So D[g][n] + D[g][n + 4] is lane 4g+n's column sum (accurate to ~fp32: the weights are exact in
// fp16 and hi + lo carries ~22 bits of xh), and the fp32 convert + FMA per weight are gone. xb: the k-tile's B words
// of this lane (zeros on lanes that are not the diagonal ones). V = 2: states by stream_bits16_shared (same values);
// V = 3: also MUL1's raw values (mul1_raw2: the caller makes A times the sums plus C times the inputs' sum).
template <int K, int CB, int V>
__device__ __forceinline__ void gemv1_tile_mma(const uint32_t (&w)[Gemv1<K>::N], int prev_lane, const uint4 (&xb)[2],
                                               float (&d)[Gemv1<K>::C / 2][4]) {
  using G = Gemv1<K>;
  uint32_t b[G::N + 1];
  lane_stream<K>(w, prev_lane, b);
  const uint32_t xw[8] = {xb[0].x, xb[0].y, xb[0].z, xb[0].w, xb[1].x, xb[1].y, xb[1].z, xb[1].w};
#pragma unroll
  for (int pp = 0; pp < G::P; ++pp) {
    uint32_t h[4];  // pairs i = 0, 2, 4, 6: (column even, rows r, r + 1), (even, r + 8), (odd, r), (odd, r + 8)
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const int r0 = (8 * pp + i + 1) * K + 16, r1 = r0 + K;
      if constexpr (V == 1) h[i / 2] = decode_state2<CB>(stream_bits16(b, r0), stream_bits16(b, r1));
      else if constexpr (V == 3 && CB == 2)
        h[i / 2] = mul1_raw2(stream_bits16_shared(b, r0), stream_bits16_shared(b, r1));
      else h[i / 2] = decode_state2<CB>(stream_bits16_shared(b, r0), stream_bits16_shared(b, r1));
    }
    const int p4 = pp & 3;
    mma_m16n8k16_f16(d[pp >> 2], h[0], h[2], h[1], h[3], xw[2 * p4], xw[2 * p4 + 1]);
  }
}

// Variant 4 (MUL1, fused calls): MUL1's unrounded value is A (1024 + bs) + C in the byte sum bs of the state's
// product s * 0x83DCD12D, so a weight times an int8 input is the dot product of the product's four bytes with the
// input splat to four bytes: one m16n8k32 integer MMA takes the products themselves as its A fragments (a0 / a2: two
// rows of the lane's even column, a1 / a3: of its odd column, as gemv1_tile_mma's h words) and the inputs as B, in
// gemv1_tile_mma's diagonal-lane form (hi inputs in column t, lo in t + 4). The block's inputs are int8 hi + lo / 254
// times one scale (gemv1_stage_int8); no byte sum, pairing, fp16 affine or HMMA per weight. xq: per row pair group
// p4 the words of rows 2 p4, 2 p4 + 1, 2 p4 + 8, 2 p4 + 9 (hi or lo splats; zeros off the diagonal).
template <int K>
__device__ __forceinline__ void gemv1_tile_imma(const uint32_t (&w)[Gemv1<K>::N], int prev_lane, const uint4* xq,
                                                int (&d)[Gemv1<K>::C / 2][4]) {
  using G = Gemv1<K>;
  uint32_t b[G::N + 1];
  lane_stream<K>(w, prev_lane, b);
#pragma unroll
  for (int p4 = 0; p4 < 4; ++p4) {
    const uint4 x = xq[p4];
#pragma unroll
    for (int pp = p4; pp < G::P; pp += 4) {
      uint32_t p[8];  // states i: (even column; rows r, r + 1, r + 8, r + 9), then the odd column's (gemv1_tile)
#pragma unroll
      for (int i = 0; i < 8; ++i) p[i] = stream_bits16_shared(b, (8 * pp + i + 1) * K + 16) * 0x83DCD12Du;
      mma_m16n8k32_u8s8(d[pp >> 2], p[0], p[4], p[1], p[5], x.x, x.y);  // rows r, r + 1
      mma_m16n8k32_u8s8(d[pp >> 2], p[2], p[6], p[3], p[7], x.z, x.w);  // rows r + 8, r + 9
    }
  }
}

// Variant 4's shared memory for T k-tiles (words): the rotated inputs [T * 16], the B words [T * 32] (per tile 16 hi
// splats, then 16 lo, each in gemv1_tile_imma's xq order), zeros [16], the tiles' sums of the quantised inputs [T],
// the block's scale [1].
__host__ __device__ constexpr int gemv1_int8_words(int T) { return T * 49 + 17; }

// Variant 4's staging: the block's rotated inputs (smem[0, T * 16), this thread's largest |value| in amax) as
// int8 hi = round(v) and lo = round((v - hi) * 254) of v = x * 127 / max|x| (block-wide), so x = (hi + lo / 254) * u
// with u = max|x| / 127 to ~2^-15 of the largest; their splat words, the tiles' sums of those values and u.
__device__ void gemv1_stage_int8(float* smem, int T, int cap, float amax) {
  __shared__ float wmax[kGemv1Warps];
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  if (lane == 0) wmax[threadIdx.x >> 5] = amax;
  __syncthreads();
  const float top = fmaxf(fmaxf(wmax[0], wmax[1]), fmaxf(wmax[2], wmax[3]));
  const float inv = top > 0.f ? 127.f / top : 0.f, u = top * (1.f / 127.f);
  uint32_t* words = reinterpret_cast<uint32_t*>(smem + cap * 16);
  float* tsum = smem + cap * 48 + 16;
  for (int i = threadIdx.x; i < T * 16; i += blockDim.x) {  // T is whole 128-blocks: every thread takes each turn
    const int t = i >> 4, row = i & 15;
    const float v = smem[i] * inv, hi = rintf(v), lo = rintf((v - hi) * 254.f);
    const int at = t * 32 + ((row & 7) >> 1) * 4 + (row >> 3) * 2 + (row & 1);  // xq order
    words[at] = uint32_t(uint8_t(int8_t(int(hi)))) * 0x01010101u;
    words[at + 16] = uint32_t(uint8_t(int8_t(int(lo)))) * 0x01010101u;
    float q = hi + lo * (1.f / 254.f);
#pragma unroll
    for (int m = 8; m > 0; m >>= 1) q += __shfl_xor_sync(0xffffffffu, q, m);  // the tile's 16 rows: 16 lanes
    if (row == 0) tsum[t] = q * u;
  }
  if (threadIdx.x == 0) tsum[cap] = u;
  if (threadIdx.x < 16) reinterpret_cast<uint32_t*>(smem)[cap * 48 + threadIdx.x] = 0u;
}

// The lane's sums of its C columns from the tensor-core accumulators (see gemv1_tile_mma).
template <int C>
__device__ __forceinline__ void gemv1_mma_sums(const float (&d)[C / 2][4], int lane, float (&acc)[C]) {
  const int n = lane & 3, src = (lane & ~3) + (n >> 1);
#pragma unroll
  for (int q = 0; q < C / 2; ++q)
#pragma unroll
    for (int m = 0; m < 2; ++m) {  // m = 0: column 2q (regs 0, 1), m = 1: column 2q + 1 (regs 2, 3)
      const float v0 = __shfl_sync(0xffffffffu, d[q][2 * m], src), v1 = __shfl_sync(0xffffffffu, d[q][2 * m + 1], src);
      const float u0 = __shfl_sync(0xffffffffu, d[q][2 * m], src + 2);
      const float u1 = __shfl_sync(0xffffffffu, d[q][2 * m + 1], src + 2);
      acc[2 * q + m] = (n & 1) ? v1 + u1 : v0 + u0;
    }
}

// Fused calls with tickets: each block, once its outputs [c0, c0 + width) of row z are stored, draws a ticket for
// every 128 outputs they touch; the last of the grid's blocks to draw one (all K parts, every x block over them)
// sums those parts, rotates and scales them into y (rotate_out_warp, a warp per 128) and re-arms the ticket.
__device__ void gemv1_rotate_out(const Gemv1Args& a, int width) {
  __shared__ int last[kGemv1Warps];
  const int z = blockIdx.z, c0 = blockIdx.x * width, c1 = min(a.out_pad, c0 + width);
  const int g0 = c0 / 128, ng = (c1 - 1) / 128 - g0 + 1;  // <= 4: width <= 4 panels of 128
  const unsigned arrivals = gridDim.y * unsigned(max(1, 128 / width));
  __threadfence();  // this block's parts, before its tickets
  __syncthreads();
  if (threadIdx.x < ng) {
    unsigned* t = a.tickets + size_t(z) * (a.out_pad / 128) + g0 + threadIdx.x;
    const bool mine = atomicAdd(t, 1u) == arrivals - 1;
    if (mine) *t = 0u;  // every arrival of this call has counted: ready for the next call
    last[threadIdx.x] = mine;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5;
  if (warp >= ng || !last[warp]) return;
  __threadfence();  // the other blocks' parts, after their tickets
  rotate_out_warp<true>(a.w, a.g, a.yr, gridDim.z, z, gridDim.y, g0 + warp, a.y, a.y_ld, a.bias, threadIdx.x & 31);
}

// A warp's place in a launch of gemv1_kernel or gemv1r_kernel: a block holds warps_k k-ranges (wk) of tpw k-tiles
// for each of its wp = 4 / wk panels; this warp (k-range ksub) takes k-tiles [kt0, kt0 + nkt) of the block's
// [kb0, kb1) in its panel (nkt = 0 past the last panel).
struct Gemv1Place {
  int wk, wp, ksub, tpw, panel, kb0, kb1, kt0, nkt;
  __device__ __forceinline__ Gemv1Place(const Gemv1Args& a, int warp, int P) {
    const int wp_log = 2 - (a.warps_k >> 1);  // warps_k is 1, 2 or 4: shifts instead of divisions
    wk = a.warps_k, wp = 1 << wp_log, ksub = warp >> wp_log, tpw = a.tiles_per_warp;
    panel = blockIdx.x * wp + (warp & (wp - 1));
    kb0 = blockIdx.y * wk * tpw, kb1 = min(a.tiles_k, kb0 + wk * tpw);
    kt0 = min(kb1, kb0 + ksub * tpw), nkt = panel < a.tiles_n / P ? min(kb1, kt0 + tpw) - kt0 : 0;
  }
};

// The warp's weights: its first D k-tiles in the ring (loads in flight from the start), then k-tile u + D into
// ring slot u % D as slot u is consumed (refill).
template <int K>
struct Gemv1Ring {
  using G = Gemv1<K>;
  uint32_t ring[G::D][G::N];
  const uint32_t* next;
  size_t step;
  __device__ __forceinline__ Gemv1Ring(const Gemv1Args& a, const Gemv1Place& p, int lane) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(gemv_weights(a)) +
                          (size_t(p.kt0) * a.tiles_n + size_t(p.panel) * G::P) * (8 * K) + lane * G::N;
    step = size_t(a.tiles_n) * (8 * K);
#pragma unroll
    for (int u = 0; u < G::D; ++u)
      if (u < p.nkt) gemv1_load<K>(src + u * step, ring[u]);
    next = src + G::D * step;
  }
  __device__ __forceinline__ void refill(int u) {
    gemv1_load<K>(next, ring[u]);
    next += step;
  }
};

// kMma: V = 1, 2, 3 or 5 as gemv1_tile_mma; 4: gemv1_tile_imma (MUL1, fused calls only).
template <int K, int CB, bool kMma, int V = 1>
__global__ __launch_bounds__(kGemv1Warps * 32, kGemv1Blocks) void gemv1_kernel(Gemv1Args a) {
  using G = Gemv1<K>;
  constexpr bool kInt8 = kMma && V == 4 && CB == 2;
  extern __shared__ __align__(16) float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const Gemv1Place pl(a, warp, G::P);
  const int wk = pl.wk, wp = pl.wp, ksub = pl.ksub, tpw = pl.tpw, panel = pl.panel, kb0 = pl.kb0, kb1 = pl.kb1,
            kt0 = pl.kt0, nkt = pl.nkt;

  // first D k-tiles of weights in flight before xh is staged; a plain call's weights also before the previous
  // kernel finishes (pdl.cuh: nothing in the stream writes them), a grouped call's table rows come from routing
  if (a.g.ids) pdl_enter();
  Gemv1Ring<K> w(a, pl, lane);
  if (!a.g.ids) pdl_enter();

  if (a.src.x) {  // fused: x ⊙ suh over the range by all threads (loads in flight), then a warp per 128-block rotates
    const RowIn r = row_in(a.w, a.g, a.src, blockIdx.z);
    float4* x4 = reinterpret_cast<float4*>(smem);
#pragma unroll 4
    for (int i = threadIdx.x; i < (kb1 - kb0) * 4; i += blockDim.x) x4[i] = scaled_in4(a.w, a.src, r, kb0 * 16 + 4 * i);
    __syncthreads();
    float amax = 0.f;  // (variant 4) this thread's largest |value|
    for (int b = warp; b < (kb1 - kb0) / 8; b += kGemv1Warps) {
      float4 h = x4[b * 32 + lane];
      hadamard128_lane(h, lane);
      if constexpr (kInt8) {
        x4[b * 32 + lane] = h;
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(h.x), fabsf(h.y)), fmaxf(fabsf(h.z), fabsf(h.w))));
      } else if constexpr (kMma) {  // lane's rows 4q..4q+3 of tile lane / 4: hi/lo words 4(q%2) + q/2 and 2 more
        __syncwarp();        // (the tile's 4 lanes have read their floats)
        const int t = b * 8 + lane / 4, q = lane & 3, j = 4 * (q & 1) + (q >> 1);
        uint32_t* xw = reinterpret_cast<uint32_t*>(smem) + t * 16;
        split_half2(h.x, h.y, xw[j], xw[8 + j]);
        split_half2(h.z, h.w, xw[j + 2], xw[8 + j + 2]);
      } else {
        x4[b * 32 + lane] = h;
      }
    }
    if constexpr (kInt8) {
      __syncthreads();  // every block's rotated values in place
      gemv1_stage_int8(smem, kb1 - kb0, wk * tpw, amax);
    }
  } else if constexpr (kMma && !kInt8) {
    // per k-tile: 8 hi words (pairs of rows 2p, 2p + 1 and 2p + 8, 2p + 9), then 8 lo
    const float* xg = a.xh + size_t(blockIdx.z) * a.in_pad + kb0 * 16;
    uint32_t* xw = reinterpret_cast<uint32_t*>(smem);
    for (int i = threadIdx.x; i < (kb1 - kb0) * 8; i += blockDim.x) {
      const int t = i >> 3, j = i & 7, r = t * 16 + 2 * (j >> 1) + 8 * (j & 1);
      split_half2(xg[r], xg[r + 1], xw[t * 16 + j], xw[t * 16 + 8 + j]);
    }
  } else {
    const float4* xg = reinterpret_cast<const float4*>(a.xh + size_t(blockIdx.z) * a.in_pad + kb0 * 16);
    for (int i = threadIdx.x; i < (kb1 - kb0) * 4; i += blockDim.x) reinterpret_cast<float4*>(smem)[i] = xg[i];
  }
  float* zero = smem + wk * tpw * 16;  // kGemv1ZeroWords zeros: the B words of the lanes off the diagonal
  if (kMma && !kInt8 && threadIdx.x < kGemv1ZeroWords) zero[threadIdx.x] = 0.f;
  __syncthreads();

  const int prev_lane = lane % G::L == 0 ? lane + G::L - 1 : lane - 1;
  const float* xs = smem + (kt0 - kb0) * 16;
  float acc[G::C];
#pragma unroll
  for (int c = 0; c < G::C; ++c) acc[c] = 0.f;
  float d[G::C / 2][4] = {};
  int di[G::C / 2][4] = {};  // (variant 4)
  // tensor cores: lanes 0, 5, 10, 15 read the hi words, 16, 21, 26, 31 the lo words, the others hold zeros
  const int diag = (lane >> 2) == (lane & 3) ? 0 : (lane >> 2) == (lane & 3) + 4 ? 8 : -1;
  const uint4* xsrc = reinterpret_cast<const uint4*>(diag >= 0 ? xs + diag : zero);
  const int xstep = diag >= 0 ? 4 : 0;  // uint4 per k-tile
  // variant 4: 32 words per k-tile (16 hi, 16 lo) after the rotated inputs, zeros after them
  const int cap = wk * tpw;
  const uint4* qsrc = reinterpret_cast<const uint4*>(diag >= 0 ? smem + cap * 16 + (kt0 - kb0) * 32 + (diag ? 16 : 0)
                                                               : smem + cap * 48);
  const int qstep = diag >= 0 ? 8 : 0;  // uint4 per k-tile
  for (int k = 0; k < nkt; k += G::D) {
#pragma unroll
    for (int u = 0; u < G::D; ++u)
      if (k + u < nkt) {
        if constexpr (kInt8) {
          gemv1_tile_imma<K>(w.ring[u], prev_lane, qsrc + (k + u) * qstep, di);
        } else if constexpr (kMma) {
          const uint4* src = xsrc + (k + u) * xstep;
          const uint4 xb[2] = {src[0], src[1]};
          gemv1_tile_mma<K, CB, V>(w.ring[u], prev_lane, xb, d);
        } else {
          gemv1_tile<K, CB>(w.ring[u], prev_lane, xs + (k + u) * 16, acc);
        }
        if (k + u + G::D < nkt) w.refill(u);
      }
  }
  if constexpr (kInt8) {  // d = the int sums, lo columns (n >= 4: lanes t >= 2) / 254; then A (u D + 1024 Sx) + C Sx
    const float lo = (lane & 3) >= 2 ? 1.f / 254.f : 1.f;
#pragma unroll
    for (int q = 0; q < G::C / 2; ++q)
#pragma unroll
      for (int j = 0; j < 4; ++j) d[q][j] = float(di[q][j]) * lo;
  }
  if constexpr (kMma) gemv1_mma_sums<G::C>(d, lane, acc);
  if constexpr (kInt8) {
    const float* tsum = smem + cap * 48 + 16;
    float sx = 0.f;  // this warp's quantised inputs, summed
    for (int i = lane; i < nkt; i += 32) sx += tsum[kt0 - kb0 + i];
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) sx += __shfl_xor_sync(0xffffffffu, sx, m);
    const float scale = tsum[cap];
#pragma unroll
    for (int c = 0; c < G::C; ++c) acc[c] = kMul1A * fmaf(scale, acc[c], 1024.f * sx) + kMul1C * sx;
  }
  if constexpr (kMma && V == 3 && CB == 2) {  // raw MUL1 values: A times the sums plus C times this range's inputs
    const uint32_t* xw = reinterpret_cast<const uint32_t*>(xs);  // 16 words (hi, lo halves) per k-tile
    float sx = 0.f;
    for (int i = lane; i < nkt * 16; i += 32) {
      const float2 f = __half22float2(*reinterpret_cast<const half2*>(xw + i));
      sx += f.x + f.y;
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) sx += __shfl_xor_sync(0xffffffffu, sx, m);
#pragma unroll
    for (int c = 0; c < G::C; ++c) acc[c] = fmaf(kMul1A, acc[c], kMul1C * sx);
  }

  // Without tickets a warp with nothing to store leaves; with them every thread goes on to gemv1_rotate_out's
  // barriers (one call site for the whole block).
  bool live = true;
  if (wk > 1) {  // sum the block's k-ranges of each panel (red: [warps][C][32] after the xh range)
    float* red = smem + (kInt8 ? gemv1_int8_words(cap) : wk * tpw * 16 + kGemv1ZeroWords);
#pragma unroll
    for (int c = 0; c < G::C; ++c) red[(warp * G::C + c) * 32 + lane] = acc[c];
    __syncthreads();
    if (ksub) {
      if (!a.tickets) return;
      live = false;
    } else {
#pragma unroll
      for (int c = 0; c < G::C; ++c) {
        float v = acc[c];
        for (int j = 1; j < wk; ++j) v += red[((j * wp + warp) * G::C + c) * 32 + lane];
        acc[c] = v;
      }
    }
  }
  if (live && panel >= a.tiles_n / G::P) {
    if (!a.tickets) return;
    live = false;
  }
  if (live) {
    float* y = a.yr + size_t(blockIdx.z) * a.out_pad + (panel * G::P + lane / G::L) * 16 + (G::P / 4) * (lane % G::L);
    if (a.src.x) y += size_t(blockIdx.y) * gridDim.z * a.out_pad;  // fused: this K part's slice
#pragma unroll
    for (int c = 0; c < G::C; ++c) {
      float* yc = y + (c >> 1) + 8 * (c & 1);
      if (gridDim.y == 1 || a.src.x) *yc = acc[c];
      else atomicAdd(yc, acc[c]);
    }
  }
  if (a.tickets) gemv1_rotate_out(a, wp * G::P * 16);
}

// ---- R-row GEMV (MTP verifies, batched decode steps: 2..4 rows per weight) ----
// gemv1_kernel's tensor-core loop (variant 2, rotated fp32 input rows, a K split adds atomically), but the decoded A
// fragments, ~5 of its 6 instructions per weight, serve R rows: one m16n8k16 product per row, each with that row's
// diagonal B words (hi, lo), staged per k-tile as [R][16] words. Rows past the call's count are zeros. Grouped calls
// (sets): block row z serves the rows of its set, the entries that share its weights (exl3_row_sets); an empty set
// (an entry another one leads) leaves at once.
// Resident blocks per SM the launch bound asks for. R = 2: 8 (64 registers, as the one-row kernel, no spill), except
// K = 1, whose 3INST / MCG kernels spill 20-40 bytes at 8 and 4 at 6: 6 there. R = 4: 4 (up to 128 registers).
// H100 (docs/perf-cuda.md, thirty-second round): R = 2 at 8 ran 7-15% faster than at 6; R = 4 at 6-8 ran 19-30%
// slower than at 4.
__host__ __device__ constexpr int gemv1r_blocks(int K, int R) { return R > 2 ? 4 : K == 1 ? 6 : 8; }
constexpr int kGemv1rMaxBlockTiles = 64;  // k-tiles a block stages (R = 4: 16 KB)

template <int K, int CB, int R>
__device__ __forceinline__ void gemv1r_tile(const uint32_t (&w)[Gemv1<K>::N], int prev_lane, const uint2* xs, int xrow,
                                            int n, float (&d)[R][Gemv1<K>::C / 2][4]) {
  using G = Gemv1<K>;
  uint32_t b[G::N + 1];
  lane_stream<K>(w, prev_lane, b);
#pragma unroll
  for (int p4 = 0; p4 < 4; ++p4) {  // the rows' B words of pair group p4 serve positions p4 and p4 + 4
    uint2 x[R];
#pragma unroll
    for (int r = 0; r < R; ++r) x[r] = xs[r * xrow + p4];
#pragma unroll
    for (int pp = p4; pp < G::P; pp += 4) {
      uint32_t h[4];  // gemv1_tile_mma's pairs
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const int r0 = (8 * pp + i + 1) * K + 16, r1 = r0 + K;
        h[i / 2] = decode_state2<CB>(stream_bits16_shared(b, r0), stream_bits16_shared(b, r1));
      }
#pragma unroll
      for (int r = 0; r < R; ++r)  // (rows past the block's n hold zeros: no product; n is the same in the block)
        if (r < n) mma_m16n8k16_f16(d[r][pp >> 2], h[0], h[2], h[1], h[3], x[r].x, x[r].y);
    }
  }
}

template <int K, int CB, int R>
__global__ __launch_bounds__(kGemv1Warps * 32, gemv1r_blocks(K, R)) void gemv1r_kernel(Gemv1Args a, int rows,
                                                                                       const Exl3RowSet* sets) {
  using G = Gemv1<K>;
  extern __shared__ __align__(16) float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // a grouped call's table rows and sets come from routing (pdl.cuh); a plain call's weights may load before
  if (a.g.ids) pdl_enter();
  // this block's rows of xh / yr: 0 .. rows - 1, or its set's entries (in its part of a stacked call)
  int n = rows, base = 0;
  const int32_t* set_rows = nullptr;
  if (sets) {
    const int z = blockIdx.z, e = gemv1_entry(a);
    n = sets[e].count;
    if (n == 0) return;  // another entry leads this one's weights
    set_rows = sets[e].rows, base = z - e;
  }
  auto row_of = [&](int r) { return set_rows ? base + set_rows[r] : r; };
  const Gemv1Place pl(a, warp, G::P);
  const int wk = pl.wk, wp = pl.wp, ksub = pl.ksub, panel = pl.panel, kb0 = pl.kb0, kb1 = pl.kb1, kt0 = pl.kt0,
            nkt = pl.nkt;
  Gemv1Ring<K> w(a, pl, lane);
  if (!a.g.ids) pdl_enter();

  // per k-tile and row: 8 hi words (pairs of rows 2p, 2p + 1 and 2p + 8, 2p + 9), then 8 lo
  uint32_t* xw = reinterpret_cast<uint32_t*>(smem);
  for (int i = threadIdx.x; i < (kb1 - kb0) * 8 * R; i += blockDim.x) {
    const int t = i / (8 * R), r = (i >> 3) % R, j = i & 7, e = (kb0 + t) * 16 + 2 * (j >> 1) + 8 * (j & 1);
    uint32_t hi = 0u, lo = 0u;
    if (r < n) {
      const float* xg = a.xh + size_t(row_of(r)) * a.in_pad;
      split_half2(xg[e], xg[e + 1], hi, lo);
    }
    xw[(t * R + r) * 16 + j] = hi;
    xw[(t * R + r) * 16 + 8 + j] = lo;
  }
  const int cap = wk * pl.tpw;
  float* zero = smem + cap * R * 16;  // the B words of the lanes off the diagonal
  if (threadIdx.x < kGemv1ZeroWords) zero[threadIdx.x] = 0.f;
  __syncthreads();

  const int prev_lane = lane % G::L == 0 ? lane + G::L - 1 : lane - 1;
  float d[R][G::C / 2][4] = {};
  const int diag = (lane >> 2) == (lane & 3) ? 0 : (lane >> 2) == (lane & 3) + 4 ? 8 : -1;
  const uint2* xsrc = reinterpret_cast<const uint2*>(diag >= 0 ? smem + (kt0 - kb0) * R * 16 + diag : zero);
  const int xrow = diag >= 0 ? 8 : 0, xstep = R * xrow;  // uint2 per row, per k-tile
  for (int k = 0; k < nkt; k += G::D) {
#pragma unroll
    for (int u = 0; u < G::D; ++u)
      if (k + u < nkt) {
        gemv1r_tile<K, CB, R>(w.ring[u], prev_lane, xsrc + (k + u) * xstep, xrow, n, d);
        if (k + u + G::D < nkt) w.refill(u);
      }
  }
  float acc[R][G::C];
#pragma unroll
  for (int r = 0; r < R; ++r) gemv1_mma_sums<G::C>(d[r], lane, acc[r]);
  if (wk > 1) {  // sum the block's k-ranges of each panel (red: [R][warps][C][32] after the staged rows and zeros)
    float* red = smem + cap * R * 16 + kGemv1ZeroWords;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < G::C; ++c) red[((r * kGemv1Warps + warp) * G::C + c) * 32 + lane] = acc[r][c];
    __syncthreads();
    if (ksub) return;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < G::C; ++c)
        for (int j = 1; j < wk; ++j) acc[r][c] += red[((r * kGemv1Warps + j * wp + warp) * G::C + c) * 32 + lane];
  }
  if (panel >= a.tiles_n / G::P) return;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= n) break;
    float* y = a.yr + size_t(row_of(r)) * a.out_pad + (panel * G::P + lane / G::L) * 16 + (G::P / 4) * (lane % G::L);
#pragma unroll
    for (int c = 0; c < G::C; ++c) {
      float* yc = y + (c >> 1) + 8 * (c & 1);
      if (gridDim.y == 1) *yc = acc[r][c];
      else atomicAdd(yc, acc[r][c]);
    }
  }
}

// exl3_row_sets: one block; entry i leads a set when the entries of its id ahead of it fill whole sets.
__global__ void row_sets_kernel(const int32_t* ids, int m, Exl3RowSet* sets) {
  pdl_enter();
  for (int i = threadIdx.x; i < m; i += blockDim.x) {
    const int id = ids[i];
    int before = 0;  // entries of this id ahead of i: i leads the next set when they fill whole sets
    for (int j = 0; j < i; ++j) before += ids[j] == id;
    Exl3RowSet s{};
    if (before % kExl3SetRows == 0)
      for (int j = i; j < m && s.count < kExl3SetRows; ++j)
        if (ids[j] == id) s.rows[s.count++] = j;
    sets[i] = s;
  }
}

// ---- dequant: W_hat columns of tiles [nt0, nt0 + nts) as fp16, row-major [in_pad][16 * nts] ----
// A warp takes one k-tile over kDequantTiles adjacent 16-column strips (their trellis words are contiguous: all the
// loads in flight at once), decodes the lane's 8 states of each into a shared [16][16 * kDequantTiles] row block, and
// writes each of its 16 rows as one contiguous run of 16-byte stores. (The form with one warp per 16x16 tile waited on
// each tile's loads alone: 12.3 us per 2048x4096 expert on an H100, this form 7.8 us on an H200; docs/perf-cuda.md,
// twelfth round.)
constexpr int kDequantTiles = 8, kDequantWarps = 4;
constexpr int kDequantRowHalves = 16 * kDequantTiles + 8;  // + 8: 16-byte rows whose stores hit distinct banks
template <int K, int CB>
__global__ void __launch_bounds__(kDequantWarps * 32)
    dequant_kernel(const uint4* __restrict__ trellis, int tiles_n, int tiles_k, int nt0, int nts,
                   half* __restrict__ out) {
  pdl_enter();
  constexpr int kWords = 8 * K, kChunks = 2 * K, T = kDequantTiles, kLoads = (T * kChunks + 31) / 32;
  __shared__ __align__(16) uint32_t ws[kDequantWarps][T][kWords];
  __shared__ __align__(16) half rows_s[kDequantWarps][16][kDequantRowHalves];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kt = blockIdx.y * kDequantWarps + warp, j0 = blockIdx.x * T;
  if (kt >= tiles_k) return;
  const int nj = min(T, nts - j0);
  const uint4* src = trellis + (size_t(kt) * tiles_n + nt0 + j0) * kChunks;  // the nj tiles, contiguous
  uint4 r[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int c = lane + 32 * i;
    r[i] = make_uint4(0, 0, 0, 0);
    if (c < T * kChunks && c < nj * kChunks) r[i] = __ldg(src + c);
  }
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int c = lane + 32 * i;
    if (c < T * kChunks) reinterpret_cast<uint4*>(ws[warp])[c] = r[i];
  }
  __syncwarp();
  const LanePos<K> pos(lane);
  const int r0 = (lane & 3) * 2, c0 = lane >> 2;
  const int rows[4] = {r0, r0 + 1, r0 + 8, r0 + 9};
#pragma unroll 2
  for (int u = 0; u < T; ++u) {
    if (u >= nj) break;
    uint32_t st[8];
    pos.states(ws[warp][u], st);
#pragma unroll
    for (int i = 0; i < 8; ++i) rows_s[warp][rows[i & 3]][16 * u + c0 + (i >= 4 ? 8 : 0)] = decode_state<CB>(st[i]);
  }
  __syncwarp();
  const int runs = 2 * nj;  // 16-byte pieces of a row
  for (int i = lane; i < 16 * runs; i += 32) {
    const int rr = i / runs, q = i - rr * runs;
    *reinterpret_cast<uint4*>(out + size_t(16 * kt + rr) * (16 * nts) + 16 * j0 + 8 * q) =
        *reinterpret_cast<const uint4*>(&rows_s[warp][rr][8 * q]);
  }
}

using GemvFn = void (*)(GemvArgs);
using DequantFn = void (*)(const uint4*, int, int, int, int, half*);

#define EXL3_K_TABLE(fn, cb) \
  { &fn<1, cb>, &fn<2, cb>, &fn<3, cb>, &fn<4, cb>, &fn<5, cb>, &fn<6, cb>, &fn<7, cb>, &fn<8, cb> }
const GemvFn kGemv[3][8] = {EXL3_K_TABLE(gemv_kernel, 0), EXL3_K_TABLE(gemv_kernel, 1), EXL3_K_TABLE(gemv_kernel, 2)};
const GemvFn kGemvMma[3][8] = {EXL3_K_TABLE(gemv_mma_kernel, 0), EXL3_K_TABLE(gemv_mma_kernel, 1),
                               EXL3_K_TABLE(gemv_mma_kernel, 2)};
using Gemv1Fn = void (*)(Gemv1Args);
#define EXL3_K_TABLE_MMA(fn, cb, mma)                                                                     \
  {                                                                                                       \
    &fn<1, cb, mma>, &fn<2, cb, mma>, &fn<3, cb, mma>, &fn<4, cb, mma>, &fn<5, cb, mma>, &fn<6, cb, mma>, \
        &fn<7, cb, mma>, &fn<8, cb, mma>                                                                  \
  }
#define EXL3_K_TABLE_V(fn, cb, v)                                                                            \
  {                                                                                                          \
    &fn<1, cb, true, v>, &fn<2, cb, true, v>, &fn<3, cb, true, v>, &fn<4, cb, true, v>, &fn<5, cb, true, v>, \
        &fn<6, cb, true, v>, &fn<7, cb, true, v>, &fn<8, cb, true, v>                                        \
  }
// [fp32 FMAs, tensor cores V = 1, 2, 3, 4][codebook][K - 1] (V = 3, 4 differ from 2 for MUL1 only)
const Gemv1Fn kGemv1[5][3][8] = {
    {EXL3_K_TABLE_MMA(gemv1_kernel, 0, false), EXL3_K_TABLE_MMA(gemv1_kernel, 1, false),
     EXL3_K_TABLE_MMA(gemv1_kernel, 2, false)},
    {EXL3_K_TABLE_MMA(gemv1_kernel, 0, true), EXL3_K_TABLE_MMA(gemv1_kernel, 1, true),
     EXL3_K_TABLE_MMA(gemv1_kernel, 2, true)},
    {EXL3_K_TABLE_V(gemv1_kernel, 0, 2), EXL3_K_TABLE_V(gemv1_kernel, 1, 2), EXL3_K_TABLE_V(gemv1_kernel, 2, 2)},
    {EXL3_K_TABLE_V(gemv1_kernel, 0, 2), EXL3_K_TABLE_V(gemv1_kernel, 1, 2), EXL3_K_TABLE_V(gemv1_kernel, 2, 3)},
    {EXL3_K_TABLE_V(gemv1_kernel, 0, 2), EXL3_K_TABLE_V(gemv1_kernel, 1, 2), EXL3_K_TABLE_V(gemv1_kernel, 2, 4)}};
#undef EXL3_K_TABLE_V
#undef EXL3_K_TABLE_MMA
using Gemv1rFn = void (*)(Gemv1Args, int, const Exl3RowSet*);
#define EXL3_K_TABLE_R(cb, r)                                                                                  \
  {                                                                                                            \
    &gemv1r_kernel<1, cb, r>, &gemv1r_kernel<2, cb, r>, &gemv1r_kernel<3, cb, r>, &gemv1r_kernel<4, cb, r>,    \
        &gemv1r_kernel<5, cb, r>, &gemv1r_kernel<6, cb, r>, &gemv1r_kernel<7, cb, r>, &gemv1r_kernel<8, cb, r> \
  }
// [R = 2, 4][codebook][K - 1]
const Gemv1rFn kGemv1r[2][3][8] = {{EXL3_K_TABLE_R(0, 2), EXL3_K_TABLE_R(1, 2), EXL3_K_TABLE_R(2, 2)},
                                   {EXL3_K_TABLE_R(0, 4), EXL3_K_TABLE_R(1, 4), EXL3_K_TABLE_R(2, 4)}};
#undef EXL3_K_TABLE_R
const DequantFn kDequant[3][8] = {EXL3_K_TABLE(dequant_kernel, 0), EXL3_K_TABLE(dequant_kernel, 1),
                                  EXL3_K_TABLE(dequant_kernel, 2)};
#undef EXL3_K_TABLE

void check_shape(const Exl3Dev& w) {
  if (w.K < 1 || w.K > 8 || w.cb < 0 || w.cb > 2 || w.in_pad <= 0 || w.out_pad <= 0 || w.in_pad % 128 ||
      w.out_pad % 128)
    throw std::runtime_error("EXL3: unsupported shape, K or codebook");
}

// The nb = 1 kernel's k split (warps_k k-ranges of tiles_per_warp per block, kblocks block rows): the least time in
// a model in SM clocks: HBM latency + the largest of the SM's issue time (~7 instructions per weight, less efficient
// with fewer resident blocks, +1 k-tile per warp of block overhead), one warp's latency chain (D k-tiles per latency)
// and the HBM time; plus the atomics (~256 per clock) of a k split. Resident blocks per SM: exl3_gemv_blocks_per_sm()
// (default 8 = kGemv1Blocks).
struct Gemv1Split {
  int warps_k, tiles_per_warp, kblocks;
};
// MOESRV_EXL3_GEMV1_SPLIT=<warps_k>x<tiles_per_warp> forces the shape (correctness runs: the checks' small weights
// otherwise all take one; cuda_kernel_bench --split-sweep), read at each call (host side, once per captured launch).
Gemv1Split forced_gemv1_split() {
  const char* v = std::getenv("MOESRV_EXL3_GEMV1_SPLIT");
  int wk = 0, tpw = 0;
  if (v && std::sscanf(v, "%dx%d", &wk, &tpw) == 2 && (wk == 1 || wk == 2 || wk == 4) && tpw >= 1 &&
      wk * tpw <= kGemv1MaxBlockTiles)
    return Gemv1Split{wk, tpw, 0};
  return Gemv1Split{0, 0, 0};
}
// max_parts > 0 (the fused kernel): each block's k-range is whole 128-blocks, at most max_parts of them per row.
// rows > 1: gemv1r_kernel's split (its resident blocks, smaller staging, a product per row per 256 weights).
Gemv1Split gemv1_split(const Exl3Dev& w, int groups, int max_parts = 0, int rows = 1) {
  const bool aligned = max_parts > 0;
  const int K = w.K, P = gemv1_positions(K), tk = w.in_pad / 16, panels = w.out_pad / 16 / P;
  const int max_tiles = rows > 1 ? kGemv1rMaxBlockTiles : kGemv1MaxBlockTiles;
  const Gemv1Split forced = forced_gemv1_split();
  // tiles per warp a multiple of `unit` keeps a block's range whole 128-blocks (8 k-tiles)
  auto unit = [&](int wk) { return aligned ? 8 / std::min(wk, 8) : 1; };
  if (forced.warps_k) {
    const int u = unit(forced.warps_k), tpw = (forced.tiles_per_warp + u - 1) / u * u, span = forced.warps_k * tpw;
    if ((!aligned || (tk + span - 1) / span <= max_parts) && span <= max_tiles)
      return {forced.warps_k, tpw, (tk + span - 1) / span};
  }
  const long sms = exl3_sm_count(), res = rows > 1 ? gemv1r_blocks(K, rows <= 2 ? 2 : 4) : exl3_gemv_blocks_per_sm();
  // The model and the wave rule keep <= 16 K parts: up to 64 (forced splits) moved no decode shape by more than the
  // sweep's spread (docs/perf-cuda.md, thirtieth round).
  max_parts = std::min(max_parts, 16);
  if (aligned) {
    // Calls of a wave or more of blocks at 2 k-ranges of 16 tiles take that split: in the sweep of the decode shapes
    // (docs/perf-cuda.md) it beat the model's choice on each of them, by up to 11% (finer blocks fill the last wave,
    // which the model ignores); smaller calls keep the model's choice, which was the best there.
    const int kb = (tk + 31) / 32;
    if (kb <= max_parts && long((panels + 1) / 2) * kb * groups >= sms * res) return {2, 16, kb};
  }
  const double lat = 1500, kt_issue = 256.0 * P * (7 + (rows - 1) / 8.0) / 128,
               hbm = double(tk) * panels * groups * P * 32 * K / 2000;
  Gemv1Split best{1, tk, 1};
  double best_cost = -1;
  for (int wk = 1; wk <= kGemv1Warps; wk *= 2) {
    const long bx = (panels + kGemv1Warps / wk - 1) / (kGemv1Warps / wk);
    for (int sb = 1;; ++sb) {
      const int u = unit(wk), tpw = ((tk + wk * sb - 1) / (wk * sb) + u - 1) / u * u;
      const int kb = (tk + wk * tpw - 1) / (wk * tpw);
      const long per_sm = (bx * kb * groups + sms - 1) / sms, waves = (per_sm + res - 1) / res;
      const double b = double(std::min(per_sm, res)), issue = per_sm * 4.0 * (tpw + 1) * kt_issue * (b + 1.5) / b;
      const double cost = lat + std::max({issue, waves * tpw * lat / gemv1_depth(K), hbm}) +
                          (kb > 1 ? double(panels) * groups * P * 16 * kb / 256 : 0);
      if (wk * tpw <= max_tiles && (!aligned || kb <= max_parts) && (best_cost < 0 || cost < best_cost))
        best = {wk, tpw, kb}, best_cost = cost;
      if (tpw <= unit(wk) || per_sm > 4 * res) break;
    }
  }
  if (rows > 1 && best.warps_k * best.tiles_per_warp > max_tiles)  // (no candidate fit the row kernel's staging)
    best = {1, max_tiles, (tk + max_tiles - 1) / max_tiles};
  return best;
}

// Comparison switches, read once: MOESRV_EXL3_GEMV1_FMA=1: the one-row kernel sums with fp32 FMAs instead of tensor
// cores; MOESRV_EXL3_GEMV1_VARIANT=1..4: its tensor-core loop's V (gemv1_tile_mma, 4: gemv1_tile_imma; default 2);
// MOESRV_EXL3_GEMV_V1=1: the first GEMV kernel; MOESRV_EXL3_GEMV_UNFUSED=1: rotate the input first.
bool exl3_gemv1_fma() {
  static const bool on = env_flag("MOESRV_EXL3_GEMV1_FMA");
  return on;
}

bool exl3_gemv_v1() {
  static const bool on = env_flag("MOESRV_EXL3_GEMV_V1");
  return on;
}
bool exl3_gemv_unfused() {
  static const bool on = env_flag("MOESRV_EXL3_GEMV_UNFUSED");
  return on;
}

// The output rotation fused in where exl3_gemv_out has tickets: y, its rows' stride, the bias.
struct Gemv1Out {
  unsigned* tickets = nullptr;
  float* y = nullptr;
  int64_t y_ld = 0;
  const float* bias = nullptr;
};

// The one-row and R-row kernels' arguments and grid for split sp over `groups` block rows.
Gemv1Args gemv1_args(const Exl3Dev& w, Exl3Group g, const float* xh, float* yr, const Gemv1Split& sp, Exl3Src src = {},
                     const Gemv1Out& out = {}) {
  return Gemv1Args{static_cast<const uint4*>(w.trellis),
                   g,
                   xh,
                   yr,
                   w.in_pad,
                   w.out_pad,
                   w.in_pad / 16,
                   w.out_pad / 16,
                   sp.tiles_per_warp,
                   sp.warps_k,
                   w,
                   src,
                   out.tickets,
                   out.y,
                   out.y_ld,
                   out.bias};
}
dim3 gemv1_grid(const Exl3Dev& w, const Gemv1Split& sp, int groups) {
  const int panels = w.out_pad / 16 / gemv1_positions(w.K), ppb = kGemv1Warps / sp.warps_k;  // panels per block
  return dim3((panels + ppb - 1) / ppb, sp.kblocks, groups);
}

// Launches gemv1_kernel with split sp over `groups` rows (src.x set: the fused form, see Gemv1Args).
void launch_gemv1(const Exl3Dev& w, Exl3Group g, const float* xh, Exl3Src src, float* yr, int groups,
                  const Gemv1Split& sp, cudaStream_t s, const Gemv1Out& out = {}) {
  const int cap = sp.warps_k * sp.tiles_per_warp;
  const size_t red = sp.warps_k > 1 ? size_t(kGemv1Warps) * gemv1_positions(w.K) / 2 * 32 : 0;
  // variant 4 runs MUL1's fused calls whose staging fits the default 48 KB; the others take variant 2
  int v = exl3_gemv1_fma() ? 0 : exl3_gemv1_variant();
  if (v == 4 && (!src.x || w.cb != 2 || (size_t(gemv1_int8_words(cap)) + red) * sizeof(float) > 48 * 1024)) v = 2;
  const size_t smem =
      ((v == 4 ? size_t(gemv1_int8_words(cap)) : size_t(cap) * 16 + kGemv1ZeroWords) + red) * sizeof(float);
  launch(kGemv1[v][w.cb][w.K - 1], gemv1_grid(w, sp, groups), kGemv1Warps * 32, smem, s,
         gemv1_args(w, g, xh, yr, sp, src, out));
  EXL3_CHECK(cudaGetLastError());
}

// Launches gemv1r_kernel over `groups` block rows: rows 0 .. rows - 1 of xh / yr, or (sets) each group's set.
void launch_gemv1r(const Exl3Dev& w, Exl3Group g, const float* xh, float* yr, int groups, int rows,
                   const Exl3RowSet* sets, cudaStream_t s) {
  const int R = rows <= 2 ? 2 : 4;
  const Gemv1Split sp = gemv1_split(w, sets ? std::max(1, groups / 2) : groups, 0, R);  // about half lead a set
  const int cap = sp.warps_k * sp.tiles_per_warp;
  const size_t red = sp.warps_k > 1 ? size_t(R) * kGemv1Warps * gemv1_positions(w.K) / 2 * 32 : 0;
  const size_t smem = (size_t(cap) * R * 16 + kGemv1ZeroWords + red) * sizeof(float);
  launch(kGemv1r[R == 2 ? 0 : 1][w.cb][w.K - 1], gemv1_grid(w, sp, groups), kGemv1Warps * 32, smem, s,
         gemv1_args(w, g, xh, yr, sp), rows, sets);
  EXL3_CHECK(cudaGetLastError());
}

}  // namespace

int exl3_sm_count() {
  static const int sms = [] {
    int dev = 0, v = 132;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    return v;
  }();
  return sms;
}

int exl3_gemv_blocks_per_sm() {
  static const int n = [] {
    const char* v = std::getenv("MOESRV_EXL3_GEMV_BLOCKS");
    const int b = v ? std::atoi(v) : 0;
    return b > 0 ? std::min(b, 64) : 8;
  }();
  return n;
}

int exl3_gemv1_variant() {
  static const int v = env_choice("MOESRV_EXL3_GEMV1_VARIANT", 1, 4, 2);
  return v;
}

bool exl3_gemv_tc_single() {
  static const bool on = env_flag("MOESRV_EXL3_GEMV_TC");
  return on;
}

void exl3_rotate_in(const Exl3Dev& w, Exl3Group g, Exl3Src src, int n, void* xh, bool half_out, void* stream,
                    float* zero_yr) {
  check_shape(w);
  if (n <= 0) return;
  RotArgs a{w, g, src, nullptr, nullptr, 0, nullptr, xh, zero_yr, 1};
  // many rows (prefill): 4 128-blocks per warp; few (decode): one, so a row's blocks spread over more SMs
  const int blks = w.in_pad / 128, per = n >= 64 ? 4 : 1;
  const dim3 grid(unsigned(ceil_div(blks, 4 * per)), unsigned(n));
  auto go = [&](auto kernel) { launch(kernel, grid, 128, 0, static_cast<cudaStream_t>(stream), a); };
  if (per == 4) half_out ? go(rotate_in_kernel<true, 4>) : go(rotate_in_kernel<false, 4>);
  else half_out ? go(rotate_in_kernel<true, 1>) : go(rotate_in_kernel<false, 1>);
  EXL3_CHECK(cudaGetLastError());
}

void exl3_rotate_out(const Exl3Dev& w, Exl3Group g, const float* yr, int n, float* y, int64_t y_ld, const float* bias,
                     void* stream, int parts) {
  check_shape(w);
  if (n <= 0) return;
  RotArgs a{w, g, Exl3Src{}, yr, y, y_ld, bias, nullptr, nullptr, std::max(parts, 1)};
  launch(rotate_out_kernel, dim3((w.out_pad / 128 + 3) / 4, n), 128, 0, static_cast<cudaStream_t>(stream), a);
  EXL3_CHECK(cudaGetLastError());
}

void exl3_gemv_rotated(const Exl3Dev& w, Exl3Group g, const float* xh, int n, float* yr, Exl3Gemv kind, void* stream,
                       bool yr_zeroed) {
  check_shape(w);
  if (n <= 0) return;
  const bool grouped = g.ids != nullptr;
  const int nb = grouped ? 1 : n, groups = grouped ? n : 1;
  if (nb > kExl3MaxGemvRows) throw std::runtime_error("EXL3 GEMV: batch must be 1..8");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int tk = w.in_pad / 16, tn = w.out_pad / 16;
  const bool tc = kind == Exl3Gemv::TensorCore || (kind == Exl3Gemv::Auto && (nb >= 2 || exl3_gemv_tc_single()));
  if (nb == 1 && !tc && !exl3_gemv_v1()) {
    const Gemv1Split sp = gemv1_split(w, groups);
    if (!yr_zeroed && sp.kblocks > 1) EXL3_CHECK(cudaMemsetAsync(yr, 0, size_t(n) * w.out_pad * sizeof(float), s));
    launch_gemv1(w, g, xh, Exl3Src{}, yr, groups, sp, s);
    return;
  }
  if (kind == Exl3Gemv::Rows) {
    if (grouped || nb > kExl3SetRows) throw std::runtime_error("EXL3 GEMV: the row kernel takes 1..4 plain rows");
    if (!yr_zeroed) EXL3_CHECK(cudaMemsetAsync(yr, 0, size_t(n) * w.out_pad * sizeof(float), s));
    launch_gemv1r(w, g, xh, yr, 1, nb, nullptr, s);
    return;
  }
  if (!yr_zeroed) EXL3_CHECK(cudaMemsetAsync(yr, 0, size_t(n) * w.out_pad * sizeof(float), s));
  // split K so that the grid has ~8 blocks per SM, each block covering at most kMaxTilesPerBlock k-tiles
  const int cols = tn * groups;
  int ksplit = std::clamp((exl3_sm_count() * exl3_gemv_blocks_per_sm() + cols - 1) / cols, 1, std::max(1, tk / 8));
  int tpb = std::min((tk + ksplit - 1) / ksplit, kMaxTilesPerBlock);
  ksplit = (tk + tpb - 1) / tpb;
  const size_t smem = (tc ? size_t(8) * tpb * 16 * sizeof(half) : size_t(nb) * tpb * 16 * sizeof(float)) +
                      size_t(kGemvWarps) * kGemvUnroll * 8 * w.K * 4 + size_t(kGemvWarps) * 8 * 16 * sizeof(float);
  GemvArgs a{static_cast<const uint4*>(w.trellis), g, xh, yr, w.in_pad, w.out_pad, nb, tk, tn, tpb};
  launch((tc ? kGemvMma : kGemv)[w.cb][w.K - 1], dim3(tn, ksplit, groups), kGemvWarps * 32, smem, s, a);
  EXL3_CHECK(cudaGetLastError());
}

// MOESRV_EXL3_ROTATE_FUSED=1: exl3_gemv_out's one-launch form, read once. Off by default: it passes every check, but
// its decode layers ran no faster on an H100 (the rotation node already overlapped the GEMV's tail).
bool exl3_rotate_fused() {
  static const bool on = env_flag("MOESRV_EXL3_ROTATE_FUSED");
  return on;
}

// exl3_gemv_in's work (n >= 1, shape checked). With out.tickets the one-launch form also rotates into y: then it
// returns 0; otherwise the K parts left in yr (the rotate-first form takes no tickets and leaves 1).
static int gemv_in(const Exl3Dev& w, Exl3Group g, Exl3Src src, int n, void* xh, float* yr, size_t yr_floats,
                   cudaStream_t stream, const Gemv1Out& out) {
  const bool grouped = g.ids != nullptr;
  if ((!grouped && n > 1) || exl3_gemv_unfused() || exl3_gemv_v1() || exl3_gemv_tc_single()) {  // rotate, then GEMV
    exl3_rotate_in(w, g, src, n, xh, false, stream, yr);
    exl3_gemv_rotated(w, g, static_cast<const float*>(xh), n, yr, Exl3Gemv::Auto, stream, true);
    return 1;
  }
  const int max_parts = int(std::min<size_t>(kExl3MaxGemvParts, yr_floats / (size_t(n) * w.out_pad)));
  if (max_parts < 1) throw std::runtime_error("EXL3 GEMV: output scratch smaller than its rows");
  const Gemv1Split sp = gemv1_split(w, n, max_parts);
  launch_gemv1(w, g, nullptr, src, yr, n, sp, stream, out);
  return out.tickets ? 0 : sp.kblocks;
}

void exl3_gemv_out(const Exl3Dev& w, Exl3Group g, Exl3Src src, int n, void* xh, float* yr, size_t yr_floats,
                   Exl3Tickets tickets, float* y, int64_t y_ld, const float* bias, void* stream) {
  check_shape(w);
  if (n <= 0) return;
  const bool fused = exl3_rotate_fused() && tickets.p && size_t(n) * (w.out_pad / 128) <= tickets.count;
  const int parts = gemv_in(w, g, src, n, xh, yr, yr_floats, static_cast<cudaStream_t>(stream),
                            fused ? Gemv1Out{tickets.p, y, y_ld, bias} : Gemv1Out{});
  if (parts > 0) exl3_rotate_out(w, g, yr, n, y, y_ld, bias, stream, parts);
}

int exl3_gemv_in(const Exl3Dev& w, Exl3Group g, Exl3Src src, int n, void* xh, float* yr, size_t yr_floats,
                 void* stream) {
  check_shape(w);
  if (n <= 0) return 1;
  return gemv_in(w, g, src, n, xh, yr, yr_floats, static_cast<cudaStream_t>(stream), Gemv1Out{});
}

void exl3_row_sets(const int32_t* ids, int m, Exl3RowSet* sets, void* stream) {
  if (m <= 0) return;
  launch(row_sets_kernel, dim3(1), dim3(128), 0, static_cast<cudaStream_t>(stream), ids, m, sets);
  EXL3_CHECK(cudaGetLastError());
}

void exl3_gemv_rows_out(const Exl3Dev& w, Exl3Group g, const Exl3RowSet* sets, int set_rows, Exl3Src src, int n,
                        float* xh, float* yr, float* y, int64_t y_ld, const float* bias, void* stream) {
  check_shape(w);
  if (n <= 0) return;
  if (sets ? !g.ids || set_rows < 1 || set_rows > kExl3SetRows : g.ids || n > kExl3SetRows)
    throw std::runtime_error(sets ? "EXL3 GEMV: bad row sets" : "EXL3 GEMV: the row kernel takes 1..4 plain rows");
  exl3_rotate_in(w, g, src, n, xh, false, stream, yr);
  if (sets) launch_gemv1r(w, g, xh, yr, n, set_rows, sets, static_cast<cudaStream_t>(stream));
  else exl3_gemv_rotated(w, g, xh, n, yr, Exl3Gemv::Rows, stream, true);
  exl3_rotate_out(w, g, yr, n, y, y_ld, bias, stream);
}

void exl3_dequant_rotated(const Exl3Dev& w, int nt0, int nts, uint16_t* out, void* stream) {
  check_shape(w);
  const int tiles_k = w.in_pad / 16;
  launch(kDequant[w.cb][w.K - 1],
         dim3((nts + kDequantTiles - 1) / kDequantTiles, (tiles_k + kDequantWarps - 1) / kDequantWarps),
         kDequantWarps * 32, 0, static_cast<cudaStream_t>(stream), static_cast<const uint4*>(w.trellis), w.out_pad / 16,
         tiles_k, nt0, nts, reinterpret_cast<half*>(out));
  EXL3_CHECK(cudaGetLastError());
}

bool exl3_fits_whole(const Exl3Dev& w, size_t w16_elems) { return size_t(w.in_pad) * size_t(w.out_pad) <= w16_elems; }

void exl3_gemm_rotated(const Exl3Dev& w, const uint16_t* xh16, int n, float* yr, uint16_t* w16, size_t w16_elems,
                       bool w16_ready, void* cublas, void* stream) {
  check_shape(w);
  if (n <= 0) return;
  const int tn = w.out_pad / 16;
  const int slab = int(std::min<size_t>(size_t(tn), w16_elems / (size_t(w.in_pad) * 16)));  // tiles per slab
  if (slab < 1) throw std::runtime_error("EXL3 GEMM: dequant scratch smaller than one 16-column strip");
  cublasHandle_t blas = static_cast<cublasHandle_t>(cublas);
  cudaStream_t cur = nullptr;  // (setting a stream resets a handle's user workspace: only when it differs)
  if (cublasGetStream(blas, &cur) != CUBLAS_STATUS_SUCCESS ||
      (cur != static_cast<cudaStream_t>(stream) &&
       cublasSetStream(blas, static_cast<cudaStream_t>(stream)) != CUBLAS_STATUS_SUCCESS))
    throw std::runtime_error("EXL3 GEMM: cublas stream");
  const float one = 1.f, zero = 0.f;
  for (int nt0 = 0; nt0 < tn; nt0 += slab) {
    const int nts = std::min(slab, tn - nt0), m = nts * 16;
    if (!(w16_ready && nts == tn)) exl3_dequant_rotated(w, nt0, nts, w16, stream);
    // column-major view: Yr^T[cols] (m x n, ld out_pad) = W_slab^T (m x in, ld m) . Xh^T (in x n, ld in_pad)
    cublasStatus_t st =
        cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, m, n, w.in_pad, &one, w16, CUDA_R_16F, m, xh16, CUDA_R_16F,
                     w.in_pad, &zero, yr + nt0 * 16, CUDA_R_32F, w.out_pad, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error("EXL3 GEMM: cublasGemmEx error " + std::to_string(int(st)));
  }
}

}  // namespace moesrv::cuda
