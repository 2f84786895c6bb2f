// GLM-5.3-Flash (glm5_next) and Qwen3-Next CUDA block kernels vs their CPU references, on random inputs with fixed
// seeds, at the tiny hf-tiny shapes and at the real models' widths. Skipped without a CUDA build or device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/delta_rule.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/residual.h"
#include "model/router.h"
#include "util/numeric.h"

#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "backend/cuda/glm5_next_kernels.h"
#include "backend/cuda/kernels.h"
#endif

namespace moesrv {
namespace {

#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA

bool has_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define SKIP_WITHOUT_DEVICE() \
  if (!has_device()) GTEST_SKIP() << "no CUDA device"

void ok(cudaError_t e) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + cudaGetErrorString(e));
}

// A device array of T with host copies in and out (synchronous).
template <typename T>
class Dev {
 public:
  explicit Dev(size_t n) : n_(n) {
    ok(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)));
    ok(cudaMemset(p_, 0, std::max<size_t>(n, 1) * sizeof(T)));
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) { put(h); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() { cudaFree(p_); }
  T* get() const { return p_; }
  size_t size() const { return n_; }
  void put(const std::vector<T>& h, size_t offset = 0) {
    if (offset + h.size() > n_) throw std::runtime_error("Dev::put out of range");
    ok(cudaMemcpy(p_ + offset, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> host(size_t count = size_t(-1)) const {
    ok(cudaDeviceSynchronize());
    std::vector<T> h(std::min(count, n_));
    ok(cudaMemcpy(h.data(), p_, h.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

std::vector<float> uniform(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// max |a - ref| / max |ref|.
double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  if (a.size() != ref.size()) return INFINITY;
  double diff = 0, mag = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(ref[i])));
    mag = std::max(mag, std::abs(double(ref[i])));
  }
  return mag > 0 ? diff / mag : diff;
}

float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// ---------------------------------------------------------------- conv + SiLU

TEST(CudaGlm5NextKernels, CausalConv1dSiluCarriesState) {
  SKIP_WITHOUT_DEVICE();
  for (int C : {3 * 4 * 32, 3 * 64 * 128}) {
    const int K = 4, P = K - 1, pad = 16;
    const std::vector<float> w = uniform(size_t(C) * K, -0.5f, 0.5f, 11);
    std::vector<float> state(size_t(P) * C, 0.0f);
    Dev<float> dw(w), dstate(state);
    uint32_t seed = 100;
    for (int T : {5, 1, 2, 37, 1, 1, 3}) {
      const std::vector<float> x = uniform(size_t(T) * C, -2.0f, 2.0f, seed++);
      std::vector<float> xpad(size_t(T) * (C + pad), 7.0f);  // rows C + pad apart: the stride is honoured
      for (int t = 0; t < T; ++t) std::copy_n(x.begin() + int64_t(t) * C, C, xpad.begin() + int64_t(t) * (C + pad));
      std::vector<float> y(size_t(T) * C);
      cpu::causal_conv1d_silu(x.data(), T, C, w.data(), K, state.data(), y.data());
      Dev<float> dx(xpad), dy(size_t(T) * C);
      cuda::causal_conv1d_silu(dx.get(), C + pad, T, C, dw.get(), K, dstate.get(), dy.get(), nullptr);
      EXPECT_LT(rel_err(dy.host(), y), 1e-5) << "C " << C << " T " << T;
      EXPECT_EQ(dstate.host(), state) << "C " << C << " T " << T;
    }
  }
}

// ---------------------------------------------------------------- l2norm, gates, output norm

TEST(CudaGlm5NextKernels, L2NormRowsWithScale) {
  SKIP_WITHOUT_DEVICE();
  for (auto [H, d] : {std::pair{4, 32}, std::pair{64, 128}}) {
    const int T = 6, stride = 3 * H * d;  // the k slice of a [T, q | k | v] row
    std::vector<float> mixed = uniform(size_t(T) * stride, -1.5f, 1.5f, 21);
    std::vector<float> ref(size_t(T) * H * d);
    for (int t = 0; t < T; ++t) std::copy_n(mixed.begin() + t * stride + H * d, H * d, ref.begin() + t * H * d);
    cpu::l2_normalize_rows(ref.data(), int64_t(T) * H, d);
    const float scale = 1.0f / std::sqrt(float(d));
    for (float& e : ref) e *= scale;
    Dev<float> dm(mixed);
    cuda::l2norm_rows(dm.get() + H * d, T, H, stride, d, 1e-6f, scale, nullptr);
    const std::vector<float> got = dm.host();
    std::vector<float> gk(size_t(T) * H * d);
    for (int t = 0; t < T; ++t) std::copy_n(got.begin() + t * stride + H * d, H * d, gk.begin() + t * H * d);
    EXPECT_LT(rel_err(gk, ref), 1e-6) << "H " << H << " d " << d;
    for (int t = 0; t < T; ++t)  // q and v slices untouched
      for (int i = 0; i < H * d; ++i) ASSERT_EQ(got[size_t(t * stride + i)], mixed[size_t(t * stride + i)]);
  }
}

TEST(CudaGlm5NextKernels, KdaGatesBothForms) {
  SKIP_WITHOUT_DEVICE();
  for (auto [H, d] : {std::pair{4, 32}, std::pair{64, 128}}) {
    for (bool lb : {true, false}) {
      const int S = 7;
      const std::vector<float> f = uniform(size_t(S) * H * d, -30.0f, 30.0f, 31);  // both softplus branches
      const std::vector<float> dt = uniform(size_t(H) * d, -1.0f, 1.0f, 32),
                               a_log = uniform(size_t(H), -2.0f, 1.5f, 33);
      const std::vector<float> b = uniform(size_t(S) * H, -4.0f, 4.0f, 34);
      std::vector<float> g_ref(f.size()), b_ref(b.size());
      for (int s = 0; s < S; ++s)  // kda.cpp's formula
        for (int h = 0; h < H; ++h) {
          const float rate = std::exp(a_log[size_t(h)]);
          for (int j = 0; j < d; ++j) {
            const size_t i = size_t(s * H * d + h * d + j);
            const float x = f[i] + dt[size_t(h * d + j)];
            const float sp = x > 20.0f ? x : std::log1p(std::exp(x));
            g_ref[i] = lb ? -5.0f * sigmoid(rate * x) : -rate * sp;
          }
        }
      for (size_t i = 0; i < b.size(); ++i) b_ref[i] = sigmoid(b[i]);
      Dev<float> dg(f), ddt(dt), da(a_log), db(b);
      cuda::kda_gates(dg.get(), ddt.get(), da.get(), S, H, d, lb, -5.0f, db.get(), nullptr);
      EXPECT_LT(rel_err(dg.host(), g_ref), 1e-5) << "lower bound " << lb;
      EXPECT_LT(rel_err(db.host(), b_ref), 1e-6);
    }
  }
}

TEST(CudaGlm5NextKernels, KdaOutputNorm) {
  SKIP_WITHOUT_DEVICE();
  for (auto [H, d] : {std::pair{4, 32}, std::pair{64, 128}}) {
    const int S = 5, rows = S * H;
    const std::vector<float> o = uniform(size_t(rows) * d, -3.0f, 3.0f, 41), gate = uniform(o.size(), -4.0f, 4.0f, 42);
    const std::vector<float> w = uniform(size_t(d), 0.5f, 1.5f, 43);
    std::vector<float> ref(o.size());
    cpu::rms_norm(o.data(), w.data(), rows, d, 1e-6, ref.data());
    for (size_t i = 0; i < ref.size(); ++i) ref[i] *= sigmoid(gate[i]);
    Dev<float> dout(o), dgate(gate), dw(w);
    cuda::kda_output_norm(dout.get(), dgate.get(), dw.get(), rows, d, 1e-6f, nullptr);
    EXPECT_LT(rel_err(dout.host(), ref), 1e-5) << "H " << H << " d " << d;
  }
}

// ---------------------------------------------------------------- delta rule

struct DeltaInputs {
  std::vector<float> q, k, v, g, beta;
};

DeltaInputs delta_inputs(int T, int H, int dk, int dv, bool per_channel, uint32_t seed) {
  DeltaInputs in;
  in.q = uniform(size_t(T) * H * dk, -1.0f, 1.0f, seed);
  in.k = uniform(size_t(T) * H * dk, -1.0f, 1.0f, seed + 1);
  in.v = uniform(size_t(T) * H * dv, -1.0f, 1.0f, seed + 2);
  cpu::l2_normalize_rows(in.q.data(), int64_t(T) * H, dk);
  cpu::l2_normalize_rows(in.k.data(), int64_t(T) * H, dk);
  for (float& e : in.q) e /= std::sqrt(float(dk));
  in.g = uniform(size_t(T) * H * (per_channel ? dk : 1), -0.4f, 0.0f,
                 seed + 3);  // log decays: slow enough to keep history
  in.beta = uniform(size_t(T) * H, 0.05f, 1.0f, seed + 4);
  return in;
}

TEST(CudaGlm5NextKernels, DeltaRuleMatchesRecurrence) {
  SKIP_WITHOUT_DEVICE();
  struct Case {
    int H, dk, dv;
    bool per_channel;
  };
  for (const Case& cs : {Case{4, 32, 32, true}, Case{64, 128, 128, true}, Case{4, 32, 32, false},
                         Case{16, 128, 128, false}, Case{8, 64, 96, true}}) {
    const int H = cs.H, dk = cs.dk, dv = cs.dv;
    const cpu::DeltaRuleShape shape{H, dk, dv, cs.per_channel};
    std::vector<float> state = uniform(size_t(H) * dk * dv, -0.1f, 0.1f, 51);  // a state carried in
    Dev<float> dstate(state);
    const std::string what = "H " + std::to_string(H) + " dk " + std::to_string(dk) + " dv " + std::to_string(dv) +
                             (cs.per_channel ? " KDA" : " GDN");
    // T = 70 and 33 in one call each (the prefill kernel for dk 64 / 128: several staged token groups and a partial
    // one), then ten single tokens (the decode kernel), all on one carried state.
    uint32_t seed = 60;
    for (int T : {70, 33, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}) {
      const DeltaInputs in = delta_inputs(T, H, dk, dv, cs.per_channel, seed += 10);
      std::vector<float> out(size_t(T) * H * dv);
      cpu::delta_rule_recurrent(shape, T, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                                state.data(), out.data());
      Dev<float> dq(in.q), dk_(in.k), dv_(in.v), dg(in.g), db(in.beta), dout(out.size());
      cuda::delta_rule(T, H, dk, dv, cs.per_channel, dq.get(), dk_.get(), dv_.get(), dg.get(), db.get(), dstate.get(),
                       dout.get(), nullptr);
      EXPECT_LT(rel_err(dout.host(), out), 1e-4) << what << " T " << T;
      EXPECT_LT(rel_err(dstate.host(), state), 1e-4) << what << " T " << T;
    }
  }
}

// The chunked form (prefill runs of >= 64 tokens) against the CPU recurrence: q | k | v in one conv-output row as
// the engine passes them, a state carried in and through several calls, runs that end inside a chunk, scratch for
// one or two chunks (several launch pairs per call) or all of them, KDA and Gated DeltaNet (shared q/k heads), and
// strong decays (KDA's lower bound -5 per token; -12: 16-row spans past the factored form's limit) next to slow ones.
TEST(CudaGlm5NextKernels, DeltaRuleChunkedMatchesRecurrence) {
  SKIP_WITHOUT_DEVICE();
  struct Case {
    int H, dk, group;
    bool per_channel;
    int scratch_chunks;  // 0: enough for every chunk of the longest run
    float g_lo;
  };
  for (const Case& cs :
       {Case{4, 32, 1, true, 1, -0.4f}, Case{64, 128, 1, true, 0, -0.4f}, Case{8, 64, 1, true, 2, -5.0f},
        Case{16, 128, 2, false, 2, -0.4f}, Case{64, 128, 1, true, 2, -5.0f}, Case{4, 32, 1, true, 0, -12.0f}}) {
    const int H = cs.H, Hk = H / cs.group, d = cs.dk, QK = Hk * d, C = 2 * QK + H * d;
    const cpu::DeltaRuleShape shape{H, d, d, cs.per_channel};
    std::vector<float> state = uniform(size_t(H) * d * d, -0.1f, 0.1f, 81);
    Dev<float> dstate(state);
    const std::string what = "H " + std::to_string(H) + " d " + std::to_string(d) + (cs.per_channel ? " KDA" : " GDN") +
                             " g >= " + std::to_string(cs.g_lo);
    const int64_t per_chunk = cuda::delta_rule_chunk_floats(H, d, d);
    ASSERT_GT(per_chunk, 0) << what;
    Dev<float> scratch(size_t(per_chunk * (cs.scratch_chunks ? cs.scratch_chunks : 4)));
    uint32_t seed = 90;
    for (int T : {200, 64, 130}) {
      // q / k per q/k head, v per value head (the CPU reference takes them per value head)
      DeltaInputs in = delta_inputs(T, Hk, d, d, cs.per_channel, seed += 10);
      const DeltaInputs vin = delta_inputs(T, H, d, d, cs.per_channel, seed += 10);
      in.v = vin.v, in.beta = vin.beta;
      in.g = uniform(size_t(T) * H * (cs.per_channel ? d : 1), cs.g_lo, 0.0f, seed + 5);
      std::vector<float> row(size_t(T) * C), qr(size_t(T) * H * d), kr(qr.size());
      for (int t = 0; t < T; ++t) {
        std::copy_n(in.q.begin() + size_t(t) * QK, QK, row.begin() + size_t(t) * C);
        std::copy_n(in.k.begin() + size_t(t) * QK, QK, row.begin() + size_t(t) * C + QK);
        std::copy_n(in.v.begin() + size_t(t) * H * d, H * d, row.begin() + size_t(t) * C + 2 * QK);
        for (int h = 0; h < H; ++h) {
          std::copy_n(in.q.begin() + (size_t(t) * Hk + h / cs.group) * d, d, qr.begin() + (size_t(t) * H + h) * d);
          std::copy_n(in.k.begin() + (size_t(t) * Hk + h / cs.group) * d, d, kr.begin() + (size_t(t) * H + h) * d);
        }
      }
      std::vector<float> out(size_t(T) * H * d);
      cpu::delta_rule_recurrent(shape, T, qr.data(), kr.data(), in.v.data(), in.g.data(), in.beta.data(), state.data(),
                                out.data());
      Dev<float> drow(row), dg(in.g), db(in.beta), dout(out.size());
      cuda::DeltaRuleArgs a;
      a.T = T, a.heads = H, a.dk = d, a.dv = d, a.qk_group = cs.group, a.per_channel_decay = cs.per_channel;
      a.q = drow.get(), a.k = drow.get() + QK, a.qk_stride = C, a.v = drow.get() + 2 * QK, a.v_stride = C;
      a.g = dg.get(), a.beta = db.get(), a.state = dstate.get(), a.out = dout.get();
      a.chunk_scratch = scratch.get(), a.chunk_scratch_floats = int64_t(scratch.size());
      // run 0 the defaults, run 1 the state kernel's copies one after another, run 2 every decay factor direct
      const int run = T == 200 ? 0 : T == 64 ? 1 : 2;
      setenv("MOESRV_DELTA_RULE_OVERLAP", run == 1 ? "0" : "1", 1);
      setenv("MOESRV_DELTA_RULE_FACTOR", run == 2 ? "0" : "1", 1);
      const bool ran = cuda::delta_rule_chunked(a, nullptr);
      unsetenv("MOESRV_DELTA_RULE_OVERLAP");
      unsetenv("MOESRV_DELTA_RULE_FACTOR");
      if (!ran) {  // only where a block cannot have the kernels' shared memory (dk 64 / 128 on a 99 KB card)
        int optin = 0;
        ASSERT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0), cudaSuccess);
        EXPECT_LT(optin, 200 << 10) << what;
        break;
      }
      EXPECT_LT(rel_err(dout.host(), out), 1e-4) << what << " T " << T << " run " << run;
      EXPECT_LT(rel_err(dstate.host(), state), 1e-4) << what << " T " << T << " run " << run;
    }
  }
}

// ---------------------------------------------------------------- whole KDA / Gated DeltaNet layers

// A dense fp32 linear with random weights (uniform in +-1/sqrt(in)).
class F32Linear : public Linear {
 public:
  F32Linear(int64_t out, int64_t in, uint32_t seed) : w_(uniform(size_t(out * in), -1.0f, 1.0f, seed)) {
    in_ = in;
    out_ = out;
    for (float& e : w_) e /= std::sqrt(float(in));
  }
  void forward(const float* x, int64_t n, float* y) const override { gemm_f32(x, n, w_.data(), out_, in_, y); }
  void dequant_rows(int64_t b, int64_t e, float* out) const override {
    std::copy(w_.begin() + b * in_, w_.begin() + e * in_, out);
  }
  std::string kind() const override { return "f32"; }
  size_t stored_bytes() const override { return w_.size() * sizeof(float); }

 private:
  std::vector<float> w_;
};

// y = the columns [off, off + out) of x: lets the CPU layers' projections pass prepared values through.
class SliceLinear : public Linear {
 public:
  SliceLinear(int64_t in, int64_t off, int64_t out) : off_(off) {
    in_ = in;
    out_ = out;
  }
  void forward(const float* x, int64_t n, float* y) const override {
    for (int64_t r = 0; r < n; ++r) std::copy_n(x + r * in_ + off_, out_, y + r * out_);
  }
  void dequant_rows(int64_t b, int64_t e, float* out) const override {
    std::fill(out, out + (e - b) * in_, 0.0f);
    for (int64_t r = b; r < e; ++r) out[(r - b) * in_ + off_ + r] = 1.0f;
  }
  std::string kind() const override { return "slice"; }
  size_t stored_bytes() const override { return 0; }

 private:
  int64_t off_;
};

std::vector<float> project(const Linear& l, const std::vector<float>& x, int64_t S) {
  std::vector<float> y(size_t(S * l.out_features()));
  l.forward(x.data(), S, y.data());
  return y;
}

// cpu::kda_forward (chunked for S > 1, the recurrence for S == 1; o_proj = identity) vs the GPU chain the engine
// runs on the same projections: conv on the [S, q | k | v] rows, l2norm in place, gates, the strided recurrence,
// the gated norm.
// Single tokens also go through the fused decode kernel (kda_decode) on a second copy of the state, which must
// follow the chain and the CPU step for step.
TEST(CudaGlm5NextKernels, KdaLayerMatchesCpuKdaForward) {
  SKIP_WITHOUT_DEVICE();
  for (auto [H, d, lb] : {std::tuple{4, 32, true}, std::tuple{64, 128, true}, std::tuple{8, 64, false}}) {
    const int D = H == 4 ? 128 : 256, Hd = H * d, C = 3 * Hd, K = 4;
    ModelSpec c;
    c.hidden_size = D;
    c.rms_eps = 1e-6;
    c.linear.k_heads = c.linear.v_heads = H;
    c.linear.dk = c.linear.dv = d;
    c.linear.conv_kernel = K;
    c.linear.lower_bound_set = lb;
    c.linear.lower_bound = lb ? -5.0 : 0.0;
    KdaWeights w;
    w.q = std::make_unique<F32Linear>(Hd, D, 201);
    w.k = std::make_unique<F32Linear>(Hd, D, 202);
    w.v = std::make_unique<F32Linear>(Hd, D, 203);
    w.f_a = std::make_unique<F32Linear>(d, D, 204);
    w.f_b = std::make_unique<F32Linear>(Hd, d, 205);
    w.b = std::make_unique<F32Linear>(H, D, 206);
    w.g_a = std::make_unique<F32Linear>(d, D, 207);
    w.g_b = std::make_unique<F32Linear>(Hd, d, 208);
    w.o = std::make_unique<SliceLinear>(Hd, 0, Hd);
    w.conv = uniform(size_t(C) * K, -0.5f, 0.5f, 209);
    w.dt_bias = uniform(size_t(Hd), -4.0f, 0.0f, 210);
    w.a_log = uniform(size_t(H), -1.0f, 0.5f, 211);
    w.o_norm.weight = uniform(size_t(d), 0.5f, 1.5f, 212);
    cpu::LayerState st;

    Dev<float> dconvw(w.conv), ddt(w.dt_bias), dalog(w.a_log), dnorm(w.o_norm.weight);
    Dev<float> dconv_state(size_t(K - 1) * C), dstate(size_t(H) * d * d);
    Dev<float> fconv_state(size_t(K - 1) * C), fstate(size_t(H) * d * d);  // the fused kernel's
    uint32_t seed = 220;
    for (int S : {37, 1, 1, 1, 5}) {
      const std::vector<float> x = uniform(size_t(S) * D, -1.0f, 1.0f, seed++);
      std::vector<float> ref(size_t(S) * Hd);
      cpu::kda_forward(w, c, x.data(), S, st, ref.data());

      std::vector<float> raw(size_t(S) * C);
      const std::vector<float> q = project(*w.q, x, S), k = project(*w.k, x, S), v = project(*w.v, x, S);
      for (int s = 0; s < S; ++s) {
        std::copy_n(q.begin() + s * Hd, Hd, raw.begin() + s * C);
        std::copy_n(k.begin() + s * Hd, Hd, raw.begin() + s * C + Hd);
        std::copy_n(v.begin() + s * Hd, Hd, raw.begin() + s * C + 2 * Hd);
      }
      const std::vector<float> f = project(*w.f_b, project(*w.f_a, x, S), S), b = project(*w.b, x, S);
      const std::vector<float> gate = project(*w.g_b, project(*w.g_a, x, S), S);
      // The chain (prefill path), on dstate / dconv_state; the fused kernel for single tokens on fstate.
      auto chain = [&](float* conv_state, float* state) {
        Dev<float> draw(raw), dmixed(raw.size()), dg(f), dbeta(b), dgate(gate), dout(size_t(S) * Hd);
        cuda::causal_conv1d_silu(draw.get(), C, S, C, dconvw.get(), K, conv_state, dmixed.get(), nullptr);
        cuda::l2norm_rows(dmixed.get(), S, H, C, d, 1e-6f, 1.0f / std::sqrt(float(d)), nullptr);
        cuda::l2norm_rows(dmixed.get() + Hd, S, H, C, d, 1e-6f, 1.0f, nullptr);
        cuda::kda_gates(dg.get(), ddt.get(), dalog.get(), S, H, d, lb, float(c.linear.lower_bound), dbeta.get(),
                        nullptr);
        cuda::DeltaRuleArgs a;
        a.T = S, a.heads = H, a.dk = d, a.dv = d, a.per_channel_decay = true;
        a.q = dmixed.get(), a.k = dmixed.get() + Hd, a.qk_stride = C, a.v = dmixed.get() + 2 * Hd, a.v_stride = C;
        a.g = dg.get(), a.beta = dbeta.get(), a.state = state, a.out = dout.get();
        cuda::delta_rule(a, nullptr);
        cuda::kda_output_norm(dout.get(), dgate.get(), dnorm.get(), S * H, d, float(c.rms_eps), nullptr);
        return dout.host();
      };
      const std::vector<float> out = chain(dconv_state.get(), dstate.get());
      EXPECT_LT(rel_err(out, ref), 2e-4) << "H " << H << " d " << d << " S " << S;
      EXPECT_LT(rel_err(dstate.host(), st[StateSlot::Recurrent]), 2e-4) << "H " << H << " d " << d << " S " << S;
      EXPECT_LT(rel_err(dconv_state.host(), st[StateSlot::Conv]), 1e-6) << "H " << H << " d " << d << " S " << S;
      std::vector<float> fused;
      if (S == 1) {
        ASSERT_TRUE(cuda::kda_decode_supported(d, d, K));
        Dev<float> draw(raw), dg(f), dbeta(b), dgate(gate), dout(static_cast<size_t>(Hd));
        cuda::KdaDecodeArgs a;
        a.heads = H, a.dk = d, a.dv = d, a.conv_k = K;
        a.qkv = draw.get(), a.conv_w = dconvw.get(), a.conv_state = fconv_state.get();
        a.g = dg.get(), a.dt_bias = ddt.get(), a.a_log = dalog.get();
        a.lower_bound_set = lb, a.lower_bound = float(c.linear.lower_bound);
        a.beta = dbeta.get(), a.state = fstate.get(), a.gate = dgate.get(), a.norm_w = dnorm.get();
        a.l2_eps = 1e-6f, a.q_scale = 1.0f / std::sqrt(float(d)), a.norm_eps = float(c.rms_eps), a.out = dout.get();
        cuda::kda_decode(a, nullptr);
        fused = dout.host();
      } else {
        fused = chain(fconv_state.get(), fstate.get());
      }
      EXPECT_LT(rel_err(fused, out), 1e-5) << "fused, H " << H << " d " << d << " S " << S;
      EXPECT_LT(rel_err(fused, ref), 2e-4) << "fused, H " << H << " d " << d << " S " << S;
      EXPECT_LT(rel_err(fstate.host(), st[StateSlot::Recurrent]), 2e-4) << "fused, H " << H << " d " << d << " S " << S;
      EXPECT_LT(rel_err(fconv_state.host(), st[StateSlot::Conv]), 1e-6) << "fused, H " << H << " d " << d << " S " << S;
    }
  }
}

// cpu::gated_delta_forward (Qwen3-Next) vs the GPU chain: regroup, gates, conv, l2norm of the key heads in place,
// the recurrence with q/k shared by r value heads, the SiLU-gated norm.
TEST(CudaGlm5NextKernels, GatedDeltaLayerMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  struct Case {
    int Hk, r, dk, dv, D;
  };
  for (const Case& cs : {Case{2, 2, 32, 32, 128}, Case{16, 2, 128, 128, 256}}) {
    const int Hk = cs.Hk, r = cs.r, Hv = Hk * r, dk = cs.dk, dv = cs.dv, D = cs.D, K = 4;
    const int QK = Hk * dk, V = Hv * dv, C = 2 * QK + V, group = 2 * dk + 2 * r * dv;
    ModelSpec c;
    c.hidden_size = D;
    c.rms_eps = 1e-6;
    c.linear.k_heads = Hk;
    c.linear.v_heads = Hv;
    c.linear.dk = dk;
    c.linear.dv = dv;
    c.linear.conv_kernel = K;
    GatedDeltaWeights w;
    w.qkvz = std::make_unique<F32Linear>(int64_t(Hk) * group, D, 301);
    w.ba = std::make_unique<F32Linear>(2 * Hv, D, 302);
    w.out = std::make_unique<SliceLinear>(V, 0, V);
    w.conv = uniform(size_t(C) * K, -0.5f, 0.5f, 303);
    w.dt_bias = uniform(size_t(Hv), -2.0f, 1.0f, 304);
    w.a_log = uniform(size_t(Hv), -2.0f, 0.5f, 305);
    w.norm.weight = uniform(size_t(dv), 0.5f, 1.5f, 306);
    cpu::LayerState st;

    Dev<float> dconvw(w.conv), ddt(w.dt_bias), dalog(w.a_log), dnorm(w.norm.weight);
    Dev<float> dconv_state(size_t(K - 1) * C), dstate(size_t(Hv) * dk * dv);
    uint32_t seed = 320;
    for (int S : {37, 1, 1, 6}) {
      const std::vector<float> x = uniform(size_t(S) * D, -1.0f, 1.0f, seed++);
      std::vector<float> ref(size_t(S) * V);
      cpu::gated_delta_forward(w, c, x.data(), S, st, ref.data());

      Dev<float> dqkvz(project(*w.qkvz, x, S)), dba(project(*w.ba, x, S));
      Dev<float> draw(size_t(S) * C), dmixed(size_t(S) * C), dz(size_t(S) * V), dg(size_t(S) * Hv),
          dbeta(size_t(S) * Hv), dout(size_t(S) * V);
      cuda::gdn_split_qkvz(dqkvz.get(), S, Hk, r, dk, dv, draw.get(), dz.get(), nullptr);
      cuda::gdn_gates(dba.get(), ddt.get(), dalog.get(), S, Hk, r, dg.get(), dbeta.get(), nullptr);
      cuda::causal_conv1d_silu(draw.get(), C, S, C, dconvw.get(), K, dconv_state.get(), dmixed.get(), nullptr);
      cuda::l2norm_rows(dmixed.get(), S, Hk, C, dk, 1e-6f, 1.0f / std::sqrt(float(dk)), nullptr);
      cuda::l2norm_rows(dmixed.get() + QK, S, Hk, C, dk, 1e-6f, 1.0f, nullptr);
      cuda::DeltaRuleArgs a;
      a.T = S, a.heads = Hv, a.dk = dk, a.dv = dv, a.qk_group = r, a.per_channel_decay = false;
      a.q = dmixed.get(), a.k = dmixed.get() + QK, a.qk_stride = C, a.v = dmixed.get() + 2 * QK, a.v_stride = C;
      a.g = dg.get(), a.beta = dbeta.get(), a.state = dstate.get(), a.out = dout.get();
      cuda::delta_rule(a, nullptr);
      cuda::gdn_output_norm(dout.get(), dz.get(), dnorm.get(), S * Hv, dv, float(c.rms_eps), nullptr);
      EXPECT_LT(rel_err(dout.host(), ref), 2e-4) << "Hk " << Hk << " S " << S;
      EXPECT_LT(rel_err(dstate.host(), st[StateSlot::Recurrent]), 2e-4) << "Hk " << Hk << " S " << S;
      EXPECT_LT(rel_err(dconv_state.host(), st[StateSlot::Conv]), 1e-6) << "Hk " << Hk << " S " << S;
    }
  }
}

// ---------------------------------------------------------------- mHC

// A spec with n mHC residual streams of width D (20 Sinkhorn iterations, eps 1e-6), as the mHC tests use.
ModelSpec hyper_spec(int D, int n) {
  ModelSpec c;
  c.hidden_size = D;
  c.rms_eps = 1e-6;
  c.residual.hyper = true;
  c.residual.streams = n;
  c.residual.sinkhorn_iters = 20;
  c.residual.eps = 1e-6;
  return c;
}

TEST(CudaGlm5NextKernels, HyperConnectionsMatchResidual) {
  SKIP_WITHOUT_DEVICE();
  // S = 1, 6: the sums spread over blocks, h and the weights from different blocks (decode path, the weights also on
  // a side stream as the engine runs them; or one block per token without scratch); S = 40: one block per token, or
  // (with a cuBLAS handle, as the engine runs prefill) the logits from one GEMM, the streams in registers (1, 2 and 4
  // values per thread at D = 128, 2048, 4096).
  cublasHandle_t blas = nullptr;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  cuda::HyperSide side;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side.stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&side.fork, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&side.join, cudaEventDisableTiming), cudaSuccess);
  struct Shape {
    int D, S;
    bool gemm, single;  // single: no scratch, so few tokens also take one block per token
    bool on_side = false;
  };
  for (auto [D, S, gemm, single, on_side] :
       {Shape{128, 6, false, false}, Shape{4096, 6, false, false}, Shape{4096, 1, false, false},
        Shape{4096, 1, false, false, true}, Shape{4096, 6, false, false, true}, Shape{4096, 6, false, true},
        Shape{128, 40, false, false}, Shape{4096, 40, false, false}, Shape{128, 40, true, false},
        Shape{4096, 40, true, false}, Shape{2048, 40, true, false}}) {
    const int n = 4, W = n * D, mix = (2 + n) * n;
    const ModelSpec c = hyper_spec(D, n);
    HyperWeights hw;
    hw.fn = uniform(size_t(mix) * W, -1.0f, 1.0f, 71);
    for (float& e : hw.fn) e /= std::sqrt(float(W));  // logits of order 1
    hw.base = uniform(size_t(mix), -1.0f, 1.0f, 72);
    hw.scale = uniform(3, 0.5f, 2.0f, 73);
    NormWeights norm;
    norm.weight = uniform(size_t(D), 0.5f, 1.5f, 74);
    std::vector<float> x = uniform(size_t(S) * W, -2.0f, 2.0f, 75);
    for (int s = 0; s < S; ++s)  // streams of different scales
      for (int i = 0; i < n; ++i)
        for (int d = 0; d < D; ++d) x[size_t(s * W + i * D + d)] *= 0.5f + float(i);
    const std::vector<float> y = uniform(size_t(S) * D, -1.0f, 1.0f, 76);

    Dev<float> dx(x), dfn(hw.fn), dbase(hw.base), dscale(hw.scale), dnorm(norm.weight), dy(y);
    Dev<float> dh(size_t(S) * D), dpost(size_t(S) * n), dcomb(size_t(S) * n * n);
    Dev<float> dpart(std::max<size_t>(1, cuda::hyper_enter_scratch(S, n)));
    cudaStream_t st = nullptr;
    if (on_side) {
      ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
    }
    const bool joined =
        cuda::hyper_enter(dx.get(), S, n, D, dfn.get(), dscale.get(), dbase.get(), dnorm.get(), float(c.rms_eps),
                          float(c.residual.eps), int(c.residual.sinkhorn_iters), dh.get(), dpost.get(), dcomb.get(),
                          single ? nullptr : dpart.get(), st, gemm ? blas : nullptr, on_side ? &side : nullptr);
    ASSERT_EQ(joined, on_side);
    if (joined) {
      ASSERT_EQ(cudaStreamWaitEvent(st, side.join, 0), cudaSuccess);
    }
    cuda::hyper_leave(dx.get(), dy.get(), dpost.get(), dcomb.get(), S, n, D, st);
    if (st) {
      ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
      cudaStreamDestroy(st);
    }

    std::vector<float> pre(static_cast<size_t>(n)), post(size_t(S) * n), comb(size_t(S) * n * n);
    for (int s = 0; s < S; ++s)
      cpu::hyper_mix(x.data() + s * W, hw, n, D, c.rms_eps, c.residual.eps, c.residual.sinkhorn_iters, pre.data(),
                     post.data() + s * n, comb.data() + s * n * n);
    cpu::Residual res(c);
    std::vector<float> h(size_t(S) * D);
    res.enter(x.data(), S, norm, hw, h.data());
    res.leave(x.data(), S, y.data());

    EXPECT_LT(rel_err(dpost.host(), post), 1e-5) << "D " << D << " S " << S << " gemm " << gemm;
    EXPECT_LT(rel_err(dcomb.host(), comb), 1e-5) << "D " << D << " S " << S << " gemm " << gemm;
    EXPECT_LT(rel_err(dh.host(), h), 1e-5) << "D " << D << " S " << S << " gemm " << gemm;
    EXPECT_LT(rel_err(dx.host(), x), 1e-5) << "D " << D << " S " << S << " gemm " << gemm << " side " << on_side;
    // The Sinkhorn result is close to doubly stochastic: columns sum to ~1.
    const std::vector<float> cg = dcomb.host();
    for (int j = 0; j < n; ++j) {
      float sum = 0;
      for (int i = 0; i < n; ++i) sum += cg[size_t(i * n + j)];
      EXPECT_NEAR(sum, 1.0f, 1e-3f);
    }

    // Embedding expansion and the final mean.
    const std::vector<float> e = uniform(size_t(S) * D, -1.0f, 1.0f, 77);
    Dev<float> de(e), dxe(size_t(S) * W), dmean(size_t(S) * D);
    cuda::hyper_expand(de.get(), S, n, D, dxe.get(), nullptr);
    cuda::hyper_collapse_mean(dx.get(), S, n, D, dmean.get(), nullptr);
    const std::vector<float> xe = dxe.host();
    for (int s = 0; s < S; ++s)
      for (int i = 0; i < n; ++i)
        for (int d = 0; d < D; ++d) ASSERT_EQ(xe[size_t(s * W + i * D + d)], e[size_t(s * D + d)]);
    std::vector<float> mean(size_t(S) * D, 0.0f);
    for (int s = 0; s < S; ++s) {
      for (int i = 0; i < n; ++i) cpu::axpy(1.0f, x.data() + s * W + i * D, D, mean.data() + s * D);
      for (int d = 0; d < D; ++d) mean[size_t(s * D + d)] /= float(n);
    }
    EXPECT_LT(rel_err(dmean.host(), mean), 1e-5) << "D " << D << " S " << S;
  }
  cudaEventDestroy(side.fork);
  cudaEventDestroy(side.join);
  cudaStreamDestroy(side.stream);
  cublasDestroy(blas);
}

