// EXL3 linear layers on an NVIDIA GPU. Plain C++ API: device pointers are typed host pointers, streams are
// passed as void* (a cudaStream_t; nullptr = default stream). Shapes are the stored, 128-padded ones.
// CUDA failures throw std::runtime_error. Two paths: GEMV (batch 1..8) decoding 16x16 trellis tiles on the fly, one warp per tile of a 16-column
// strip with split-K; and GEMM (any batch) that dequantizes W_hat to fp16 and calls cuBLAS.
// GEMV accumulates in fp32 (activations fp16 in the tensor-core variant). Both run y = (((x ⊙ suh)·H)·W_hat)·H ⊙ svh with the Hadamard steps as warp-shuffle butterflies.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "format/exl3_weights.h"

namespace moesrv {

class Exl3CudaLinear {
 public:
  static constexpr int kMaxGemvBatch = 8;

  explicit Exl3CudaLinear(const Exl3Weights& w);  // uploads trellis, suh, svh to the current device
  ~Exl3CudaLinear();
  Exl3CudaLinear(const Exl3CudaLinear&) = delete;
  Exl3CudaLinear& operator=(const Exl3CudaLinear&) = delete;

  int64_t in_pad() const;
  int64_t out_pad() const;
  int K() const;
  size_t trellis_bytes() const;

  // d_x [n][in_pad] fp32 -> d_y [n][out_pad] fp32 (device). GEMV for n <= 8, else GEMM.
  void forward(const float* d_x, int n, float* d_y, void* stream = nullptr);
  void forward_gemv(const float* d_x, int n, float* d_y, void* stream = nullptr);  // n in 1..8
  void forward_gemm(const float* d_x, int n, float* d_y, void* stream = nullptr);  // fp16 operands, fp32 accumulate
  // GEMV inner product: TensorCore (fp16 activations in m16n8k16 mma, fp32 accumulate; cost flat in batch),
  // Fp32 (fp32-accurate activations: at one row, tensor-core products of the input split into fp16 hi + lo parts
  // with the input rotation in the same launch, ~1e-6 of the CPU; MOESRV_EXL3_GEMV1_FMA=1: fp32 FMAs, ~1e-7; more
  // rows: fp32 FMAs), or Auto (default: Fp32 for n == 1, TensorCore for n >= 2; see docs/perf-exl3.md).
  enum class GemvKernel { Auto, TensorCore, Fp32, Rows };  // Rows: 1..4 rows, the R-row kernel
  void set_gemv_kernel(GemvKernel k);
  // W_hat (rotated basis) as fp16 bits, row-major [in_pad][out_pad], into device memory; with nts >= 0 only the
  // columns of 16-column strips [nt0, nt0 + nts), row-major [in_pad][16 * nts].
  void dequant_rotated_f16(uint16_t* d_out, void* stream = nullptr, int nt0 = 0, int nts = -1) const;

 private:
  friend std::vector<float> exl3_cuda_grouped_gemm(const std::vector<const Exl3CudaLinear*>&,
                                                   const std::vector<std::pair<int, int>>&,
                                                   const std::vector<uint16_t>&, int, bool, int);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The prefill experts' grouped GEMM (exl3_grouped_gemm) over `experts` (one shape, K and codebook): piece i takes
// the next pieces[i].second rows of xh16 (fp16 bits, [rows][in_pad], the rotated input) through the weights of
// experts[pieces[i].first]; returns those rows times W_hat, [rows][out_pad] (checks against the CPU). form: the
// kernel (exl3_gemm_form; -1: the default); rotate_out (forms 1-4): the rows' outputs rotated back (H, svh) by the
// GEMM; tile_rows: 0 = the form's (exl3_gemm_form_rows), else tiles of that many rows.
std::vector<float> exl3_cuda_grouped_gemm(const std::vector<const Exl3CudaLinear*>& experts,
                                          const std::vector<std::pair<int, int>>& pieces,
                                          const std::vector<uint16_t>& xh16, int form = -1, bool rotate_out = false,
                                          int tile_rows = 0);

// Decodes all 65536 states of a codebook on the device; host_out receives fp16 bits (bit-exactness checks).
void exl3_cuda_decode_codebook(Exl3Codebook cb, uint16_t* host_out);

}  // namespace moesrv
