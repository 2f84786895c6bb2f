// Embedding, normalisation, rotary, activation, conversion and cache-store kernels.
#include "backend/cuda/glm5_next_kernels.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

namespace {

// 16-byte loads where rows allow (D % 8 == 0): the table may be read in place from host memory over PCIe.
__global__ void embed_kernel(const uint16_t* table, const int32_t* ids, int D, float* out) {
  pdl_enter();
  const uint16_t* row = table + int64_t(ids[blockIdx.x]) * D;
  float* o = out + int64_t(blockIdx.x) * D;
  if (D % 8 == 0) {
    for (int i = threadIdx.x; i < D / 8; i += blockDim.x) {
      const uint4 v = reinterpret_cast<const uint4*>(row)[i];
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
      for (int j = 0; j < 4; ++j) {
        o[8 * i + 2 * j] = bf16_to_f32(uint16_t(w[j] & 0xffffu));
        o[8 * i + 2 * j + 1] = bf16_to_f32(uint16_t(w[j] >> 16));
      }
    }
    return;
  }
  for (int i = threadIdx.x; i < D; i += blockDim.x) o[i] = bf16_to_f32(row[i]);
}

__global__ void rms_norm_kernel(const float* x, int64_t xs, const float* w, int d, float eps, float* y, int64_t ys) {
  pdl_enter();
  const float* xr = x + blockIdx.x * xs;
  float* yr = y + blockIdx.x * ys;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss);
  const float inv = rsqrtf(ss / float(d) + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * inv * (w ? w[i] : 1.0f);
}

__global__ void add_rms_norm_kernel(float* x, const float* add, const float* w, int d, float eps, float* y) {
  pdl_enter();
  float* xr = x + int64_t(blockIdx.x) * d;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float v = xr[i] + (add ? add[int64_t(blockIdx.x) * d + i] : 0.0f);
    xr[i] = v;
    ss += v * v;
  }
  ss = block_sum(ss);
  const float inv = rsqrtf(ss / float(d) + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) y[int64_t(blockIdx.x) * d + i] = xr[i] * inv * w[i];
}

__global__ void layer_norm_kernel(const float* x, const float* w, const float* b, int d, float eps, float* y) {
  pdl_enter();
  const float* xr = x + int64_t(blockIdx.x) * d;
  float s = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i];
  const float mean = block_sum(s) / float(d);
  float v = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) v += (xr[i] - mean) * (xr[i] - mean);
  const float inv = rsqrtf(block_sum(v) / float(d) + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x)
    y[int64_t(blockIdx.x) * d + i] = (xr[i] - mean) * inv * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
}

__global__ void rope_kernel(float* x, int heads, int64_t tok_stride, int head_stride, int offset, int dim,
                            bool interleaved, const float* cos_sin, const int32_t* pos0) {
  pdl_enter();
  const int s = blockIdx.x, half = dim / 2;
  const float* cs = cos_sin + int64_t(*pos0 + s) * dim;  // [half][2]
  for (int idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
    const int h = idx / half, i = idx % half;
    float* base = x + s * tok_stride + int64_t(h) * head_stride + offset;
    float* a = interleaved ? base + 2 * i : base + i;
    float* b = interleaved ? base + 2 * i + 1 : base + i + half;
    const float c = cs[2 * i], sn = cs[2 * i + 1], x0 = *a, x1 = *b;
    *a = x0 * c - x1 * sn;
    *b = x1 * c + x0 * sn;
  }
}

__global__ void silu_mul_kernel(const float* gu, int64_t n, int I, float* out) {
  pdl_enter();
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / I, i = idx % I;
    const float g = gu[r * 2 * I + i], u = gu[r * 2 * I + I + i];
    out[idx] = g / (1.0f + expf(-g)) * u;
  }
}

// SwiGLU with clamping (swiglu_limit): gate = min(gate, limit), up = clamp(up, -limit, limit), then silu(gate) * up.
__global__ void silu_mul_clamped_kernel(const float* gu, int64_t n, int I, float limit, float* out) {
  pdl_enter();
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / I, i = idx % I;
    const float g = fminf(gu[r * 2 * I + i], limit), u = fminf(fmaxf(gu[r * 2 * I + I + i], -limit), limit);
    out[idx] = g / (1.0f + expf(-g)) * u;
  }
}

__global__ void sigmoid_gate_rows_kernel(float* x, const float* gate, int64_t gate_stride, int64_t n, int cols) {
  pdl_enter();
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const float g = gate[idx / cols * gate_stride + idx % cols];
    x[idx] *= 1.0f / (1.0f + expf(-g));
  }
}

__global__ void to_bf16_kernel(const float* x, int64_t n, uint16_t* y) {
  pdl_enter();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = f32_to_bf16(x[i]);
}

__global__ void from_bf16_kernel(const uint16_t* x, int64_t n, float* y) {
  pdl_enter();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = bf16_to_f32(x[i]);
}