// hyper_step (decode): enter A, then leave A fused with enter B, then a plain leave B, against cpu::Residual; twice
// in a row, with the Sinkhorn weights on a side stream or by block 0. Every shape's calls share one scratch, as the
// engine's calls of different token counts do (the barrier counters return to zero and never move).
TEST(CudaGlm5NextKernels, HyperStepMatchesResidual) {
  SKIP_WITHOUT_DEVICE();
  cuda::HyperSide side;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side.stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&side.fork, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&side.join, cudaEventDisableTiming), cudaSuccess);
  struct Shape {
    int D, S, n;
    bool on_side;
  };
  Dev<float> dscratch(cuda::hyper_step_scratch(4));  // (zeroed) the largest n below
  for (auto [D, S, n, on_side] : {Shape{4096, 1, 4, true}, Shape{4096, 3, 4, true}, Shape{4096, 1, 4, false},
                                  Shape{4096, 2, 4, false}, Shape{4096, 1, 4, true}, Shape{200, 16, 4, false},
                                  Shape{128, 2, 2, true}, Shape{1000, 1, 3, false}, Shape{4096, 1, 4, true}}) {
    ASSERT_TRUE(cuda::hyper_step_supported(S, n, D));
    const int W = n * D, mix = (2 + n) * n;
    const ModelSpec c = hyper_spec(D, n);
    HyperWeights hw[2];
    for (int k = 0; k < 2; ++k) {
      hw[k].fn = uniform(size_t(mix) * W, -1.0f, 1.0f, 81 + 3 * k);
      for (float& e : hw[k].fn) e /= std::sqrt(float(W));
      hw[k].base = uniform(size_t(mix), -1.0f, 1.0f, 82 + 3 * k);
      hw[k].scale = uniform(3, 0.5f, 2.0f, 83 + 3 * k);
    }
    NormWeights norm;
    norm.weight = uniform(size_t(D), 0.5f, 1.5f, 88);
    std::vector<float> x = uniform(size_t(S) * W, -2.0f, 2.0f, 89);
    const std::vector<float> ya = uniform(size_t(S) * D, -1.0f, 1.0f, 90), yb = uniform(size_t(S) * D, -1.0f, 1.0f, 91);

    Dev<float> dx(x), dya(ya), dyb(yb), dnorm(norm.weight), dh(size_t(S) * D), dpost(size_t(S) * n);
    Dev<float> dcomb(size_t(S) * n * n);
    Dev<float> dfn[2] = {Dev<float>(hw[0].fn), Dev<float>(hw[1].fn)};
    Dev<float> dbase[2] = {Dev<float>(hw[0].base), Dev<float>(hw[1].base)};
    Dev<float> dscale[2] = {Dev<float>(hw[0].scale), Dev<float>(hw[1].scale)};
    cudaStream_t st = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
    cpu::Residual res(c);
    for (int round = 0; round < 2; ++round)
      for (int k = 0; k < 2; ++k) {
        std::vector<float> h(size_t(S) * D);
        if (k == 1) res.leave(x.data(), S, ya.data());
        res.enter(x.data(), S, norm, hw[k], h.data());
        std::vector<float> pre(static_cast<size_t>(n)), post(size_t(S) * n), comb(size_t(S) * n * n);
        for (int s = 0; s < S; ++s)
          cpu::hyper_mix(x.data() + s * W, hw[k], n, D, c.rms_eps, c.residual.eps, c.residual.sinkhorn_iters,
                         pre.data(), post.data() + s * n, comb.data() + s * n * n);
        const bool joined = cuda::hyper_step(dx.get(), k == 1 ? dya.get() : nullptr, S, n, D, dfn[k].get(),
                                             dscale[k].get(), dbase[k].get(), dnorm.get(), float(c.rms_eps),
                                             float(c.residual.eps), int(c.residual.sinkhorn_iters), dh.get(),
                                             dpost.get(), dcomb.get(), dscratch.get(), st, on_side ? &side : nullptr);
        ASSERT_EQ(joined, on_side);
        if (joined) {
          ASSERT_EQ(cudaStreamWaitEvent(st, side.join, 0), cudaSuccess);
        }
        ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
        const std::string at = "D " + std::to_string(D) + " S " + std::to_string(S) + " n " + std::to_string(n) +
                               " side " + std::to_string(on_side) + " round " + std::to_string(round) + " site " +
                               std::to_string(k);
        EXPECT_LT(rel_err(dh.host(), h), 1e-5) << at;
        EXPECT_LT(rel_err(dpost.host(), post), 1e-5) << at;
        EXPECT_LT(rel_err(dcomb.host(), comb), 1e-5) << at;
        EXPECT_LT(rel_err(dx.host(), x), 1e-5) << at;
        if (k == 1) {  // the site's own leave, apart (the engine's last one before the head)
          res.leave(x.data(), S, yb.data());
          cuda::hyper_leave(dx.get(), dyb.get(), dpost.get(), dcomb.get(), S, n, D, st);
          ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
          EXPECT_LT(rel_err(dx.host(), x), 1e-5) << at;
        }
      }
    // every barrier's arrival count back at zero (the scratch starts with the 16 token slots' counts)
    const std::vector<float> sc = dscratch.host(16);
    for (int s = 0; s < 16; ++s) EXPECT_EQ(sc[size_t(s)], 0.0f) << s;
    cudaStreamDestroy(st);
  }
  cudaEventDestroy(side.fork);
  cudaEventDestroy(side.join);
  cudaStreamDestroy(side.stream);
}

