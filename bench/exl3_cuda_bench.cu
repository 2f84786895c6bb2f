// EXL3 CUDA checks and benchmark. Checks: codebooks bit-exact vs the CPU decoder, fp16 dequant bit-exact vs
// the CPU tile decoder, GEMV/GEMM vs the CPU Exl3Linear (K=1..8, all codebooks). Bench: device copy
// bandwidth, bf16 cuBLAS GEMV and EXL3 GEMV on expert-sized shapes (CUDA-graph replays over rotating
// weight copies so L2 does not hold them). Usage: exl3_cuda_bench [--quick]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/exl3_linear.h"
#include "backend/cuda/exl3_cuda.h"
#include "backend/cuda/exl3_ops.h"
#include "format/exl3_codebook.h"
#include "format/exl3_hadamard.h"
#include "format/exl3_tile.h"
#include "util/numeric.h"

using namespace moesrv;

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", #x, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)
#define CB_CK(x)                                                                    \
  do {                                                                              \
    if ((x) != CUBLAS_STATUS_SUCCESS) {                                             \
      std::fprintf(stderr, "cuBLAS error at %s:%d (%s)\n", __FILE__, __LINE__, #x); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

namespace {

int g_failures = 0;
void check(bool ok, const std::string& what) {
  std::printf("%-70s %s\n", what.c_str(), ok ? "ok" : "FAIL");
  if (!ok) ++g_failures;
}

struct HostWeights {  // random but valid EXL3 weights: any bit pattern is a valid tail-biting trellis
  std::vector<uint16_t> trellis;
  Exl3Weights w;
};

std::unique_ptr<HostWeights> random_weights(int64_t in, int64_t out, int K, Exl3Codebook cb, uint32_t seed) {
  auto h = std::make_unique<HostWeights>();
  std::mt19937 rng(seed);
  h->trellis.resize(size_t(in / 16) * size_t(out / 16) * 16 * K);
  for (auto& v : h->trellis) v = uint16_t(rng());
  std::uniform_real_distribution<float> ud(0.5f, 1.5f);
  auto scales = [&](int64_t n) {
    std::vector<float> s(static_cast<size_t>(n));
    for (auto& v : s) v = f16_to_f32(f32_to_f16(ud(rng) * ((rng() & 1) ? -1.f : 1.f)));
    return s;
  };
  h->w.K = K;
  h->w.codebook = cb;
  h->w.in_pad = in;
  h->w.out_pad = out;
  h->w.trellis = h->trellis.data();
  h->w.suh = scales(in);
  h->w.svh = scales(out);
  return h;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// The one-row GEMV's bound against the CPU (fp16 weights) for MUL1: fp32-accurate, or with variants 3 and 4 (unrounded
// MUL1 values, exl3_ops.h) the fp16 half-ulp bound 2^-11 on each weight's relative difference (variant 4's int8
// inputs, hi + lo / 254 of a block scale, add ~2^-15 of the largest input).
double mul1_one_row_limit() {
  const int v = cuda::exl3_gemv1_variant();
  return v == 3 || v == 4 ? 4.9e-4 : 1e-5;
}

// GPU forward vs CPU Exl3Linear; returns relative L2 error. Output is poisoned first.
double gpu_vs_cpu(Exl3CudaLinear& g, const Exl3Weights& w, int n, bool gemm) {
  auto x = randn(size_t(n) * w.in_pad, uint32_t(n * 7 + w.K));
  std::vector<float> yc(size_t(n) * w.out_pad), yg(yc.size());
  Exl3Linear cpu(w, {}, w.in_pad, w.out_pad);
  cpu.forward(x.data(), n, yc.data());
  float *dx, *dy;
  CK(cudaMalloc(&dx, x.size() * 4));
  CK(cudaMalloc(&dy, yg.size() * 4));
  CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dy, 0xff, yg.size() * 4));  // NaN poison
  if (gemm) g.forward_gemm(dx, n, dy);
  else g.forward_gemv(dx, n, dy);
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(yg.data(), dy, yg.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaFree(dx));
  CK(cudaFree(dy));
  return rel_l2(yg, yc);
}

void correctness(bool quick) {
  for (auto cb : {Exl3Codebook::Inst3, Exl3Codebook::Mcg, Exl3Codebook::Mul1}) {
    std::vector<uint16_t> gpu(65536);
    exl3_cuda_decode_codebook(cb, gpu.data());
    int bad = 0;
    for (uint32_t s = 0; s < 65536; ++s) bad += gpu[s] != exl3_decode_state_f16(s, cb);
    check(bad == 0, "codebook " + std::string(exl3_codebook_name(cb)) + ": 65536 states bit-exact vs CPU (" +
                        std::to_string(bad) + " differ)");
  }
  const int64_t in = 256, out = 384;
  for (auto cb : {Exl3Codebook::Inst3, Exl3Codebook::Mcg, Exl3Codebook::Mul1})
    for (int K = 1; K <= 8; ++K) {
      if (quick && K != 2 && K != 4) continue;
      auto h = random_weights(in, out, K, cb, uint32_t(K * 131 + int(cb)));
      Exl3CudaLinear g(h->w);
      // dequant bit-exact
      std::vector<float> cpu(size_t(in * out));
      exl3_decode_rotated(h->w, 0, out, cpu.data());
      uint16_t* d;
      CK(cudaMalloc(&d, size_t(in * out) * 2));
      g.dequant_rotated_f16(d);
      std::vector<uint16_t> gw(size_t(in * out));
      CK(cudaMemcpy(gw.data(), d, gw.size() * 2, cudaMemcpyDeviceToHost));
      CK(cudaFree(d));
      int bad = 0;
      for (size_t i = 0; i < gw.size(); ++i) bad += f16_to_f32(gw[i]) != cpu[i];
      std::string tag = "K=" + std::to_string(K) + " " + std::string(exl3_codebook_name(cb));
      check(bad == 0, tag + ": fp16 dequant bit-exact vs CPU tiles");
      {  // strips [3, 16): a slab of a GEMM whose scratch holds fewer columns than the weight (one partial group)
        const int nt0 = 3, nts = 13;
        std::vector<float> part(size_t(in) * nts * 16);
        exl3_decode_rotated(h->w, 16 * nt0, 16 * (nt0 + nts), part.data());
        CK(cudaMalloc(&d, part.size() * 2));
        g.dequant_rotated_f16(d, nullptr, nt0, nts);
        std::vector<uint16_t> gp(part.size());
        CK(cudaMemcpy(gp.data(), d, gp.size() * 2, cudaMemcpyDeviceToHost));
        CK(cudaFree(d));
        int bad_part = 0;
        for (size_t i = 0; i < gp.size(); ++i) bad_part += f16_to_f32(gp[i]) != part[i];
        check(bad_part == 0, tag + ": fp16 dequant of strips 3..15 bit-exact vs CPU tiles");
      }
      for (auto kind : {Exl3CudaLinear::GemvKernel::Fp32, Exl3CudaLinear::GemvKernel::TensorCore}) {
        g.set_gemv_kernel(kind);
        bool fp32 = kind == Exl3CudaLinear::GemvKernel::Fp32;
        double e1 = gpu_vs_cpu(g, h->w, 1, false), e3 = gpu_vs_cpu(g, h->w, 3, false), e8 = gpu_vs_cpu(g, h->w, 8, false);
        // tensor-core variant rounds activations to fp16; the one-row kernel's variant 3 skips MUL1's fp16 rounding
        const double lim = fp32 ? 1e-5 : 2e-3, lim1 = fp32 && cb == Exl3Codebook::Mul1 ? mul1_one_row_limit() : lim;
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s: GEMV %s n=1/3/8 rel err %.1e/%.1e/%.1e", tag.c_str(), fp32 ? "fp32" : "mma ",
                      e1, e3, e8);
        check(e1 < lim1 && e3 < lim && e8 < lim, buf);
      }
      // the R-row kernel (MTP verifies, batched steps): fp16 hi + lo inputs as the one-row kernel, fp16 weights
      g.set_gemv_kernel(Exl3CudaLinear::GemvKernel::Rows);
      {
        const double r1 = gpu_vs_cpu(g, h->w, 1, false), r2 = gpu_vs_cpu(g, h->w, 2, false),
                     r3 = gpu_vs_cpu(g, h->w, 3, false), r4 = gpu_vs_cpu(g, h->w, 4, false);
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s: GEMV rows n=1/2/3/4 rel err %.1e/%.1e/%.1e/%.1e", tag.c_str(), r1, r2, r3,
                      r4);
        check(std::max({r1, r2, r3, r4}) < 1e-5, buf);
      }
      g.set_gemv_kernel(Exl3CudaLinear::GemvKernel::Auto);
      double eg = gpu_vs_cpu(g, h->w, 37, true);
      check(eg < 3e-3, tag + ": GEMM (fp16 dequant + cuBLAS) n=37 rel err " + std::to_string(eg));
    }
  // The prefill experts' grouped GEMM: pieces of 1..300 rows (tiles of the form's height) over three experts vs the
  // CPU's W_hat in double on the same fp16 input (the GEMM's fp32 accumulation is the only difference).
  for (auto cb : {Exl3Codebook::Inst3, Exl3Codebook::Mul1})
    for (int K : {2, 3, 4, 6}) {
      const int64_t gin = 512, gout = 384;
      std::vector<std::unique_ptr<HostWeights>> hw;
      std::vector<std::unique_ptr<Exl3CudaLinear>> gl;
      std::vector<const Exl3CudaLinear*> experts;
      std::vector<std::vector<float>> what;
      for (int e = 0; e < 3; ++e) {
        hw.push_back(random_weights(gin, gout, K, cb, uint32_t(977 * e + K * 31 + int(cb))));
        gl.push_back(std::make_unique<Exl3CudaLinear>(hw.back()->w));
        experts.push_back(gl.back().get());
        what.emplace_back(size_t(gin * gout));
        exl3_decode_rotated(hw.back()->w, 0, gout, what.back().data());
      }
      const std::vector<std::pair<int, int>> pieces = {{0, 1}, {1, 37}, {2, 64}, {0, 100}, {2, 65}, {1, 150}, {0, 300}};
      int rows = 0;
      for (const auto& p : pieces) rows += p.second;
      auto x = randn(size_t(rows) * gin, uint32_t(K + 5));
      std::vector<uint16_t> xh(x.size());
      for (size_t i = 0; i < x.size(); ++i) xh[i] = f32_to_f16(x[i]);
      // form 4 (sm_90a builds on Hopper only) with tiles of 128 rows (its default: MMAs of 64 and 128 rows) and of 256
      // (5: MMAs of 64, 128, 192 and 256 rows here)
      for (int form : {0, 1, 2, 3, 4, 5}) {
        if (form >= 4 && !cuda::exl3_gemm_wgmma_built()) continue;
        const int kernel = std::min(form, 4), tile_rows = form == 5 ? 256 : 0;
        const std::string name = "grouped GEMM form " + std::to_string(kernel) + (form == 5 ? " (256-row tiles)" : "");
        const std::vector<float> y = exl3_cuda_grouped_gemm(experts, pieces, xh, kernel, false, tile_rows);
        double num = 0, den = 0;
        int r0 = 0;
        for (const auto& [e, n] : pieces) {
          for (int r = r0; r < r0 + n; ++r)
            for (int64_t c = 0; c < gout; ++c) {
              double ref = 0;
              for (int64_t k = 0; k < gin; ++k)
                ref += double(f16_to_f32(xh[size_t(r) * gin + k])) * what[size_t(e)][size_t(k * gout + c)];
              const double d = double(y[size_t(r) * gout + c]) - ref;
              num += d * d, den += ref * ref;
            }
          r0 += n;
        }
        const double err = std::sqrt(num / std::max(den, 1e-30));
        check(err < 1e-5, "K=" + std::to_string(K) + " " + std::string(exl3_codebook_name(cb)) + ": " + name +
                              ", 7 pieces over 3 experts, rel err " + std::to_string(err));
        if (form == 0) continue;
        // forms 1-4 with the output rotation in its epilogue: H(yr) ⊙ svh of its own yr rows (the CPU's Hadamard)
        const std::vector<float> yo = exl3_cuda_grouped_gemm(experts, pieces, xh, kernel, true, tile_rows);
        double worst = 0, top = 1e-30;
        r0 = 0;
        for (const auto& [e, n] : pieces) {
          for (int r = r0; r < r0 + n; ++r) {
            std::vector<float> row(y.begin() + size_t(r) * gout, y.begin() + size_t(r + 1) * gout);
            exl3_hadamard128(row.data(), gout);
            for (int64_t c = 0; c < gout; ++c) {
              const double ref = double(row[size_t(c)]) * hw[size_t(e)]->w.svh[size_t(c)];
              worst = std::max(worst, std::fabs(ref - double(yo[size_t(r) * gout + c])));
              top = std::max(top, std::fabs(ref));
            }
          }
          r0 += n;
        }
        check(worst / top < 1e-6, "K=" + std::to_string(K) + " " + std::string(exl3_codebook_name(cb)) + ": " + name +
                                      ", output rotation in the epilogue, worst diff / largest " +
                                      std::to_string(worst / top));
      }
    }
  // Real decode shapes: the one-row kernel (input rotation fused in, tensor-core sums, the K split left in parts for
  // the output rotation) against the CPU.
  struct Shape {
    int64_t in, out;
    int K;
  };
  for (auto [sin, sout, K] : {Shape{4096, 2048, 4}, Shape{2048, 4096, 3}, Shape{8192, 4096, 4}, Shape{4096, 512, 2}}) {
    auto h = random_weights(sin, sout, K, Exl3Codebook::Mul1, uint32_t(sin + sout + K));
    Exl3CudaLinear g(h->w);
    const double e1 = gpu_vs_cpu(g, h->w, 1, false);
    check(e1 < mul1_one_row_limit(), "K=" + std::to_string(K) + " " + std::to_string(sin) + "->" +
                                         std::to_string(sout) + ": one-row GEMV rel err " + std::to_string(e1));
  }
}

struct Timer {
  cudaEvent_t a, b;
  Timer() { CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b)); }
  ~Timer() { cudaEventDestroy(a); cudaEventDestroy(b); }
};

