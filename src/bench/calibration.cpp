#include "bench/calibration.h"

#include <cstring>

#include "bench/bench.h"
#include "bench/common.h"
#include "runtime/cpu_expert_pool.h"
#include "util/thread_pool.h"

namespace moesrv {

namespace {
constexpr int64_t kCopyChunk = 1 << 20;  // every core copies a share, as the GEMV kernels read
}

void parallel_host_copy(char* dst, const char* src, size_t bytes) {
  ThreadPool::global().parallel_for(int64_t(bytes) / kCopyChunk, [&](int64_t c0, int64_t c1) {
    std::memcpy(dst + c0 * kCopyChunk, src + c0 * kCopyChunk, size_t((c1 - c0) * kCopyChunk));
  });
}

double measure_memcpy_gbps(size_t bytes, int reps) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  const size_t copied = bytes / kCopyChunk * kCopyChunk;
  double t = bench::best_of(reps, [&] { parallel_host_copy(b.data(), a.data(), copied); });
  return double(copied) / t / 1e9;
}

namespace bench {

Calibration calibrate(const ModelWeights& w, const ModelFootprint& fp) {
  Calibration cal;
  cal.memcpy_gbps = measure_memcpy_gbps();
  const ModelSpec& c = w.config;
  const int64_t D = c.hidden_size;
  std::vector<float> x(size_t(64 * D), 0.01f), out(size_t(64 * D), 0.0f), logits(size_t(c.vocab_size));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i * 7919 % 201) - 100) * 1e-3f;
  cal.head_s = best_of(3, [&] { w.lm_head->forward(x.data(), 1, logits.data()); });
  for (size_t l = 0; l < w.layers.size(); ++l) {
    if (!w.layers[l].moe) continue;
    const MoeWeights& moe = *w.layers[l].moe;
    const int64_t n_gemv = std::min<int64_t>(8, int64_t(moe.experts.size()));
    std::vector<CpuExpertJob> jobs;
    for (int64_t e = 0; e < n_gemv; ++e) jobs.push_back({&moe.experts[size_t(e)], {0}, {1.0f}});
    CpuExpertPool::run(jobs, x.data(), D, out.data());  // warm-up
    cal.expert_1tok_s = best_of(3, [&] { CpuExpertPool::run(jobs, x.data(), D, out.data()); }) / double(n_gemv);
    cal.expert_gemv_gbps = double(fp.expert_bytes[l]) / cal.expert_1tok_s / 1e9;
    cal.gemm_tokens = 64;
    CpuExpertJob big{&moe.experts[0], {}, {}};
    for (int32_t t = 0; t < 64; ++t) big.tokens.push_back(t), big.weights.push_back(1.0f);
    cal.expert_gemm_s = best_of(2, [&] { CpuExpertPool::run({big}, x.data(), D, out.data()); });
    cal.cpu_gflops = 2 * fp.expert_params[l] * 64 / cal.expert_gemm_s / 1e9;
    break;
  }
  return cal;
}

}  // namespace bench
}  // namespace moesrv