// ---------------------------------------------------------------- k-pool indexer

struct KpoolCase {
  int nh, d, kpool, topk;
  std::vector<int> batches;
};

void run_kpool_case(const KpoolCase& kc) {
  const int nh = kc.nh, d = kc.d, kp = kc.kpool, budget = kc.topk / kp, sel_k = kc.topk + kp;
  int total = 0;
  for (int S : kc.batches) total += S;
  const int max_pools = total / kp + 1;
  ModelSpec c;
  c.index_n_heads = nh;
  c.index_head_dim = d;
  c.index_kpool = kp;
  c.index_topk = kc.topk;
  c.index_select_tail = true;
  // CPU indexer inputs per token: x = [k (d) | gate logits (d) | head weights (nh)], q_latent = q (nh*d).
  const int64_t xw = 2 * d + nh;
  IndexerWeights w;
  w.wq_b = std::make_unique<SliceLinear>(int64_t(nh) * d, 0, int64_t(nh) * d);
  w.wk = std::make_unique<SliceLinear>(xw, 0, d);
  w.pool_gate = std::make_unique<SliceLinear>(xw, d, d);
  w.weights_proj = std::make_unique<SliceLinear>(xw, 2 * d, nh);
  w.k_norm.weight = uniform(size_t(d), 0.5f, 1.5f, 81);
  w.k_norm.bias = uniform(size_t(d), -0.2f, 0.2f, 82);
  w.pool_ape = uniform(size_t(kp) * d, -1.0f, 1.0f, 83);
  cpu::LayerState st;

  Dev<float> dpool(size_t(max_pools) * d), dopen_k(size_t(kp) * d), dopen_g(size_t(kp) * d), dape(w.pool_ape);
  Dev<int32_t> dpos(1);
  int pos0 = 0, near_ties = 0, queries = 0;
  uint32_t seed = 90;
  for (int S : kc.batches) {
    std::vector<float> x = uniform(size_t(S) * xw, -2.0f, 2.0f, seed++);
    const std::vector<float> qv = uniform(size_t(S) * nh * d, -1.0f, 1.0f, seed++);
    for (int s = 0; s < S; ++s)  // head weights in [-0.5, 1.5]
      for (int h = 0; h < nh; ++h) x[size_t(s * xw + 2 * d + h)] = 0.5f * x[size_t(s * xw + 2 * d + h)] + 0.5f;
    const cpu::TokenSelection ref = cpu::kpool_select(w, c, x.data(), qv.data(), S, pos0, st);

    // GPU inputs: LayerNorm'd keys, gate logits, head weights scaled by nh^-0.5 (what the engine will feed).
    std::vector<float> k(size_t(S) * d), g(size_t(S) * d), hwv(size_t(S) * nh);
    for (int s = 0; s < S; ++s) {
      std::copy_n(x.begin() + s * xw, d, k.begin() + s * d);
      std::copy_n(x.begin() + s * xw + d, d, g.begin() + s * d);
      for (int h = 0; h < nh; ++h)
        hwv[size_t(s * nh + h)] = x[size_t(s * xw + 2 * d + h)] * (1.0f / std::sqrt(float(nh)));
    }
    cpu::layer_norm(k.data(), w.k_norm.weight.data(), w.k_norm.bias.data(), S, d, 1e-6, k.data());
    // scratch for the split top-k too (the engine's), used when S <= 8 and the rows are long
    const size_t scratch = cuda::kpool_select_scratch(S, max_pools, budget);
    Dev<float> dk(k), dg(g), dq(qv), dhw(hwv), dscratch(scratch);
    Dev<int32_t> dsel(size_t(S) * sel_k);
    dpos.put({pos0});
    cuda::kpool_append(dk.get(), dg.get(), dape.get(), S, d, kp, dpos.get(), dpool.get(), dopen_k.get(), dopen_g.get(),
                       nullptr);
    cuda::kpool_select(dq.get(), dhw.get(), dpool.get(), S, nh, d, kp, budget, true, dpos.get(), max_pools,
                       dscratch.get(), scratch, dsel.get(), sel_k, nullptr);

    // State: pooled keys and the open pool's rows.
    const int pools = (pos0 + S) / kp, open = (pos0 + S) % kp;
    ASSERT_EQ(st[StateSlot::PoolK].size(), size_t(pools) * d);
    EXPECT_LT(rel_err(dpool.host(size_t(pools) * d), st[StateSlot::PoolK]), 1e-5) << "pos0 " << pos0 << " S " << S;
    const std::vector<float> ok_ = dopen_k.host(), og = dopen_g.host();
    for (int t = 0; t < open * d; ++t) {
      ASSERT_EQ(ok_[size_t(t)], st[StateSlot::Open][size_t(t)]) << "open key " << t;
      ASSERT_EQ(og[size_t(t)], st[StateSlot::OpenG][size_t(t)]) << "open gate " << t;
    }

    // Selection: equal sets, except where the k-th best pool nearly ties with another (fp32 summation order).
    const std::vector<int32_t> sel = dsel.host();
    for (int s = 0; s < S; ++s) {
      const int p = pos0 + s;
      ++queries;
      std::vector<int32_t> got;
      bool padded = false;
      for (int i = 0; i < sel_k; ++i) {
        const int32_t v = sel[size_t(s * sel_k + i)];
        if (v < 0) {
          padded = true;
          continue;
        }
        ASSERT_FALSE(padded) << "position after -1 padding, query " << p;
        if (!got.empty()) {
          ASSERT_LT(got.back(), v) << "not ascending, query " << p;
        }
        got.push_back(v);
      }
      if (got == ref[size_t(s)]) continue;
      // Differences must be pools scored within 1e-4 (relative) of the budget-th best score.
      const int vis = (p + 1) / kp;
      std::vector<double> sc(static_cast<size_t>(vis));
      for (int P = 0; P < vis; ++P) {
        double acc = 0;
        for (int h = 0; h < nh; ++h) {
          double dot = 0;
          for (int j = 0; j < d; ++j)
            dot += double(qv[size_t((s * nh + h) * d + j)]) * st[StateSlot::PoolK][size_t(P * d + j)];
          acc += double(hwv[size_t(s * nh + h)]) * std::max(dot / std::sqrt(double(d)), 0.0);
        }
        sc[size_t(P)] = acc;
      }
      ASSERT_GT(vis, budget) << "query " << p << ": every pool is selected, yet the selections differ";
      std::vector<double> sorted = sc;
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      const double kth = sorted[size_t(budget - 1)], mag = std::max(std::abs(sorted[0]), 1e-30);
      std::vector<int32_t> diff;
      std::set_symmetric_difference(got.begin(), got.end(), ref[size_t(s)].begin(), ref[size_t(s)].end(),
                                    std::back_inserter(diff));
      for (int32_t pos : diff) {
        ASSERT_LT(pos, vis * kp) << "tail positions differ, query " << p;
        EXPECT_LE(std::abs(sc[size_t(pos / kp)] - kth), 1e-4 * mag)
            << "query " << p << " pool " << pos / kp << " score " << sc[size_t(pos / kp)] << " vs k-th " << kth;
      }
      ++near_ties;
    }
    pos0 += S;
  }
  std::printf("k-pool nh %d d %d kpool %d topk %d: %d of %d queries differ only at near-tied pools\n", nh, d, kp,
              kc.topk, near_ties, queries);
  EXPECT_LE(near_ties * 50, queries);
}

