// exl3_expert_bench [--pool-mb N] [--threads a,b,...] [--thp] : one token through 1, 4 and 8 EXL3 experts at once
// (GLM-5.3-Flash shapes: gate/up 4096 -> 2048, down 2048 -> 4096, Mul1, K = 3 and 4), per thread count:
//   floor    a multi-threaded sum over a buffer of N MB (default 2048): the memory-read rate
//   old      mlp_forward per expert with the previous AVX-512 GEMV (path avx512) when the CPU has it
//   new/exp  mlp_forward per expert with the best GEMV path
//   batched  cpu::experts_forward: all experts' strips in shared parallel_fors, best path (vbmi batched: the same
//            with avx512-vbmi where the best path is avx512-fp16)
//   int8     the same with the opt-in integer-sum path (avx512-int8, MOESRV_EXL3_GEMV=avx512-int8) where the CPU has it
//   slice    one expert's first b of 16 intermediate blocks (cpu::ExpertRows slices), best path, ms
// GB/s counts the stored trellis bytes of the experts. Each step reads the next experts of a pool of N MB, so
// weights come from memory, not cache. Each thread count runs in a child process (MOESRV_THREADS sizes the pool).
// --thp: each trellis in 2 MiB-aligned memory advised for transparent huge pages (a strip's tiles lie a page apart:
// with 4 KiB pages every tile is a TLB miss).
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/exl3_gemv.h"
#include "backend/cpu/exl3_linear.h"
#include "backend/cpu/expert_batch.h"
#include "util/thread_pool.h"

using namespace moesrv;

namespace {

constexpr int64_t kHidden = 4096, kInter = 2048;

struct Pool {
  std::vector<MlpWeights> experts;
  size_t trellis_bytes = 0;  // of one expert
};

uint64_t next(uint64_t& s) {  // xorshift64
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

bool g_thp = false;  // --thp

std::unique_ptr<Linear> random_linear(int K, int64_t in, int64_t out, uint64_t& seed) {
  Exl3Weights w;
  w.K = K;
  w.codebook = Exl3Codebook::Mul1;
  w.in_pad = in;
  w.out_pad = out;
  const size_t words = size_t(in / 16 * out / 16 * 16 * K / 4);
  if (g_thp) {
    constexpr size_t kHuge = size_t(2) << 20;
    const size_t bytes = (words * 8 + kHuge - 1) / kHuge * kHuge;
    auto* p = static_cast<uint64_t*>(std::aligned_alloc(kHuge, bytes));
    if (!p) std::abort();
    madvise(p, bytes, MADV_HUGEPAGE);
    for (size_t i = 0; i < words; ++i) p[i] = next(seed);
    w.trellis = reinterpret_cast<const uint16_t*>(p);
    w.owner = std::shared_ptr<const void>(p, [](const void* q) { std::free(const_cast<void*>(q)); });
  } else {
    auto tr = std::make_shared<std::vector<uint64_t>>(words);
    for (auto& v : *tr) v = next(seed);
    w.trellis = reinterpret_cast<const uint16_t*>(tr->data());
    w.owner = tr;
  }
  w.suh.assign(size_t(in), 1.0f);
  w.svh.assign(size_t(out), 1.0f);
  return std::make_unique<Exl3Linear>(std::move(w), std::vector<float>{}, in, out);
}

Pool make_pool(int K, size_t pool_bytes) {
  Pool p;
  uint64_t seed = 0x9E3779B97F4A7C15ull + uint64_t(K);
  p.trellis_bytes = size_t(3 * kHidden * kInter / 2 * K / 8) * 2;
  const size_t count = std::max<size_t>(16, pool_bytes / p.trellis_bytes + 1);
  for (size_t i = 0; i < count; ++i) {
    MlpWeights m;
    m.gate = random_linear(K, kHidden, kInter, seed);
    m.up = random_linear(K, kHidden, kInter, seed);
    m.down = random_linear(K, kInter, kHidden, seed);
    m.limit = 7.0f;
    p.experts.push_back(std::move(m));
  }
  return p;
}

// Best-of-reps milliseconds of fn(step); each step should touch data not touched by the previous ones.
template <typename Fn>
double best_ms(int reps, Fn&& fn) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn(i);
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

double floor_gbs(size_t bytes) {
  std::vector<uint64_t> buf(bytes / 8);
  ThreadPool::global().parallel_for(int64_t(buf.size()), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) buf[size_t(i)] = uint64_t(i) * 0x9E3779B97F4A7C15ull;
  });
  std::vector<uint64_t> sums(size_t(ThreadPool::global().size()) * 64);
  const int64_t chunks = int64_t(buf.size() / 8192);
  const double ms = best_ms(3, [&](int) {
    ThreadPool::global().parallel_for(chunks, [&](int64_t b, int64_t e) {
      uint64_t s = 0;
      for (int64_t i = b * 8192; i < e * 8192; ++i) s += buf[size_t(i)];
      sums[size_t(b % 64)] += s;
    });
  });
  return double(buf.size() * 8) / ms / 1e6;
}