// x = hi + lo, hi = x rounded to TF32's 10-bit mantissa (to nearest, ties away), lo = x - hi (exact); hi may be x.
__global__ void split_tf32_kernel(const float* x, int64_t rows, int cols, int64_t x_ld, float* hi, int64_t hi_ld,
                                  float* lo, int64_t lo_ld) {
  pdl_enter();
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float v = x[r * x_ld + c], h = __uint_as_float((__float_as_uint(v) + 0x1000u) & 0xffffe000u);
      hi[r * hi_ld + c] = h;
      lo[r * lo_ld + c] = v - h;
    }
}

// Row r of x (cols values) -> out row r: [bf16(x) | bf16(x - bf16(x))] (2 cols values).
__global__ void split_bf16x2_kernel(const float* x, int64_t rows, int cols, int64_t x_ld, uint16_t* out) {
  pdl_enter();
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float v = x[r * x_ld + c];
      const uint16_t hi = f32_to_bf16(v);
      out[r * 2 * cols + c] = hi;
      out[r * 2 * cols + cols + c] = f32_to_bf16(v - bf16_to_f32(hi));
    }
}

__global__ void add_bias_kernel(float* y, const float* b, int64_t n, int cols) {
  pdl_enter();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] += b[i % cols];
}

__global__ void gather_rows_kernel(const float* x, const int32_t* rows, int D, uint16_t* out) {
  pdl_enter();
  const float* src = x + int64_t(rows[blockIdx.x]) * D;
  for (int i = threadIdx.x; i < D; i += blockDim.x) out[int64_t(blockIdx.x) * D + i] = f32_to_bf16(src[i]);
}

__global__ void cache_write_kernel(const float* src, int64_t src_stride, int row_len, const DeviceLayerCache* lc,
                                   CacheField field, bool q8, const int32_t* pos0) {
  pdl_enter();
  const float* x = src + blockIdx.x * src_stride;
  const int64_t t = *pos0 + blockIdx.x;
  if (field == CacheField::IndexK) {
    for (int i = threadIdx.x; i < row_len; i += blockDim.x) lc->index_k[t * row_len + i] = f32_to_bf16(x[i]);
    return;
  }
  void* base = field == CacheField::Kv ? lc->kv : lc->v;
  if (!q8) {
    uint16_t* dst = static_cast<uint16_t*>(base) + t * row_len;
    for (int i = threadIdx.x; i < row_len; i += blockDim.x) dst[i] = f32_to_bf16(x[i]);
    return;
  }
  float m = 0.0f;
  for (int i = threadIdx.x; i < row_len; i += blockDim.x) m = fmaxf(m, fabsf(x[i]));
  __shared__ float part[32];
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
  __syncthreads();
  m = 0.0f;
  for (int i = 0; i < int(blockDim.x >> 5); ++i) m = fmaxf(m, part[i]);
  const float scale = m > 0.0f ? m / 127.0f : 1.0f;
  int8_t* dst = static_cast<int8_t*>(base) + t * row_len;
  for (int i = threadIdx.x; i < row_len; i += blockDim.x) dst[i] = int8_t(__float2int_rn(x[i] / scale));
  if (threadIdx.x == 0) (field == CacheField::Kv ? lc->kv_scale : lc->v_scale)[t] = scale;
}

__global__ void offset_position_kernel(const int32_t* pos0, int add, int32_t* out) {
  pdl_enter();
  *out = *pos0 + add;
}

// Block per kGemvRowsPerBlock output rows of w [out][in] (bf16); each row's dot is split over kGemvSplit warps (one
// contiguous, 8-aligned range of the inputs each) so that a small matrix still spreads over many SMs, and the
// partial sums meet in shared memory in warp order. Every token of the batch (n <= kBf16GemvMaxRows) per row.
constexpr int kGemvSplit = 4, kGemvRowsPerBlock = 2;
__global__ void __launch_bounds__(32 * kGemvSplit * kGemvRowsPerBlock)
    bf16_gemv_kernel(const uint16_t* w, int out, int in, const float* x, int n, const float* bias, float* y) {
  pdl_enter();
  __shared__ float part[kGemvRowsPerBlock][kGemvSplit][kBf16GemvMaxRows];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rb = warp / kGemvSplit, q = warp % kGemvSplit, row = blockIdx.x * kGemvRowsPerBlock + rb;
  const int per = (in / kGemvSplit + 7) / 8 * 8, i0 = min(in, q * per), i1 = min(in, i0 + per);
  if (row < out) {
    const uint16_t* wr = w + int64_t(row) * in + i0;
    for (int t = 0; t < n; ++t) {
      const float v = warp_dot_bf16(wr, x + int64_t(t) * in + i0, i1 - i0);
      if (lane == 0) part[rb][q][t] = v;
    }
  }
  __syncthreads();
  if (q != 0 || row >= out || lane >= n) return;
  float v = 0.0f;
  for (int j = 0; j < kGemvSplit; ++j) v += part[rb][j][lane];
  y[int64_t(lane) * out + row] = v + (bias ? bias[row] : 0.0f);
}

int grid_for(int64_t n) { return int(std::min<int64_t>((n + 255) / 256, 4096)); }

}  // namespace