// Head dims of 16 score on tensor cores (queries as the MMA's columns for batches of more than 8, heads for up to 8);
// 20 (not a multiple of 16) by the fp32 lanes kernel, 18 (not a multiple of 4) by the warp-per-pool kernel.
TEST(CudaGlm5NextKernels, KpoolIndexerTinyShapes) {
  SKIP_WITHOUT_DEVICE();
  run_kpool_case({16, 16, 4, 16, {37, 1, 1, 1, 1, 1, 6}});
  run_kpool_case({12, 16, 4, 16, {37, 1, 1, 1, 6}});  // a head tile of 8 half full
  run_kpool_case({16, 20, 4, 16, {37, 1, 1, 1, 6}});
  run_kpool_case({12, 18, 4, 16, {37, 1, 1, 1, 6}});
}

// (Batches of more than 8 queries and single queries both score on tensor cores: against the CPU.)
TEST(CudaGlm5NextKernels, KpoolIndexerRealWidth) {
  SKIP_WITHOUT_DEVICE();
  run_kpool_case({32, 128, 4, 2048, {2999, 1, 1, 1, 1, 1, 7}});
}

// The top-k of kpool_select (binned, with the radix select as its fallback) with many exactly tied scores: pool keys
// repeat a few distinct random rows, so equal rows score bit-identically; the chosen pools must be the best `budget`
// with ties at the k-th score going to the lower pool index (the indexer's rule), in ascending order, then the open
// pool's tail. 600 and 5000 pools over 40 rows: the k-th score's bin is ranked alone; 20000 over 4 rows: that bin
// holds more scores than the ranking takes (the radix fallback); 60000: more than the top-k stages in shared memory
// (global passes, radix).
TEST(CudaGlm5NextKernels, KpoolSelectTiesGoToLowerPools) {
  SKIP_WITHOUT_DEVICE();
  const int nh = 4, d = 32, kp = 4, budget = 100;
  for (auto [pools, distinct] : {std::pair{600, 40}, {5000, 40}, {20000, 4}, {60000, 40}}) {
    const int p = pools * kp + 1, max_pools = pools + 1, sel_k = budget * kp + kp - 1;
    const std::vector<float> rows = uniform(size_t(distinct) * d, -1.0f, 1.0f, 77),
                             q = uniform(size_t(nh) * d, -1, 1, 78);
    const std::vector<float> hw = uniform(size_t(nh), 0.1f, 1.0f, 79);
    std::vector<float> pool_k(size_t(max_pools) * d, 0.0f);
    std::mt19937 rng(80);
    std::vector<int> row_of(static_cast<size_t>(pools));
    for (int P = 0; P < pools; ++P) {
      row_of[size_t(P)] = int(rng() % unsigned(distinct));
      std::copy_n(rows.begin() + row_of[size_t(P)] * d, d, pool_k.begin() + int64_t(P) * d);
    }
    std::vector<double> row_score(static_cast<size_t>(distinct));
    for (int r = 0; r < distinct; ++r)
      for (int h = 0; h < nh; ++h) {
        double dot = 0;
        for (int j = 0; j < d; ++j) dot += double(q[size_t(h * d + j)]) * rows[size_t(r * d + j)];
        row_score[size_t(r)] += hw[size_t(h)] * std::max(dot / std::sqrt(double(d)), 0.0);
      }
    std::vector<int> order(static_cast<size_t>(pools));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return row_score[size_t(row_of[size_t(a)])] > row_score[size_t(row_of[size_t(b)])];
    });
    std::vector<int> chosen(order.begin(), order.begin() + budget);
    std::sort(chosen.begin(), chosen.end());
    std::vector<int32_t> want;
    for (int P : chosen)
      for (int t = 0; t < kp; ++t) want.push_back(P * kp + t);
    for (int t = pools * kp; t <= p; ++t) want.push_back(t);
    want.resize(size_t(sel_k), -1);

    // scratch of one row: one block per query; with room for the candidates: the top-k split over blocks (rows of
    // more than 4 x 8 x budget pools)
    for (size_t scratch : {size_t(max_pools), cuda::kpool_select_scratch(1, max_pools, budget)}) {
      Dev<float> dq(q), dhw(hw), dpool(pool_k), dscratch(scratch);
      Dev<int32_t> dpos(std::vector<int32_t>{p}), dsel(static_cast<size_t>(sel_k));
      cuda::kpool_select(dq.get(), dhw.get(), dpool.get(), 1, nh, d, kp, budget, true, dpos.get(), max_pools,
                         dscratch.get(), scratch, dsel.get(), sel_k, nullptr);
      EXPECT_EQ(dsel.host(), want) << pools << " pools, scratch " << scratch;
    }
  }
}

