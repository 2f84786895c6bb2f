// Exl3CudaLinear (exl3_cuda.h): one EXL3 linear with its own device copy and workspaces, on the launchers of
// exl3_ops.h; and the codebook decode check.
#include <cublas_v2.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "backend/cuda/exl3_cuda.h"
#include "backend/cuda/exl3_device.cuh"
#include "backend/cuda/exl3_ops.h"

namespace moesrv {

using cuda::Exl3Dev;

namespace {

template <typename T>
struct DeviceBuffer {
  T* p = nullptr;
  size_t n = 0;
  void reserve(size_t count) {
    if (count <= n) return;
    if (p) cudaFree(p);
    p = nullptr;
    EXL3_CHECK(cudaMalloc(&p, count * sizeof(T)));
    n = count;
  }
  ~DeviceBuffer() {
    if (p) cudaFree(p);
  }
};

template <int CB>
__global__ void codebook_kernel(uint16_t* out) {
  uint32_t s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s < 65536) out[s] = __half_as_ushort(cuda::exl3::decode_state<CB>(s));
}

}  // namespace

struct Exl3CudaLinear::Impl {
  Exl3Dev w;
  cuda::Exl3Gemv gemv_kernel = cuda::Exl3Gemv::Auto;
  DeviceBuffer<uint4> trellis;
  DeviceBuffer<half> suh, svh;
  DeviceBuffer<float> xh, yr;    // GEMV workspaces
  DeviceBuffer<unsigned> tickets;  // exl3_gemv_out's counters (zeroed when made)
  DeviceBuffer<half> xh16, w16;  // GEMM workspaces
  cublasHandle_t blas = nullptr;
  ~Impl() {
    if (blas) cublasDestroy(blas);
  }
};

Exl3CudaLinear::Exl3CudaLinear(const Exl3Weights& w) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  if (w.K < 1 || w.K > 8 || w.in_pad % 128 || w.out_pad % 128)
    throw std::runtime_error("Exl3CudaLinear: unsupported EXL3 shape/K");
  m.w.K = w.K;
  m.w.cb = cuda::exl3_cb_index(w.codebook);
  m.w.in_pad = m.w.in = int(w.in_pad);
  m.w.out_pad = m.w.out = int(w.out_pad);
  size_t bytes = w.trellis_bytes();
  m.trellis.reserve(bytes / 16);
  EXL3_CHECK(cudaMemcpy(m.trellis.p, w.trellis, bytes, cudaMemcpyHostToDevice));
  auto upload_half = [](DeviceBuffer<half>& dst, const std::vector<float>& src) {
    std::vector<half> h(src.size());
    for (size_t i = 0; i < src.size(); ++i) h[i] = __float2half_rn(src[i]);  // exact: values came from fp16
    dst.reserve(h.size());
    EXL3_CHECK(cudaMemcpy(dst.p, h.data(), h.size() * sizeof(half), cudaMemcpyHostToDevice));
  };
  upload_half(m.suh, w.suh);
  upload_half(m.svh, w.svh);
  m.w.trellis = m.trellis.p;
  m.w.suh = reinterpret_cast<const uint16_t*>(m.suh.p);
  m.w.svh = reinterpret_cast<const uint16_t*>(m.svh.p);
}

Exl3CudaLinear::~Exl3CudaLinear() = default;
int64_t Exl3CudaLinear::in_pad() const { return impl_->w.in_pad; }
int64_t Exl3CudaLinear::out_pad() const { return impl_->w.out_pad; }
int Exl3CudaLinear::K() const { return impl_->w.K; }
size_t Exl3CudaLinear::trellis_bytes() const { return impl_->w.trellis_bytes(); }

void Exl3CudaLinear::set_gemv_kernel(GemvKernel k) {
  impl_->gemv_kernel = k == GemvKernel::TensorCore ? cuda::Exl3Gemv::TensorCore
                       : k == GemvKernel::Fp32     ? cuda::Exl3Gemv::Fp32
                       : k == GemvKernel::Rows     ? cuda::Exl3Gemv::Rows
                                                   : cuda::Exl3Gemv::Auto;
}

void Exl3CudaLinear::forward(const float* d_x, int n, float* d_y, void* stream) {
  if (n <= kMaxGemvBatch) forward_gemv(d_x, n, d_y, stream);
  else forward_gemm(d_x, n, d_y, stream);
}

void Exl3CudaLinear::forward_gemv(const float* d_x, int n, float* d_y, void* stream) {
  Impl& m = *impl_;
  if (n < 1 || n > kMaxGemvBatch) throw std::runtime_error("Exl3CudaLinear::forward_gemv: batch must be 1..8");
  m.xh.reserve(size_t(n) * m.w.in_pad);
  if (n == 1 && m.gemv_kernel != cuda::Exl3Gemv::TensorCore &&
      m.gemv_kernel != cuda::Exl3Gemv::Rows) {  // the engine's one-row path: rotation fused in
    m.yr.reserve(size_t(cuda::kExl3MaxGemvParts) * m.w.out_pad);
    if (!m.tickets.p) {
      m.tickets.reserve(size_t(m.w.out_pad / 128));
      EXL3_CHECK(cudaMemsetAsync(m.tickets.p, 0, m.tickets.n * sizeof(unsigned), static_cast<cudaStream_t>(stream)));
    }
    cuda::exl3_gemv_out(m.w, {}, cuda::Exl3Src{d_x, m.w.in_pad}, 1, m.xh.p, m.yr.p,
                        size_t(cuda::kExl3MaxGemvParts) * m.w.out_pad, {m.tickets.p, m.tickets.n}, d_y, m.w.out_pad,
                        nullptr, stream);
    return;
  }
  m.yr.reserve(size_t(n) * m.w.out_pad);
  cuda::exl3_rotate_in(m.w, {}, cuda::Exl3Src{d_x, m.w.in_pad}, n, m.xh.p, false, stream);
  cuda::exl3_gemv_rotated(m.w, {}, m.xh.p, n, m.yr.p, m.gemv_kernel, stream);
  cuda::exl3_rotate_out(m.w, {}, m.yr.p, n, d_y, m.w.out_pad, nullptr, stream);
}

