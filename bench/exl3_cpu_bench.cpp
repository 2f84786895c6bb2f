// exl3_cpu_bench [in out] : times Exl3Linear::forward (decode on the fly) vs the bf16 dense GEMM, n = 1 and 8.
#include <chrono>
#include <cstdio>
#include <random>
#include <string>

#include "backend/cpu/exl3_linear.h"
#include "util/numeric.h"
#include "util/thread_pool.h"

using namespace moesrv;

template <typename Fn>
double time_ms(Fn&& fn, int reps) {
  fn();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
}

int main(int argc, char** argv) {
  int64_t in = argc > 2 ? std::stoll(argv[1]) : 2048, out = argc > 2 ? std::stoll(argv[2]) : 6144;
  std::mt19937 rng(1);
  std::vector<uint16_t> wbf(size_t(in * out));
  for (auto& v : wbf) v = f32_to_bf16(float(int(rng() % 2001) - 1000) * 1e-5f);
  std::vector<float> x(size_t(8 * in));
  for (auto& v : x) v = float(int(rng() % 2001) - 1000) * 1e-3f;
  std::vector<float> y(size_t(8 * out));
  std::printf("shape in %lld -> out %lld, %d threads\n", (long long)in, (long long)out, ThreadPool::global().size());
  for (int n : {1, 8}) {
    double ms = time_ms([&] { gemm_bf16(x.data(), n, wbf.data(), out, in, y.data()); }, 5);
    std::printf("bf16 dense   n=%d: %8.2f ms  %6.2f GB/s\n", n, ms, in * out * 2 / ms / 1e6);
  }
  for (int K : {2, 4, 6}) {
    std::vector<uint16_t> tr(size_t(in / 16 * out / 16 * 16 * K));
    for (auto& v : tr) v = uint16_t(rng());
    Exl3Weights w;
    w.K = K;
    w.codebook = Exl3Codebook::Mul1;
    w.in_pad = in;
    w.out_pad = out;
    w.trellis = tr.data();
    w.suh.assign(size_t(in), 1.0f);
    w.svh.assign(size_t(out), 1.0f);
    Exl3Linear lin(w, {}, in, out);
    for (int n : {1, 8}) {
      double ms = time_ms([&] { lin.forward(x.data(), n, y.data()); }, 5);
      std::printf("exl3 K=%d mul1 n=%d: %8.2f ms  %6.2f GB/s of trellis, %6.1f Mweights/s\n", K, n, ms,
                  double(w.trellis_bytes()) / ms / 1e6, double(in * out) / ms / 1e3);
    }
  }
  return 0;
}