// The sigmoid router (DeepSeek-V3 / GLM: correction bias for the choice, optional group limit) against route_token,
// with logits on a coarse grid so that many scores tie exactly: ids in pick order and weights must match.
// The router fields of a ModelSpec (route_token's inputs).
ModelSpec router_config(RouterKind kind, int E, int k, int groups, int topk_groups, bool norm, double scaling) {
  ModelSpec c;
  c.router = kind;
  c.n_routed_experts = E;
  c.experts_per_token = k;
  c.n_group = groups;
  c.topk_group = topk_groups;
  c.norm_topk_prob = norm;
  c.routed_scaling_factor = scaling;
  return c;
}

TEST(CudaGlm5NextKernels, SigmoidRouterMatchesRouteToken) {
  SKIP_WITHOUT_DEVICE();
  struct Case {
    int E, k, groups, topk_groups;
    bool norm;
    float levels;  // logits rounded to multiples of 1/levels (0: continuous)
  };
  for (const Case& cs : {Case{288, 8, 1, 1, true, 0}, Case{288, 8, 1, 1, true, 4}, Case{256, 8, 8, 4, true, 0},
                         Case{256, 8, 8, 4, true, 2}, Case{64, 6, 1, 1, false, 0}, Case{1024, 16, 16, 3, true, 8}}) {
    const int S = 13;
    const ModelSpec c = router_config(RouterKind::SigmoidGroup, cs.E, cs.k, cs.groups, cs.topk_groups, cs.norm, 2.5);
    std::vector<float> logits = uniform(size_t(S) * cs.E, -4.0f, 4.0f, 500 + uint32_t(cs.E));
    std::vector<float> bias = uniform(size_t(cs.E), -0.05f, 0.05f, 501);
    if (cs.levels > 0) {
      for (float& v : logits) v = std::round(v * cs.levels) / cs.levels;
      std::fill(bias.begin(), bias.end(), 0.0f);
    }
    Dev<float> dlogits(logits), dbias(bias), dw(size_t(S) * cs.k);
    Dev<int32_t> dids(size_t(S) * cs.k);
    cuda::RouterArgs ra;
    ra.E = cs.E, ra.groups = cs.groups, ra.topk_groups = cs.topk_groups, ra.k = cs.k, ra.norm_topk = cs.norm;
    ra.scaling = 2.5f;
    cuda::route(dlogits.get(), dbias.get(), S, ra, dids.get(), dw.get(), nullptr);
    const std::vector<int32_t> ids = dids.host();
    const std::vector<float> w = dw.host();
    for (int s = 0; s < S; ++s) {
      const RoutedExperts r = route_token(logits.data() + int64_t(s) * cs.E, bias.data(), c);
      for (int j = 0; j < cs.k; ++j) {
        EXPECT_EQ(ids[size_t(s * cs.k + j)], r.ids[size_t(j)]) << "E " << cs.E << " token " << s << " pick " << j;
        EXPECT_NEAR(w[size_t(s * cs.k + j)], r.weights[size_t(j)], 1e-6f * std::max(1.0f, r.weights[size_t(j)]))
            << "E " << cs.E << " token " << s << " pick " << j;
      }
    }
  }
}