std::vector<float> exl3_cuda_grouped_gemm(const std::vector<const Exl3CudaLinear*>& experts,
                                          const std::vector<std::pair<int, int>>& pieces,
                                          const std::vector<uint16_t>& xh16, int form, bool rotate_out, int tile_rows) {
  if (experts.empty()) return {};
  const Exl3Dev& shape = experts[0]->impl_->w;
  std::vector<Exl3Dev> tab;
  for (const Exl3CudaLinear* e : experts) tab.push_back(e->impl_->w);
  std::vector<cuda::Exl3GemmTile> tiles;
  int rows = 0;
  if (form < 0) form = cuda::exl3_gemm_form();
  if (tile_rows <= 0) tile_rows = cuda::exl3_gemm_form_rows(form);
  for (const auto& [e, n] : pieces) {
    for (int r = 0; r < n; r += tile_rows) tiles.push_back({e, rows + r, std::min(tile_rows, n - r), 0});
    rows += n;
  }
  if (xh16.size() != size_t(rows) * shape.in_pad) throw std::runtime_error("exl3_cuda_grouped_gemm: input size");
  DeviceBuffer<Exl3Dev> d_tab;
  DeviceBuffer<cuda::Exl3GemmTile> d_tiles;
  DeviceBuffer<uint16_t> d_x;
  DeviceBuffer<float> d_y;
  d_tab.reserve(tab.size());
  d_tiles.reserve(tiles.size());
  d_x.reserve(xh16.size());
  d_y.reserve(size_t(rows) * shape.out_pad);
  EXL3_CHECK(cudaMemcpy(d_tab.p, tab.data(), tab.size() * sizeof(Exl3Dev), cudaMemcpyHostToDevice));
  EXL3_CHECK(cudaMemcpy(d_tiles.p, tiles.data(), tiles.size() * sizeof(tiles[0]), cudaMemcpyHostToDevice));
  EXL3_CHECK(cudaMemcpy(d_x.p, xh16.data(), xh16.size() * 2, cudaMemcpyHostToDevice));
  EXL3_CHECK(cudaMemset(d_y.p, 0xff, d_y.n * 4));  // NaN poison
  if (rotate_out)  // (out == out_pad in every caller of this check; y rows out_pad apart)
    cuda::exl3_grouped_gemm(shape, d_tab.p, d_tiles.p, int(tiles.size()), d_x.p, nullptr, nullptr, tile_rows, form,
                            d_y.p, shape.out_pad);
  else cuda::exl3_grouped_gemm(shape, d_tab.p, d_tiles.p, int(tiles.size()), d_x.p, d_y.p, nullptr, tile_rows, form);
  std::vector<float> y(d_y.n);
  EXL3_CHECK(cudaMemcpy(y.data(), d_y.p, y.size() * 4, cudaMemcpyDeviceToHost));
  return y;
}

void Exl3CudaLinear::dequant_rotated_f16(uint16_t* d_out, void* stream, int nt0, int nts) const {
  cuda::exl3_dequant_rotated(impl_->w, nt0, nts < 0 ? impl_->w.out_pad / 16 - nt0 : nts, d_out, stream);
}

void Exl3CudaLinear::forward_gemm(const float* d_x, int n, float* d_y, void* stream) {
  Impl& m = *impl_;
  if (n < 1) return;
  const size_t whole = size_t(m.w.in_pad) * m.w.out_pad;
  m.xh16.reserve(size_t(n) * m.w.in_pad);
  m.w16.reserve(whole);
  m.yr.reserve(size_t(n) * m.w.out_pad);
  if (!m.blas && cublasCreate(&m.blas) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
  cuda::exl3_rotate_in(m.w, {}, cuda::Exl3Src{d_x, m.w.in_pad}, n, m.xh16.p, true, stream);
  cuda::exl3_gemm_rotated(m.w, reinterpret_cast<const uint16_t*>(m.xh16.p), n, m.yr.p,
                          reinterpret_cast<uint16_t*>(m.w16.p), whole, false, m.blas, stream);
  cuda::exl3_rotate_out(m.w, {}, m.yr.p, n, d_y, m.w.out_pad, nullptr, stream);
}

void exl3_cuda_decode_codebook(Exl3Codebook cb, uint16_t* host_out) {
  DeviceBuffer<uint16_t> d;
  d.reserve(65536);
  switch (cuda::exl3_cb_index(cb)) {
    case 0: codebook_kernel<0><<<256, 256>>>(d.p); break;
    case 1: codebook_kernel<1><<<256, 256>>>(d.p); break;
    default: codebook_kernel<2><<<256, 256>>>(d.p); break;
  }
  EXL3_CHECK(cudaGetLastError());
  EXL3_CHECK(cudaMemcpy(host_out, d.p, 65536 * sizeof(uint16_t), cudaMemcpyDeviceToHost));
}

}  // namespace moesrv
