// bench_delta_rule [--heads 64] [--tokens 4096] [--dk 128] [--dv 128] [--gdn] [--reps 3]
// Times the gated delta rule on CPU: chunked prefill vs the recurrence over the same tokens (one token per call,
// as decode runs it, and one multi-token call), and the per-token decode time with the state after 512 and after
// all tokens. Default shape: GLM-5.3-Flash KDA layer (64 heads, dk = dv = 128). Last line: JSON.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "backend/cpu/delta_rule.h"
#include "util/thread_pool.h"

using namespace moesrv;
using namespace moesrv::cpu;

namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
double cpu_s() {  // all threads of the process: on a shared machine, the work done rather than the time waited
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}
struct Time {
  double wall = 1e30, cpu = 1e30;
};

struct Rng {  // xorshift: filling ~10^8 floats with std::normal_distribution would dominate the run
  uint64_t s = 0x9E3779B97F4A7C15ull;
  float uniform() {  // [-1, 1)
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    return float(s >> 40) * (2.f / 16777216.f) - 1.f;
  }
};

}  // namespace

int main(int argc, char** argv) {
  int64_t H = 64, T = 4096, dk = 128, dv = 128, reps = 3;
  bool gdn = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::stoll(argv[++i]) : 0LL; };
    if (a == "--heads") H = next();
    else if (a == "--tokens") T = next();
    else if (a == "--dk") dk = next();
    else if (a == "--dv") dv = next();
    else if (a == "--reps") reps = std::max(1LL, next());
    else if (a == "--gdn") gdn = true;
    else {
      std::fprintf(stderr, "usage: %s [--heads N] [--tokens T] [--dk N] [--dv N] [--gdn] [--reps N]\n", argv[0]);
      return 2;
    }
  }
  const DeltaRuleShape s{H, dk, dv, !gdn};
  const int64_t gw = gdn ? 1 : dk;
  Rng rng;
  std::vector<float> q(size_t(T * H * dk)), k(q.size()), v(size_t(T * H * dv)), g(size_t(T * H * gw)),
      beta(size_t(T * H)), out(v.size());
  for (auto* x : {&q, &k, &v}) std::generate(x->begin(), x->end(), [&] { return rng.uniform(); });
  l2_normalize_rows(q.data(), T * H, dk);
  l2_normalize_rows(k.data(), T * H, dk);
  for (float& f : q) f /= std::sqrt(float(dk));
  for (float& f : beta) f = 1.f / (1.f + std::exp(-2.f * rng.uniform()));
  for (float& f : g) f = gdn ? -0.5f * (1.f + rng.uniform()) : -5.f / (1.f + std::exp(-3.f * rng.uniform()));
  std::vector<float> state(size_t(H * dk * dv));
  const int threads = ThreadPool::global().size();
  std::printf("delta rule %s: heads %lld, dk %lld, dv %lld, tokens %lld, %d threads\n", gdn ? "GDN" : "KDA",
              (long long)H, (long long)dk, (long long)dv, (long long)T, threads);

  // Runs tokens [t0, t0 + n) in calls of `step` tokens (0: one call), through the chunked or recurrent kernel.
  auto run = [&](bool chunked, int64_t t0, int64_t n, int64_t step) {
    auto* fn = chunked ? delta_rule_chunked : delta_rule_recurrent;
    if (step <= 0) step = n;
    for (int64_t t = t0; t < t0 + n; t += step) {
      const int64_t m = std::min(step, t0 + n - t);
      fn(s, m, &q[size_t(t * H * dk)], &k[size_t(t * H * dk)], &v[size_t(t * H * dv)], &g[size_t(t * H * gw)],
         &beta[size_t(t * H)], state.data(), &out[size_t(t * H * dv)]);
    }
  };
  auto best_of = [&](int64_t n_reps, auto&& body) {  // body runs from a zero state; best wall and best CPU time
    Time best;
    for (int64_t r = 0; r < n_reps; ++r) {
      std::fill(state.begin(), state.end(), 0.f);
      const double t = now_s(), c = cpu_s();
      body();
      best.wall = std::min(best.wall, now_s() - t), best.cpu = std::min(best.cpu, cpu_s() - c);
    }
    return best;
  };
  const Time chunk = best_of(reps, [&] { run(true, 0, T, 0); });
  const Time rec1 = best_of(1, [&] { run(false, 0, T, 1); });
  const Time recT = best_of(reps, [&] { run(false, 0, T, 0); });
  std::printf("%-22s %10s %10s %10s %12s\n", "", "wall ms", "tok/s", "cpu ms", "chunked x");
  auto row = [&](const char* name, Time t) {
    std::printf("%-22s %10.1f %10.0f %10.1f %5.2f (cpu %.2f)\n", name, t.wall * 1e3, T / t.wall, t.cpu * 1e3,
                t.wall / chunk.wall, t.cpu / chunk.cpu);
  };
  row("chunked prefill", chunk);
  row("recurrent, 1 tok/call", rec1);
  row("recurrent, 1 call", recT);

  // Decode: per-token time with the state after `ctx` tokens (the state's size does not depend on ctx).
  const int64_t n_dec = std::min<int64_t>(64, T);
  auto decode_us = [&](int64_t ctx) {
    std::fill(state.begin(), state.end(), 0.f);
    run(true, 0, ctx, 0);
    Time best;
    for (int64_t r = 0; r < reps; ++r) {
      const double t = now_s(), c = cpu_s();
      run(false, 0, n_dec, 1);  // any token inputs will do
      best.wall = std::min(best.wall, (now_s() - t) / n_dec), best.cpu = std::min(best.cpu, (cpu_s() - c) / n_dec);
    }
    return Time{best.wall * 1e6, best.cpu * 1e6};
  };
  const int64_t ctx_a = std::min<int64_t>(512, T);
  const Time dec_a = decode_us(ctx_a), dec_b = decode_us(T);
  std::printf("decode, 1 token, all heads: %.1f us (cpu %.1f) after %lld tokens; %.1f us (cpu %.1f) after %lld\n",
              dec_a.wall, dec_a.cpu, (long long)ctx_a, dec_b.wall, dec_b.cpu, (long long)T);
  std::printf(
      "{\"bench\":\"delta_rule\",\"mode\":\"%s\",\"heads\":%lld,\"dk\":%lld,\"dv\":%lld,\"tokens\":%lld,"
      "\"threads\":%d,\"chunked_ms\":%.2f,\"chunked_cpu_ms\":%.2f,\"chunked_tok_s\":%.0f,"
      "\"recurrent_1tok_ms\":%.2f,\"recurrent_1tok_cpu_ms\":%.2f,\"recurrent_1call_ms\":%.2f,"
      "\"recurrent_1call_cpu_ms\":%.2f,\"speedup_vs_1tok\":%.2f,\"speedup_vs_1tok_cpu\":%.2f,"
      "\"speedup_vs_1call\":%.2f,\"speedup_vs_1call_cpu\":%.2f,\"decode_ctx_a\":%lld,\"decode_us_a\":%.1f,"
      "\"decode_cpu_us_a\":%.1f,\"decode_ctx_b\":%lld,\"decode_us_b\":%.1f,\"decode_cpu_us_b\":%.1f}\n",
      gdn ? "gdn" : "kda", (long long)H, (long long)dk, (long long)dv, (long long)T, threads, chunk.wall * 1e3,
      chunk.cpu * 1e3, T / chunk.wall, rec1.wall * 1e3, rec1.cpu * 1e3, recT.wall * 1e3, recT.cpu * 1e3,
      rec1.wall / chunk.wall, rec1.cpu / chunk.cpu, recT.wall / chunk.wall, recT.cpu / chunk.cpu, (long long)ctx_a,
      dec_a.wall, dec_a.cpu, (long long)T, dec_b.wall, dec_b.cpu);
  return 0;
}