// cuda::route_fused (router logits + routing in one launch) bitwise vs cuda::route on the same logits, and vs
// route_token. Weights and hidden rows are small dyadic numbers, so every fp32 summation order gives the exact logits
// (and many ties). Launches follow each other on one ticket; the first has no correction bias, so that the GPU's and
// the CPU's sigmoids (an ulp apart) cannot swap near-tied choices against route_token. Then a graph is replayed.
std::vector<float> dyadic(size_t n, int lo, int hi, float denom, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = float(u(rng)) / denom;
  return v;
}

TEST(CudaGlm5NextKernels, FusedRouterMatchesRouteToken) {
  SKIP_WITHOUT_DEVICE();
  struct Case {
    RouterKind kind;
    int E, k, groups, topk_groups, D;
    bool shared;
  };
  const Case cases[] = {{RouterKind::SigmoidGroup, 288, 8, 1, 1, 4096, true},
                        {RouterKind::SigmoidGroup, 288, 8, 1, 1, 4096, false},
                        {RouterKind::SigmoidGroup, 256, 8, 8, 4, 3000, true},  // a partial last column slice
                        {RouterKind::SigmoidGroup, 1024, 16, 16, 3, 1024, false},
                        {RouterKind::Softmax, 512, 10, 1, 1, 2048, false},
                        {RouterKind::Softmax, 64, 4, 8, 3, 64, true}};
  uint32_t seed = 600;
  for (const Case& cs : cases)
    for (int S : {1, 3, 8}) {
      const ModelSpec c = router_config(cs.kind, cs.E, cs.k, cs.groups, cs.topk_groups, true, 2.5);
      const std::vector<float> router = dyadic(size_t(cs.E) * cs.D, -4, 4, 64.0f, seed++);
      const std::vector<float> bias = uniform(size_t(cs.E), -0.05f, 0.05f, seed++), no_bias(size_t(cs.E), 0.0f);
      const int row = cs.k + (cs.shared ? 1 : 0);
      Dev<float> drouter(router), dbias(size_t(cs.E)), dh(size_t(S) * cs.D), dlogits(size_t(S) * cs.E);
      Dev<float> dpart(cuda::route_fused_floats(S, cs.E, cs.D)), dw(size_t(S) * row), dw_ref(size_t(S) * row);
      Dev<int32_t> dids(size_t(S) * row), dids_ref(size_t(S) * row);
      Dev<uint32_t> dcounts(size_t(cs.E)), dcounts_ref(size_t(cs.E)), dtokens(1), dtokens_ref(1);
      Dev<unsigned> ticket(1);
      ASSERT_TRUE(cuda::route_fused_supported(S, cs.E, cs.D, drouter.get(), dh.get()));
      cuda::RouterArgs ra;
      ra.E = cs.E, ra.groups = cs.groups, ra.topk_groups = cs.topk_groups, ra.k = cs.k, ra.scaling = 2.5f;
      ra.softmax = cs.kind == RouterKind::Softmax, ra.shared_id = cs.shared ? cs.E : -1;
      cuda::RouterArgs ra_ref = ra;
      ra.counts = dcounts.get(), ra.tokens = dtokens.get();
      ra_ref.counts = dcounts_ref.get(), ra_ref.tokens = dtokens_ref.get();
      const std::string what = "E " + std::to_string(cs.E) + " D " + std::to_string(cs.D) + " S " + std::to_string(S);
      for (int launch = 0; launch < 3; ++launch) {  // one ticket, launches in a row
        const std::vector<float> h = dyadic(size_t(S) * cs.D, -8, 8, 32.0f, seed++);
        std::vector<float> logits(size_t(S) * cs.E);
        for (int t = 0; t < S; ++t)
          for (int e = 0; e < cs.E; ++e) {
            double acc = 0;
            for (int d = 0; d < cs.D; ++d) acc += double(router[size_t(e) * cs.D + d]) * h[size_t(t) * cs.D + d];
            logits[size_t(t) * cs.E + e] = float(acc);  // exact
          }
        dh.put(h), dlogits.put(logits), dbias.put(launch == 0 ? no_bias : bias);
        cuda::route_fused(drouter.get(), dh.get(), dbias.get(), S, cs.D, ra, dpart.get(), ticket.get(), dids.get(),
                          dw.get(), nullptr);
        cuda::route(dlogits.get(), dbias.get(), S, ra_ref, dids_ref.get(), dw_ref.get(), nullptr);
        const std::vector<int32_t> ids = dids.host();
        const std::vector<float> w = dw.host();
        EXPECT_EQ(ids, dids_ref.host()) << what;
        EXPECT_EQ(w, dw_ref.host()) << what;
        for (int t = 0; t < S && launch == 0; ++t) {
          const RoutedExperts r = route_token(logits.data() + int64_t(t) * cs.E, no_bias.data(), c);
          const size_t first = size_t(t) * row + (cs.shared ? 1 : 0);
          if (cs.shared) {
            EXPECT_EQ(ids[first - 1], cs.E) << what << " token " << t;
            EXPECT_EQ(w[first - 1], 1.0f) << what << " token " << t;
          }
          for (int j = 0; j < cs.k; ++j) {
            EXPECT_EQ(ids[first + j], r.ids[size_t(j)]) << what << " token " << t << " pick " << j;
            EXPECT_NEAR(w[first + j], r.weights[size_t(j)], 1e-6f * std::max(1.0f, r.weights[size_t(j)]))
                << what << " token " << t << " pick " << j;
          }
        }
        EXPECT_EQ(ticket.host(), std::vector<unsigned>{0u}) << what;
      }
      EXPECT_EQ(dcounts.host(), dcounts_ref.host()) << what;
      EXPECT_EQ(dtokens.host(), std::vector<uint32_t>{uint32_t(3 * S)}) << what;
    }
}

