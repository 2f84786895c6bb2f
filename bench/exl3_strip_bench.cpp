// exl3_strip_bench [--mem-mb N] [--codebook mul1|mcg|3inst] : one thread, one activation row, every strip of an EXL3
// matrix (default Mul1) through each GEMV path this CPU runs for it (exl3_gemv_strip only: no rotations, no thread
// pool), paths interleaved, median of 31 calls. Shapes of a GLM-5.3-Flash expert (4096 -> 2048 gate/up, 2048 -> 4096
// down), K = 3 and 4, twice: "cache" repeats one matrix (it stays in L2/L3), "memory" cycles through matrices of N MB
// in all (default 512), so the weights come from DRAM. Gw/s = weights per second, GB/s = stored trellis bytes per
// second.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/exl3_gemv.h"

using namespace moesrv;

namespace {

struct Matrices {
  std::vector<std::vector<uint16_t>> trellis;
  std::vector<Exl3Weights> w;
};

Matrices make(int K, Exl3Codebook cb, int64_t in, int64_t out, size_t count) {
  Matrices m;
  std::mt19937 rng(uint32_t(K * 1000 + in));
  for (size_t i = 0; i < count; ++i) {
    m.trellis.emplace_back(size_t(in / 16 * out / 16 * 16 * K));
    for (auto& v : m.trellis.back()) v = uint16_t(rng());
    Exl3Weights w;
    w.K = K;
    w.codebook = cb;
    w.in_pad = in;
    w.out_pad = out;
    w.trellis = m.trellis.back().data();
    m.w.push_back(w);
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  size_t mem_mb = 512;
  Exl3Codebook cb = Exl3Codebook::Mul1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mem-mb" && i + 1 < argc) {
      mem_mb = size_t(std::stoll(argv[++i]));
    } else if (a == "--codebook" && i + 1 < argc) {
      const std::string v = argv[++i];
      cb = v == "mcg" ? Exl3Codebook::Mcg : v == "3inst" ? Exl3Codebook::Inst3 : Exl3Codebook::Mul1;
      if (v != "mcg" && v != "3inst" && v != "mul1") {
        std::fprintf(stderr, "--codebook: mul1, mcg or 3inst\n");
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--mem-mb N] [--codebook mul1|mcg|3inst]\n", argv[0]);
      return 2;
    }
  }
  Exl3Weights probe;  // the paths that run this codebook themselves (avx512-int8 only Mul1)
  probe.codebook = cb;
  probe.in_pad = 2048;
  std::vector<Exl3GemvPath> paths;
  for (auto p : kExl3GemvPaths)
    if (p != Exl3GemvPath::Scalar && exl3_gemv_path_supported(p) && exl3_gemv_path_for(p, probe) == p)
      paths.push_back(p);
  std::printf("paths:");
  for (auto p : paths) std::printf(" %s", exl3_gemv_path_name(p));
  std::printf("\n");
  const int64_t shapes[2][2] = {{4096, 2048}, {2048, 4096}};
  for (int K : {3, 4})
    for (const auto& shape : shapes)
      for (bool memory : {false, true}) {
        const int64_t in = shape[0], out = shape[1];
        const size_t bytes = size_t(in * out * K / 8);
        const Matrices m = make(K, cb, in, out, memory ? std::max<size_t>(2, (mem_mb << 20) / bytes) : 1);
        std::mt19937 rng(7);
        std::normal_distribution<float> nd;
        std::vector<float> x(static_cast<size_t>(in)), y(static_cast<size_t>(out));
        for (auto& v : x) v = nd(rng);
        std::vector<std::vector<float>> xs;
        for (auto p : paths) {
          xs.emplace_back(size_t(exl3_activation_floats(p, in)));
          exl3_prepare_activations(p, x.data(), 1, in, xs.back().data());
        }
        std::vector<std::vector<double>> ms(paths.size());
        size_t cursor = 0;
        for (int rep = 0; rep < 31; ++rep)
          for (size_t p = 0; p < paths.size(); ++p) {
            const Exl3Weights& w = m.w[cursor++ % m.w.size()];
            const auto t0 = std::chrono::steady_clock::now();
            for (int64_t nt = 0; nt < w.tiles_n(); ++nt)
              exl3_gemv_strip(paths[p], w, xs[p].data(), 1, nt, y.data(), out);
            ms[p].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
          }
        for (size_t p = 0; p < paths.size(); ++p) {
          std::sort(ms[p].begin(), ms[p].end());
          const double med = ms[p][ms[p].size() / 2];
          std::printf("K=%d %5lld -> %5lld %-6s %-12s %7.3f ms  %6.2f Gw/s  %6.2f GB/s\n", K, (long long)in,
                      (long long)out, memory ? "memory" : "cache", exl3_gemv_path_name(paths[p]), med,
                      double(in * out) / med / 1e6, double(bytes) / med / 1e6);
        }
        std::fflush(stdout);
      }
}