void child(size_t pool_bytes) {
  const int threads = ThreadPool::global().size();
  const double floor = floor_gbs(pool_bytes);
  const Exl3GemvPath best = exl3_gemv_best_path();
  const bool have_old = exl3_gemv_path_supported(Exl3GemvPath::Avx512);
  std::printf("threads %2d  floor %6.1f GB/s  best path %s%s\n", threads, floor, exl3_gemv_path_name(best),
              have_old ? "" : "  (no AVX-512: old = best path per expert)");
  std::vector<float> x(size_t(kHidden), 0.01f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 201) - 100) * 1e-3f;
  for (int K : {3, 4}) {
    const Pool pool = make_pool(K, pool_bytes);
    const int64_t count = int64_t(pool.experts.size());
    for (int64_t E : {1, 4, 8}) {
      std::vector<std::vector<float>> ys(size_t(E), std::vector<float>(size_t(kHidden), 0.0f));
      int64_t cursor = 0;
      auto pick = [&](int64_t i) { return &pool.experts[size_t((cursor + i) % count)]; };
      auto per_expert = [&](int) {
        for (int64_t i = 0; i < E; ++i) cpu::mlp_forward(*pick(i), x.data(), 1, ys[size_t(i)].data());
        cursor += E;
      };
      auto batched = [&](int) {
        std::vector<cpu::ExpertRows> jobs;
        for (int64_t i = 0; i < E; ++i) jobs.push_back({pick(i), x.data(), 1, ys[size_t(i)].data()});
        cpu::experts_forward(jobs);
        cursor += E;
      };
      const int reps = int(std::clamp<int64_t>(count / E, 3, 12));
      exl3_gemv_set_default_path(have_old ? Exl3GemvPath::Avx512 : best);
      const double old_ms = best_ms(reps, per_expert);
      exl3_gemv_set_default_path(best);
      const double new_ms = best_ms(reps, per_expert), batch_ms = best_ms(reps, batched);
      double int8_ms = 0, vbmi_ms = 0;
      if (best == Exl3GemvPath::Avx512Fp16) {  // the exact path before it
        exl3_gemv_set_default_path(Exl3GemvPath::Avx512Vbmi);
        vbmi_ms = best_ms(reps, batched);
        exl3_gemv_set_default_path(best);
      }
      if (exl3_gemv_path_supported(Exl3GemvPath::Avx512Int8)) {
        exl3_gemv_set_default_path(Exl3GemvPath::Avx512Int8);
        int8_ms = best_ms(reps, batched);
        exl3_gemv_set_default_path(best);
      }
      const double bytes = double(pool.trellis_bytes) * double(E);
      auto gbs = [&](double ms) { return bytes / ms / 1e6; };
      std::printf(
          "threads %2d  K=%d experts=%lld  old %7.3f ms %5.1f GB/s  new/exp %7.3f ms %5.1f GB/s  batched %7.3f ms "
          "%5.1f GB/s = %.2f of floor",
          threads, K, (long long)E, old_ms, gbs(old_ms), new_ms, gbs(new_ms), batch_ms, gbs(batch_ms),
          gbs(batch_ms) / floor);
      if (vbmi_ms > 0) std::printf("  vbmi batched %7.3f ms %5.1f GB/s", vbmi_ms, gbs(vbmi_ms));
      if (int8_ms > 0)
        std::printf("  int8 %7.3f ms %5.1f GB/s = %.2f of floor", int8_ms, gbs(int8_ms), gbs(int8_ms) / floor);
      std::printf("\n");
      std::fflush(stdout);
    }
    // One token through the first b of an expert's 16 intermediate blocks (cpu::ExpertRows slices: what the CUDA
    // engine's CPU computes of a copied expert, cpu_expert_slices): the fixed cost and the cost per block.
    std::printf("threads %2d  K=%d slice of b/16 blocks, ms:", threads, K);
    std::vector<float> y(static_cast<size_t>(kHidden));
    int64_t cursor = 0;
    for (int64_t b : {1, 2, 4, 8, 16}) {
      const double ms = best_ms(int(std::clamp<int64_t>(count, 3, 12)), [&](int) {
        cpu::experts_forward({{&pool.experts[size_t(cursor++ % count)], x.data(), 1, y.data(), 0, b * 128}});
      });
      std::printf("  %lld: %.3f", (long long)b, ms);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  size_t pool_mb = 2048;
  std::vector<int> threads;
  bool is_child = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--pool-mb" && i + 1 < argc) pool_mb = size_t(std::stoll(argv[++i]));
    else if (a == "--thp") g_thp = true;
    else if (a == "--child") is_child = true;
    else if (a == "--threads" && i + 1 < argc)
      for (std::string s = argv[++i]; !s.empty();) {
        const size_t c = s.find(',');
        threads.push_back(std::stoi(s.substr(0, c)));
        s = c == std::string::npos ? "" : s.substr(c + 1);
      }
    else {
      std::fprintf(stderr, "usage: %s [--pool-mb N] [--threads a,b,...] [--thp]\n", argv[0]);
      return 2;
    }
  }
  if (is_child) {
    child(pool_mb << 20);
    return 0;
  }
  const int hw = int(std::max(1u, std::thread::hardware_concurrency()));
  if (threads.empty()) {
    for (int t : {1, 2, 4, 8, 16})
      if (t < hw) threads.push_back(t);
    threads.push_back(hw);
  }
  for (int t : threads) {
    const std::string cmd = "MOESRV_THREADS=" + std::to_string(t) + " '" + argv[0] + "' --child --pool-mb " +
                            std::to_string(pool_mb) + (g_thp ? " --thp" : "");
    if (std::system(cmd.c_str()) != 0) return 1;
  }
  return 0;
}