// route_fused captured once in a CUDA graph and replayed with new hidden rows: every replay routes its own rows
// (no correction bias, as above).
TEST(CudaGlm5NextKernels, FusedRouterGraphReplays) {
  SKIP_WITHOUT_DEVICE();
  const int E = 288, k = 8, D = 4096, S = 1;
  const ModelSpec c = router_config(RouterKind::SigmoidGroup, E, k, 1, 1, true, 2.5);
  const std::vector<float> router = dyadic(size_t(E) * D, -4, 4, 64.0f, 700);
  const std::vector<float> bias(size_t(E), 0.0f);
  Dev<float> drouter(router), dbias(bias), dh(size_t(S) * D), dpart(cuda::route_fused_floats(S, E, D)),
      dw(static_cast<size_t>(k));
  Dev<int32_t> dids(static_cast<size_t>(k));
  Dev<unsigned> ticket(1);
  cuda::RouterArgs ra;
  ra.E = E, ra.k = k, ra.scaling = 2.5f;
  cudaStream_t st = nullptr;
  ok(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ok(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 2; ++i)  // two launches per replay (the second routes the same rows)
    cuda::route_fused(drouter.get(), dh.get(), dbias.get(), S, D, ra, dpart.get(), ticket.get(), dids.get(), dw.get(),
                      st);
  ok(cudaStreamEndCapture(st, &graph));
  ok(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 5; ++replay) {
    const std::vector<float> h = dyadic(size_t(D), -8, 8, 32.0f, 702 + uint32_t(replay));
    std::vector<float> logits(static_cast<size_t>(E));
    for (int e = 0; e < E; ++e) {
      double acc = 0;
      for (int d = 0; d < D; ++d) acc += double(router[size_t(e) * D + d]) * h[size_t(d)];
      logits[size_t(e)] = float(acc);
    }
    dh.put(h);
    ok(cudaGraphLaunch(exec, st));
    ok(cudaStreamSynchronize(st));
    const RoutedExperts r = route_token(logits.data(), bias.data(), c);
    EXPECT_EQ(dids.host(), r.ids) << "replay " << replay;
    EXPECT_LT(rel_err(dw.host(), r.weights), 1e-6) << "replay " << replay;
    EXPECT_EQ(ticket.host(), std::vector<unsigned>{0u}) << "replay " << replay;
  }
  ok(cudaGraphExecDestroy(exec));
  ok(cudaGraphDestroy(graph));
  ok(cudaStreamDestroy(st));
}

// ---------------------------------------------------------------- clamped SwiGLU

TEST(CudaGlm5NextKernels, SiluMulClamped) {
  SKIP_WITHOUT_DEVICE();
  const int rows = 5, I = 300;
  const std::vector<float> gu = uniform(size_t(rows) * 2 * I, -3.0f, 3.0f, 99);
  for (float limit : {0.25f, 10.0f, 0.0f}) {
    std::vector<float> g(size_t(rows) * I), u(g.size()), ref(g.size());
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < I; ++i) {
        g[size_t(r * I + i)] = gu[size_t(r * 2 * I + i)];
        u[size_t(r * I + i)] = gu[size_t(r * 2 * I + I + i)];
      }
    if (limit > 0)  // moe.cpp's mlp_forward
      for (size_t i = 0; i < g.size(); ++i) {
        g[i] = std::min(g[i], limit);
        u[i] = std::clamp(u[i], -limit, limit);
      }
    cpu::silu_mul(g.data(), u.data(), int64_t(g.size()), ref.data());
    Dev<float> dgu(gu), dout(ref.size());
    cuda::silu_mul_clamped(dgu.get(), rows, I, limit, dout.get(), nullptr);
    EXPECT_LT(rel_err(dout.host(), ref), 1e-6) << "limit " << limit;
  }
}

// ---------------------------------------------------------------- operand splits for tensor-core GEMMs

// split_tf32: hi has TF32's 10-bit mantissa (the low 13 bits zero), hi + lo == x exactly, hi is x rounded to nearest
// (|lo| <= half a TF32 ulp); in place and into other rows; split_bf16x2: [hi | lo] rows, hi = bf16(x), lo =
// bf16(x - hi), so hi + lo is x to ~2^-16. Strided rows (the absorption splits q's first dn values of each head).
TEST(CudaGlm5NextKernels, TensorCoreOperandSplits) {
  SKIP_WITHOUT_DEVICE();
  const int rows = 37, cols = 300, ld = 320;
  std::vector<float> x = uniform(size_t(rows) * ld, -3.0f, 3.0f, 123);
  for (size_t i = 0; i < x.size(); i += 7) x[i] *= 1e-6f;  // small magnitudes too
  x[0] = 0.0f, x[1] = -0.0f, x[2] = 1.0f;
  auto bits = [](float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
  };
  for (bool in_place : {false, true}) {
    Dev<float> dx(x), dhi(size_t(rows) * cols), dlo(size_t(rows) * cols);
    float* hi_p = in_place ? dx.get() : dhi.get();
    cuda::split_tf32(dx.get(), rows, cols, ld, hi_p, in_place ? ld : cols, dlo.get(), cols, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> hx = dx.host(), hh = dhi.host(), hl = dlo.host();
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        const float v = x[size_t(r) * ld + c];
        const float h = in_place ? hx[size_t(r) * ld + c] : hh[size_t(r) * cols + c], l = hl[size_t(r) * cols + c];
        ASSERT_EQ(bits(h) & 0x1fffu, 0u) << r << " " << c;
        ASSERT_EQ(h + l, v) << r << " " << c;
        ASSERT_LE(std::fabs(l), std::ldexp(std::fabs(v), -11)) << r << " " << c;
      }
    if (!in_place) {  // the rows past cols are left alone
      for (int r = 0; r < rows; ++r) ASSERT_EQ(hx[size_t(r) * ld + cols], x[size_t(r) * ld + cols]);
    }
  }
  Dev<float> dx(x);
  Dev<uint16_t> d2(size_t(rows) * 2 * cols);
  cuda::split_bf16x2(dx.get(), rows, cols, ld, d2.get(), nullptr);
  const std::vector<uint16_t> h2 = d2.host();
  auto bf = [](uint16_t u) {
    const uint32_t w = uint32_t(u) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  };
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const float v = x[size_t(r) * ld + c], h = bf(h2[size_t(r) * 2 * cols + c]);
      const float l = bf(h2[size_t(r) * 2 * cols + cols + c]);
      ASSERT_LE(std::fabs(v - h), std::ldexp(std::fabs(v), -8)) << r << " " << c;
      ASSERT_LE(std::fabs(v - (h + l)), std::ldexp(std::fabs(v), -16)) << r << " " << c;
    }
}

// ---------------------------------------------------------------- greedy argmax on the device

// cuda::argmax vs std::max_element (what the host's greedy pick is): random rows of the real vocabulary and odd
// lengths, ties (the lowest index wins), -inf everywhere, NaN values (skipped; a NaN first value is kept), the maximum
// at either end; the same scratch over many calls (its counter resets itself).
TEST(CudaGlm5NextKernels, ArgmaxMatchesMaxElement) {
  SKIP_WITHOUT_DEVICE();
  Dev<char> scratch(cuda::argmax_scratch_bytes());
  Dev<int32_t> out(1);
  std::vector<std::pair<std::string, std::vector<float>>> rows;
  for (int n : {1, 7, 255, 257, 4097, 154880, 151552})
    rows.push_back({"random " + std::to_string(n), uniform(size_t(n), -20, 20, uint32_t(n))});
  std::vector<float> tie = uniform(154880, -1, 1, 5);
  tie[100000] = tie[3] = tie[150000] = 7.0f;
  rows.push_back({"ties", tie});
  rows.push_back({"all -inf", std::vector<float>(1000, -INFINITY)});
  std::vector<float> nan_mid = uniform(5000, -1, 1, 6);
  nan_mid[10] = NAN, nan_mid[4000] = NAN, nan_mid[2500] = 3.0f;
  rows.push_back({"NaN inside", nan_mid});
  std::vector<float> nan_first = nan_mid;
  nan_first[0] = NAN;
  rows.push_back({"NaN first", nan_first});
  rows.push_back({"all NaN", std::vector<float>(300, NAN)});
  std::vector<float> last = uniform(154880, -1, 1, 7), first = last;
  last.back() = 2.0f, first[0] = 2.0f;
  rows.push_back({"max last", last});
  rows.push_back({"max first", first});
  for (int rep = 0; rep < 2; ++rep)
    for (const auto& [what, x] : rows) {
      Dev<float> dx(x);
      cuda::argmax(dx.get(), int(x.size()), scratch.get(), out.get(), nullptr);
      EXPECT_EQ(out.host()[0], int32_t(std::max_element(x.begin(), x.end()) - x.begin())) << what;
    }
}

// ---------------------------------------------------------------- Qwen3-Next: softmax router, gates

// cuda::route with softmax scores vs model/router.cpp's route_token: the same experts in the same order, the same
// weights (renormalised or not; group-limited as well).
TEST(CudaQwen3NextKernels, SoftmaxRouterMatchesRouteToken) {
  SKIP_WITHOUT_DEVICE();
  struct Case {
    int E, k, groups, topk_groups;
    bool norm;
  };
  for (const Case& cs :
       {Case{16, 4, 1, 1, true}, Case{512, 10, 1, 1, true}, Case{64, 6, 1, 1, false}, Case{64, 4, 8, 3, true}}) {
    const int S = 9;
    const ModelSpec c = router_config(RouterKind::Softmax, cs.E, cs.k, cs.groups, cs.topk_groups, cs.norm, 1.0);
    const std::vector<float> logits = uniform(size_t(S) * cs.E, -4.0f, 4.0f, 400 + uint32_t(cs.E));
    const std::vector<float> bias(size_t(cs.E), 0.0f);
    Dev<float> dlogits(logits), dbias(bias), dw(size_t(S) * cs.k);
    Dev<int32_t> dids(size_t(S) * cs.k);
    cuda::RouterArgs ra;
    ra.E = cs.E, ra.groups = cs.groups, ra.topk_groups = cs.topk_groups, ra.k = cs.k, ra.norm_topk = cs.norm;
    ra.softmax = true;
    cuda::route(dlogits.get(), dbias.get(), S, ra, dids.get(), dw.get(), nullptr);
    const std::vector<int32_t> ids = dids.host();
    const std::vector<float> w = dw.host();
    for (int s = 0; s < S; ++s) {
      const RoutedExperts r = route_token(logits.data() + int64_t(s) * cs.E, bias.data(), c);
      for (int j = 0; j < cs.k; ++j) {
        EXPECT_EQ(ids[size_t(s * cs.k + j)], r.ids[size_t(j)]) << "E " << cs.E << " token " << s << " pick " << j;
        EXPECT_NEAR(w[size_t(s * cs.k + j)], r.weights[size_t(j)], 1e-6f * std::max(1.0f, r.weights[size_t(j)]))
            << "E " << cs.E << " token " << s << " pick " << j;
      }
    }
  }
}

// moe.cpp's gated shared expert: out[s] *= sigmoid(x[s] . w).
TEST(CudaQwen3NextKernels, SharedExpertGate) {
  SKIP_WITHOUT_DEVICE();
  for (int D : {128, 2048}) {
    const int S = 5;
    const std::vector<float> x = uniform(size_t(S) * D, -1.0f, 1.0f, 410), w = uniform(size_t(D), -0.1f, 0.1f, 411);
    std::vector<float> y = uniform(size_t(S) * D, -2.0f, 2.0f, 412);
    Dev<float> dx(x), dw(w), dy(y);
    cuda::shared_expert_gate(dx.get(), dw.get(), S, D, dy.get(), nullptr);
    for (int s = 0; s < S; ++s) {
      const float g = sigmoid(cpu::dot(x.data() + int64_t(s) * D, w.data(), D));
      for (int d = 0; d < D; ++d) y[size_t(s * D + d)] *= g;
    }
    EXPECT_LT(rel_err(dy.host(), y), 1e-5) << "D " << D;
  }
}