// Captures `calls` invocations of fn(i) into a graph, replays it `reps` times; returns median us per call.
template <typename Fn>
double time_graph(cudaStream_t s, int calls, int reps, Fn&& fn) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < calls; ++i) fn(i);
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  CK(cudaGraphLaunch(exec, s));  // warm-up
  CK(cudaStreamSynchronize(s));
  Timer t;
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(t.a, s));
    CK(cudaGraphLaunch(exec, s));
    CK(cudaEventRecord(t.b, s));
    CK(cudaEventSynchronize(t.b));
    float v;
    CK(cudaEventElapsedTime(&v, t.a, t.b));
    ms.push_back(v);
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  return ms[ms.size() / 2] * 1000.0 / calls;
}

__global__ void copy_kernel(const uint4* __restrict__ a, uint4* __restrict__ b, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) b[i] = a[i];
}

// (read + write) bytes per second of a plain 16-byte-per-thread copy kernel and of cudaMemcpyAsync
void copy_bandwidth_gbs(cudaStream_t s, double& kernel_gbs, double& memcpy_gbs) {
  size_t bytes = size_t(1) << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  double us = time_graph(s, 4, 5, [&](int) {
    copy_kernel<<<132 * 16, 256, 0, s>>>(static_cast<const uint4*>(a), static_cast<uint4*>(b), bytes / 16);
  });
  kernel_gbs = 2.0 * bytes / (us * 1e-6) / 1e9;
  us = time_graph(s, 4, 5, [&](int) { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s)); });
  memcpy_gbs = 2.0 * bytes / (us * 1e-6) / 1e9;
  CK(cudaFree(a));
  CK(cudaFree(b));
}