void offset_position(const int32_t* pos0, int add, int32_t* out, cudaStream_t st) {
  launch(offset_position_kernel, 1, 1, 0, st, pos0, add, out);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void embed_gather(const uint16_t* table, const int32_t* ids, int S, int D, float* out, cudaStream_t st) {
  launch(embed_kernel, S, 256, 0, st, table, ids, D, out);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void rms_norm(const float* x, int64_t x_stride, const float* w, int rows, int d, float eps, float* y,
              int64_t y_stride, cudaStream_t st) {
  if (rows == 0) return;
  launch(rms_norm_kernel, rows, 256, 0, st, x, x_stride, w, d, eps, y, y_stride);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void add_rms_norm(float* x, const float* add, const float* w, int rows, int d, float eps, float* y, cudaStream_t st) {
  launch(add_rms_norm_kernel, rows, 256, 0, st, x, add, w, d, eps, y);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void layer_norm(const float* x, const float* w, const float* b, int rows, int d, float eps, float* y, cudaStream_t st) {
  launch(layer_norm_kernel, rows, 128, 0, st, x, w, b, d, eps, y);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void rope(float* x, int S, int heads, int64_t tok_stride, int head_stride, int offset, int dim, bool interleaved,
          const float* cos_sin, const int32_t* pos0, cudaStream_t st) {
  if (dim == 0 || S == 0) return;
  launch(rope_kernel, S, 128, 0, st, x, heads, tok_stride, head_stride, offset, dim, interleaved, cos_sin, pos0);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void silu_mul(const float* gu, int rows, int I, float* out, cudaStream_t st) {
  const int64_t n = int64_t(rows) * I;
  if (n == 0) return;
  launch(silu_mul_kernel, grid_for(n), 256, 0, st, gu, n, I, out);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void silu_mul_clamped(const float* gu, int rows, int I, float limit, float* out, cudaStream_t st) {
  if (!(limit > 0.0f)) return silu_mul(gu, rows, I, out, st);
  const int64_t n = int64_t(rows) * I;
  if (n == 0) return;
  launch(silu_mul_clamped_kernel, grid_for(n), 256, 0, st, gu, n, I, limit, out);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void sigmoid_gate_rows(float* x, const float* gate, int64_t gate_stride, int rows, int n, cudaStream_t st) {
  const int64_t total = int64_t(rows) * n;
  if (total == 0) return;
  launch(sigmoid_gate_rows_kernel, grid_for(total), 256, 0, st, x, gate, gate_stride, total, n);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void to_bf16(const float* x, int64_t n, uint16_t* y, cudaStream_t st) {
  if (n == 0) return;
  launch(to_bf16_kernel, grid_for(n), 256, 0, st, x, n, y);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void from_bf16(const uint16_t* x, int64_t n, float* y, cudaStream_t st) {
  if (n == 0) return;
  launch(from_bf16_kernel, grid_for(n), 256, 0, st, x, n, y);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void split_tf32(const float* x, int64_t rows, int cols, int64_t x_ld, float* hi, int64_t hi_ld, float* lo,
                int64_t lo_ld, cudaStream_t st) {
  if (rows <= 0 || cols <= 0) return;
  launch(split_tf32_kernel, int(std::min<int64_t>(rows, 65535)), 256, 0, st, x, rows, cols, x_ld, hi, hi_ld, lo, lo_ld);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void split_bf16x2(const float* x, int64_t rows, int cols, int64_t x_ld, uint16_t* out, cudaStream_t st) {
  if (rows <= 0 || cols <= 0) return;
  launch(split_bf16x2_kernel, int(std::min<int64_t>(rows, 65535)), 256, 0, st, x, rows, cols, x_ld, out);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void bf16_gemv(const uint16_t* w, int out, int in, const float* x, int n, const float* bias, float* y,
               cudaStream_t st) {
  if (n <= 0 || out <= 0) return;
  if (n > kBf16GemvMaxRows) throw std::runtime_error("bf16_gemv: more than 8 rows");
  launch(bf16_gemv_kernel, ceil_div(out, kGemvRowsPerBlock), 32 * kGemvSplit * kGemvRowsPerBlock, 0, st, w, out, in, x,
         n, bias, y);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void add_bias(float* y, const float* b, int rows, int cols, cudaStream_t st) {
  const int64_t n = int64_t(rows) * cols;
  if (n == 0) return;
  launch(add_bias_kernel, grid_for(n), 256, 0, st, y, b, n, cols);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void gather_rows_bf16(const float* x, const int32_t* rows, int n, int D, uint16_t* out, cudaStream_t st) {
  if (n == 0) return;
  launch(gather_rows_kernel, n, 256, 0, st, x, rows, D, out);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void cache_write(const float* src, int64_t src_stride, int S, int row_len, const DeviceLayerCache* lc,
                 CacheField field, bool q8, const int32_t* pos0, cudaStream_t st) {
  if (S == 0) return;
  launch(cache_write_kernel, S, 256, 0, st, src, src_stride, row_len, lc, field, q8, pos0);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