// attention_gqa.cpp's output gate: attention rows times sigmoid of the gate half of q_proj's [query | gate] heads.
TEST(CudaQwen3NextKernels, SigmoidGateRows) {
  SKIP_WITHOUT_DEVICE();
  const int rows = 12, n = 64;
  const std::vector<float> qg = uniform(size_t(rows) * 2 * n, -4.0f, 4.0f, 420);
  std::vector<float> x = uniform(size_t(rows) * n, -1.0f, 1.0f, 421);
  Dev<float> dqg(qg), dx(x);
  cuda::sigmoid_gate_rows(dx.get(), dqg.get() + n, 2 * n, rows, n, nullptr);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) x[size_t(r * n + i)] *= sigmoid(qg[size_t(r * 2 * n + n + i)]);
  EXPECT_LT(rel_err(dx.host(), x), 1e-6);
}

// The key-split MLA decode kernels (CUDA cores; tensor cores per range for bf16 caches) against attention() (the
// engine's verified path) on the same cache: bf16 and int8 caches, DSA selections with -1 padding and positions past
// the token (both ignored) and plain causal attention, 64 heads and a count that is not a multiple of the kernels' 8
// and 16, GLM-5 (r 512 + rope 64) and NoPE (512) keys.
TEST(CudaMlaKernels, SplitDecodeMatchesAttention) {
  SKIP_WITHOUT_DEVICE();
  const int T = 700, R = 512, pos0 = 600;
  std::mt19937 rng(5);
  for (int D : {576, 512})
    for (int H : {64, 12})
      for (bool q8 : {false, true})
        for (int S : {1, 3})
          for (int sel_k : {0, 260}) {
            const auto kvf = uniform(size_t(T) * D, -1.0f, 1.0f, uint32_t(D + H + S));
            std::vector<uint16_t> kv16(kvf.size());
            std::vector<int8_t> kv8(kvf.size());
            std::vector<float> scale(static_cast<size_t>(T));
            for (size_t i = 0; i < kvf.size(); ++i) {
              kv16[i] = f32_to_bf16(kvf[i]);
              kv8[i] = int8_t(std::lround(kvf[i] * 127.0f));
            }
            for (int t = 0; t < T; ++t) scale[size_t(t)] = 0.01f + 0.0001f * float(t % 7);
            Dev<uint16_t> d16(kv16);
            Dev<int8_t> d8(kv8);
            Dev<float> dscale(scale);
            cuda::DeviceLayerCache lc;
            lc.kv = q8 ? static_cast<void*>(d8.get()) : static_cast<void*>(d16.get());
            lc.kv_scale = q8 ? dscale.get() : nullptr;
            Dev<cuda::DeviceLayerCache> dlc(std::vector<cuda::DeviceLayerCache>{lc});
            Dev<int32_t> dpos(std::vector<int32_t>{pos0});
            std::vector<int32_t> sel(size_t(S) * size_t(sel_k));
            for (int s = 0; s < S; ++s)
              for (int i = 0; i < sel_k; ++i) {
                const int r = int(rng() % 20);
                sel[size_t(s * sel_k + i)] = r == 0   ? -1
                                             : r == 1 ? pos0 + s + 1 + int(rng() % 50)
                                                      : int(rng() % (pos0 + s + 1));
              }
            Dev<int32_t> dsel(sel);
            Dev<float> dq(uniform(size_t(S) * H * D, -0.2f, 0.2f, uint32_t(7 * D + H)));
            Dev<float> ref(size_t(S) * H * R), out(size_t(S) * H * R), part(cuda::mla_split_floats(S, H, R));
            cuda::AttentionArgs a;
            a.q = dq.get();
            a.S = S, a.H = H, a.q_dim = D, a.v_dim = R, a.mla = true, a.q8 = q8;
            a.lc = dlc.get();
            a.selection = sel_k ? dsel.get() : nullptr;
            a.sel_k = sel_k;
            a.pos0 = dpos.get();
            a.scale = 0.05f;
            a.out = ref.get();
            ASSERT_TRUE(cuda::mla_split_supported(a));
            cuda::attention(a, nullptr);
            a.out = out.get();
            // CUDA cores: fp32 throughout (1e-5); tensor cores (bf16 caches): the prefill kernel's fp16
            // probabilities, its bar (5e-4 of the largest output)
            for (auto path : {cuda::MlaSplitPath::CudaCores, cuda::MlaSplitPath::TensorCores}) {
              const bool tc = path == cuda::MlaSplitPath::TensorCores;
              if (tc && !cuda::mla_prefill_supported(a)) continue;
              cuda::mla_split_attention(a, part.get(), nullptr, path);
              const auto r = ref.host(), o = out.host();
              double worst = 0, norm = 0;
              for (size_t i = 0; i < r.size(); ++i) {
                worst = std::max(worst, double(std::fabs(r[i] - o[i])));
                norm = std::max(norm, double(std::fabs(r[i])));
              }
              EXPECT_LT(worst, tc ? 5e-4 * norm : 1e-5 * std::max(1.0, norm))
                  << "D " << D << " H " << H << " q8 " << q8 << " S " << S << " sel_k " << sel_k << " tc " << tc;
            }
          }
}

// The tensor-core MLA kernel (prefill, and decode's key ranges) must launch on the home GPUs: an RTX 3090 / 4090
// gives a block at most 99 KB of shared memory (GLM-5.3-Flash: latent 512; DeepSeek-V3: 512 + 64 rope). Host only.
TEST(CudaMlaKernels, TensorCoreBlockFitsA24GBCard) {
  for (int q_dim : {512, 576}) EXPECT_LE(cuda::mla_prefill_block_smem(q_dim), size_t(99) * 1024) << q_dim;
}

// The tensor-core MLA prefill kernel against attention() on the same bf16 cache: DSA selections with -1 padding, a
// whole tile of padding and positions past the token (all ignored) and plain causal attention, 64 heads and a count
// that is not a multiple of the kernel's 16, GLM-5 (r 512 + rope 64), NoPE (512) and hf-tiny (32 + 8) keys. The
// probabilities enter an fp16 MMA (2^-11 = 4.9e-4 relative each; measured <= 2.2e-4 of the largest output): the bar
// is 5e-4 of the largest output.
TEST(CudaMlaKernels, TensorCorePrefillMatchesAttention) {
  SKIP_WITHOUT_DEVICE();
  const int T = 1400, S = 37, pos0 = 1300;
  std::mt19937 rng(11);
  for (auto [D, R] : {std::pair{576, 512}, std::pair{512, 512}, std::pair{40, 32}})
    for (int H : {64, 12})
      for (int sel_k : {0, 300}) {
        const auto kvf = uniform(size_t(T) * D, -1.0f, 1.0f, uint32_t(D + H));
        std::vector<uint16_t> kv16(kvf.size());
        for (size_t i = 0; i < kvf.size(); ++i) kv16[i] = f32_to_bf16(kvf[i]);
        Dev<uint16_t> d16(kv16);
        cuda::DeviceLayerCache lc;
        lc.kv = d16.get();
        Dev<cuda::DeviceLayerCache> dlc(std::vector<cuda::DeviceLayerCache>{lc});
        Dev<int32_t> dpos(std::vector<int32_t>{pos0});
        std::vector<int32_t> sel(size_t(S) * size_t(sel_k));
        for (int s = 0; s < S; ++s)
          for (int i = 0; i < sel_k; ++i) {
            const int r = int(rng() % 20);
            int v = r == 1 ? pos0 + s + 1 + int(rng() % 50) : int(rng() % (pos0 + s + 1));  // r == 1: a future key
            if (r == 0 || (s == 3 && i >= 64 && i < 128)) v = -1;  // padding; token 3: a whole tile of it
            sel[size_t(s * sel_k + i)] = v;
          }
        Dev<int32_t> dsel(sel);
        Dev<float> dq(uniform(size_t(S) * H * D, -0.2f, 0.2f, uint32_t(3 * D + H)));
        Dev<float> ref(size_t(S) * H * R), out(size_t(S) * H * R);
        cuda::AttentionArgs a;
        a.q = dq.get();
        a.S = S, a.H = H, a.q_dim = D, a.v_dim = R, a.mla = true;
        a.lc = dlc.get();
        a.selection = sel_k ? dsel.get() : nullptr;
        a.sel_k = sel_k;
        a.pos0 = dpos.get();
        a.scale = 0.5f;
        a.out = ref.get();
        ASSERT_TRUE(cuda::mla_prefill_supported(a));
        cuda::attention(a, nullptr);
        a.out = out.get();
        // every form: 16, 32 and 64 heads per staged tile, the warpgroup-MMA form (5) with q as fp16 value +
        // remainder, (6) with q one fp16 value, and both of its V2 (7, 8) (each where the shape and the device allow)
        for (int groups : {1, 2, 4, 5, 6, 7, 8}) {
          if (groups == 4 && !(H > 32 && cuda::mla_prefill_wide_supported(a))) continue;
          if (groups >= 5 && !(H > 32 && cuda::mla_prefill_wgmma_supported(a))) continue;
          if (groups == 2 && H <= 16) continue;
          out.put(std::vector<float>(size_t(S) * H * R, std::nanf("")));  // (an unwritten output fails)
          if (groups >= 5) cuda::mla_prefill_wgmma(a, nullptr, groups % 2, groups >= 7);
          else cuda::mla_prefill_attention(a, nullptr, groups);
          const auto r = ref.host(), o = out.host();
          double worst = 0, norm = 0;
          for (size_t i = 0; i < r.size(); ++i) {
            worst = std::max(worst, std::isnan(o[i]) ? INFINITY : double(std::fabs(r[i] - o[i])));
            norm = std::max(norm, double(std::fabs(r[i])));
          }
          std::printf("[ info ] MLA prefill D %d H %d sel_k %d, %d head groups: worst %.2e of max %.2e\n", D, H, sel_k,
                      groups, worst, norm);
          // (forms 6 and 8 round q to fp16 as every form rounds the probabilities: 2.4-2.6e-4 of the norm on an
          // H200 for form 6, forms 1-5 1.6-1.7e-4)
          EXPECT_LT(worst, 5e-4 * norm) << "D " << D << " H " << H << " sel_k " << sel_k << " groups " << groups;
        }
      }
}

#else

TEST(CudaGlm5NextKernels, SkippedWithoutCuda) { GTEST_SKIP() << "no CUDA backend"; }

#endif

}  // namespace
}  // namespace moesrv