void bench(bool quick) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double copy_gbs = 0, memcpy_gbs = 0;
  copy_bandwidth_gbs(s, copy_gbs, memcpy_gbs);
  std::printf("\ndevice copy bandwidth (read+write bytes): copy kernel %.0f GB/s, cudaMemcpyAsync %.0f GB/s\n", copy_gbs,
              memcpy_gbs);
  cublasHandle_t blas;
  CB_CK(cublasCreate(&blas));
  CB_CK(cublasSetStream(blas, s));
  struct Shape { int64_t in, out; const char* what; };
  std::vector<Shape> shapes = {{2048, 6144, "in 2048 -> out 6144 (expert up/gate-like)"},
                               {6144, 2048, "in 6144 -> out 2048 (expert down-like)"},
                               {7168, 18432, "in 7168 -> out 18432 (dense MLP)"}};
  const size_t rotate_bytes = size_t(768) << 20;  // rotate over >= 768 MiB of weights (L2 is 60 MB)
  std::printf("\nEXL3 rows: one forward_gemv = Hadamard-in + memset + GEMV + Hadamard-out; GB/s = trellis bytes / time\n");
  std::printf("%-42s %9s %2s %3s %10s %10s %8s\n", "shape", "kind", "n", "K", "us/call", "GB/s", "vs copy");
  for (const auto& sh : shapes) {
    float *dx, *dy;
    CK(cudaMalloc(&dx, size_t(8) * sh.in * 4));
    CK(cudaMalloc(&dy, size_t(8) * sh.out * 4));
    auto xh = randn(size_t(8) * sh.in, 1);
    CK(cudaMemcpy(dx, xh.data(), xh.size() * 4, cudaMemcpyHostToDevice));
    // bf16 cuBLAS reference: y (out x n) = W (out x in, row-major = col-major in x out, op T) . x
    {
      size_t wbytes = size_t(sh.in) * sh.out * 2;
      int copies = int(std::clamp<size_t>(rotate_bytes / wbytes, 2, 64));
      std::vector<__nv_bfloat16*> ws(static_cast<size_t>(copies));
      for (auto& w : ws) {
        CK(cudaMalloc(&w, wbytes));
        CK(cudaMemset(w, 0x3c, wbytes));  // ~0.0115 everywhere: finite, not zero
      }
      __nv_bfloat16* xb;
      CK(cudaMalloc(&xb, size_t(8) * sh.in * 2));
      CK(cudaMemset(xb, 0x3c, size_t(8) * sh.in * 2));
      for (int n : {1, 8}) {
        const float one = 1.f, zero = 0.f;
        CB_CK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(sh.out), n, int(sh.in), &one, ws[0], CUDA_R_16BF,
                           int(sh.in), xb, CUDA_R_16BF, int(sh.in), &zero, dy, CUDA_R_32F, int(sh.out),
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));  // warm-up outside the graph capture
        CK(cudaStreamSynchronize(s));
        double us = time_graph(s, copies * 4, 7, [&](int i) {
          CB_CK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(sh.out), n, int(sh.in), &one, ws[size_t(i % copies)],
                             CUDA_R_16BF, int(sh.in), xb, CUDA_R_16BF, int(sh.in), &zero, dy, CUDA_R_32F, int(sh.out),
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        });
        double gbs = wbytes / (us * 1e-6) / 1e9;
        std::printf("%-42s %9s %2d %3s %10.2f %10.0f %7.0f%%\n", sh.what, "bf16 cuBLAS", n, "-", us, gbs,
                    100 * gbs / copy_gbs);
      }
      for (auto w : ws) CK(cudaFree(w));
      CK(cudaFree(xb));
    }
    for (int K : {2, 3, 4, 5, 6}) {
      if (quick && K != 4) continue;
      for (auto cb : {Exl3Codebook::Mul1, Exl3Codebook::Inst3}) {
        if (cb == Exl3Codebook::Inst3 && K != 4) continue;
        auto h = random_weights(sh.in, sh.out, K, cb, uint32_t(K));
        size_t tbytes = h->w.trellis_bytes();
        int copies = int(std::clamp<size_t>(rotate_bytes / tbytes, 2, 96));
        std::vector<std::unique_ptr<Exl3CudaLinear>> gs;
        for (int c = 0; c < copies; ++c) gs.push_back(std::make_unique<Exl3CudaLinear>(h->w));
        for (auto variant : {Exl3CudaLinear::GemvKernel::TensorCore, Exl3CudaLinear::GemvKernel::Fp32})
          for (int n : {1, 4, 8}) {
            bool tc = variant == Exl3CudaLinear::GemvKernel::TensorCore;
            if (!tc && (quick || (n == 4))) continue;
            for (auto& g : gs) {
              g->set_gemv_kernel(variant);
              g->forward_gemv(dx, n, dy, s);  // allocate workspaces outside capture
            }
            CK(cudaStreamSynchronize(s));
            double us = time_graph(s, copies * 2, 7, [&](int i) { gs[size_t(i % copies)]->forward_gemv(dx, n, dy, s); });
            double gbs = tbytes / (us * 1e-6) / 1e9;
            std::string kind = std::string(exl3_codebook_name(cb)) + (tc ? "" : "/f32");
            std::printf("%-42s %9s %2d %3d %10.2f %10.0f %7.0f%%\n", sh.what, kind.c_str(), n, K, us, gbs,
                        100 * gbs / copy_gbs);
          }
      }
    }
    CK(cudaFree(dx));
    CK(cudaFree(dy));
  }
  // GEMM path (prefill): dequant + cuBLAS, one shape
  {
    auto h = random_weights(2048, 6144, 4, Exl3Codebook::Mul1, 5);
    Exl3CudaLinear g(h->w);
    for (int n : {64, 512}) {
      float *dx, *dy;
      CK(cudaMalloc(&dx, size_t(n) * 2048 * 4));
      CK(cudaMalloc(&dy, size_t(n) * 6144 * 4));
      CK(cudaMemset(dx, 0, size_t(n) * 2048 * 4));
      g.forward_gemm(dx, n, dy, s);
      CK(cudaStreamSynchronize(s));
      double us = time_graph(s, 8, 7, [&](int) { g.forward_gemm(dx, n, dy, s); });
      std::printf("GEMM path in 2048 -> out 6144, K=4 mul1, n=%3d: %8.2f us/call (%.1f TFLOP/s)\n", n, us,
                  2.0 * n * 2048 * 6144 / (us * 1e-6) / 1e12);
      CK(cudaFree(dx));
      CK(cudaFree(dy));
    }
  }
  CB_CK(cublasDestroy(blas));
  CK(cudaStreamDestroy(s));
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  std::printf("device: %s, %d SMs, L2 %d MB, cc %d.%d\n", p.name, p.multiProcessorCount, p.l2CacheSize >> 20, p.major,
              p.minor);
  try {
    correctness(quick);
    bench(quick);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::printf("\n%s (%d check failures)\n", g_failures ? "FAILED" : "all checks passed", g_failures);
  return g_failures ? 1 : 0;
}
