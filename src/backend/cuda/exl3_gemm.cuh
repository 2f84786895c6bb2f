// Pieces the grouped EXL3 GEMM's kernels share (exl3_gemm.cu: forms 0-3 on mma.sync; exl3_gemm_wgmma.cu: form 4 on
// wgmma): the launch arguments, the trellis words' cp.async staging, and the epilogue that writes a block's 128
// output columns of each row from shared memory (the output rotation there, rotate_out's math).
#pragma once
#include <cstdint>

#include "backend/cuda/exl3_device.cuh"
#include "backend/cuda/exl3_ops.h"

namespace moesrv::cuda::exl3gemm {

using namespace exl3;

constexpr int kCols = 128;       // output columns per block (one Hadamard block)
constexpr int kStageTiles = 4;   // k-tiles (of 16) per pipeline stage
constexpr int kOutLd = 128 + 4;  // a block's output rows in shared memory (floats; padded)

struct GemmArgs {
  const Exl3Dev* tab;
  const Exl3GemmTile* tiles;
  const uint16_t* xh;  // fp16 [rows][in_pad]
  float* yr;           // [rows][out_pad]
  int in_pad, out_pad;
  // with y: the output rotation in the epilogue (rotate_out's math), y[row][o] for o < out, rows y_ld apart
  float* y;
  int64_t y_ld;
  int out;
};

// The kTiles adjacent column tiles from nt0 (contiguous in the trellis for each k-tile) of stage st's k-tiles into ws
// ([k-tile][tile][8K words]) by cp.async, the lanes of one warp.
template <int K, int kTiles>
__device__ __forceinline__ void load_stage_words(const uint4* trellis, int tiles_n, int nt0, int st, int lane,
                                                 uint32_t* ws) {
  constexpr int kChunks = kTiles * 2 * K;  // uint4 per k-tile
  for (int c = lane; c < kStageTiles * kChunks; c += 32) {
    const int u = c / kChunks;
    cp_async16(ws + 4 * c, trellis + (size_t(st * kStageTiles + u) * tiles_n + nt0) * (2 * K) + (c - u * kChunks),
               true);
  }
}

// The block's 128 output columns of the tile's rows, in shared memory `ot` ([row][kOutLd] floats, complete: the
// caller synchronised), to y (rotated: a warp per row, the 128-point Hadamard, svh of the tile's expert) or to yr.
__device__ __forceinline__ void store_out_rows(const GemmArgs& g, const Exl3GemmTile& t, const float* ot, int warps) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (g.y) {
    const half* svh = reinterpret_cast<const half*>(g.tab[t.e].svh);
    const int e = blockIdx.x * kCols + 4 * lane;
    for (int r = warp; r < t.rows; r += warps) {
      float4 v = *reinterpret_cast<const float4*>(ot + r * kOutLd + 4 * lane);
      hadamard128_lane(v, lane);
      const float o[4] = {v.x, v.y, v.z, v.w};
      float* y = g.y + size_t(t.row0 + r) * g.y_ld;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (e + i < g.out) y[e + i] = o[i] * __half2float(svh[e + i]);
    }
    return;
  }
  for (int r = warp; r < t.rows; r += warps)
    *reinterpret_cast<float4*>(g.yr + size_t(t.row0 + r) * g.out_pad + blockIdx.x * kCols + 4 * lane) =
        *reinterpret_cast<const float4*>(ot + r * kOutLd + 4 * lane);
}

}  // namespace moesrv::cuda::exl3gemm
