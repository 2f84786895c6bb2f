// EXL3 at synthetic shapes: the planner's package footprint (CPU), and GLM-5-width bf16 vs EXL3 throughput on
// the CUDA engine (opt-in benchmark; skipped without CUDA or a device).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <thread>
#include <tuple>
#include <vector>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/linear.h"
#include "backend/cuda/cuda_engine.h"
#include "backend/usage_stats.h"
#include "bench/bench.h"
#include "bench/speculative_projection.h"
#include "engine_test_util.h"
#include "format/exl3_convert.h"
#include "model/synthetic_model.h"
#include "reference_util.h"
#include "runtime/cuda_placement.h"
#include "runtime/engine_factory.h"
#include "runtime/placement.h"
#include "util/timing.h"

namespace moesrv {
namespace {

// A synthetic model with every 128-aligned projection the converter would take replaced by random K-bit MUL1
// trellis (any bit pattern is a valid stream; suh = ±1, svh = ±0.02 give the bf16 model's weight scale); the routed
// experts' at expert_K bits (0: K). Tensors of one shape and K share one random trellis.
std::shared_ptr<ModelPackage> synthetic_exl3(std::shared_ptr<ModelPackage> bf, int K, int expert_K = 0) {
  struct Store {
    std::shared_ptr<ModelPackage> base;
    std::deque<std::vector<uint16_t>> bufs;
    std::map<std::tuple<int64_t, int64_t, int>, size_t> by_shape;  // (out, in, K) -> first of trellis, suh, svh
    int32_t marker = int32_t(kExl3Mul1Mult);
  };
  auto st = std::make_shared<Store>();
  st->base = bf;
  uint64_t rng = 0x9E3779B97F4A7C15ull;
  auto next = [&] { return rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17; };
  std::vector<TensorView> views;
  auto view = [&](std::string name, DType dt, std::vector<int64_t> shape, const void* data, size_t bytes) {
    views.push_back(TensorView{std::move(name), dt, std::move(shape), static_cast<const uint8_t*>(data), bytes});
  };
  for (const std::string& n : bf->names()) {
    const TensorView& t = bf->require(n);
    if (!exl3_should_quantize(n, t) || t.dim(0) % 128 || t.dim(1) % 128) {
      views.push_back(t);
      continue;
    }
    const int64_t out = t.dim(0), in = t.dim(1);
    const int bits = expert_K > 0 && n.find(".mlp.experts.") != std::string::npos ? expert_K : K;
    auto [it, fresh] = st->by_shape.emplace(std::make_tuple(out, in, bits), st->bufs.size());
    if (fresh) {
      auto& tr = st->bufs.emplace_back(size_t(in * out * bits / 16));
      for (size_t i = 0; i < tr.size(); i += 4) {
        const uint64_t r = next();
        for (size_t j = 0; j < 4 && i + j < tr.size(); ++j) tr[i + j] = uint16_t(r >> (16 * j));
      }
      for (auto [dim, scale] : {std::pair{in, 1.0}, std::pair{out, 0.02}}) {
        auto& v = st->bufs.emplace_back(size_t(dim));
        for (auto& x : v) x = f64_to_f16_rne(next() & 1 ? scale : -scale);
      }
    }
    const std::string p = n.substr(0, n.size() - 7);
    const auto* b = &st->bufs[it->second];
    view(p + ".trellis", DType::I16, {in / 16, out / 16, 16 * bits}, b[0].data(), b[0].size() * 2);
    view(p + ".suh", DType::F16, {in}, b[1].data(), size_t(in) * 2);
    view(p + ".svh", DType::F16, {out}, b[2].data(), size_t(out) * 2);
    view(p + ".mul1", DType::I32, {}, &st->marker, 4);
  }
  return ModelPackage::from_memory(bf->config(), std::move(views), st, "<synthetic-exl3>");
}

// The planner's package footprint: EXL3 expert and dense linears at their stored bytes, bf16 otherwise.
TEST(CudaExl3Footprint, PackageFootprintUsesStoredBytes) {
  auto cfg = tiny_moe_config(2);
  cfg["moe_intermediate_size"] = 128;  // 128-aligned experts (the synthetic EXL3 skips unaligned shapes)
  const ModelSpec c = ModelSpec::from_json(cfg);
  auto bf = make_synthetic_model(cfg);
  auto q = synthetic_exl3(bf, 3);
  const ModelFootprint fc = footprint_from_config(c), fb = footprint_from_package(c, *bf),
                       fq = footprint_from_package(c, *q);
  EXPECT_EQ(fb.expert_bytes, fc.expert_bytes);
  EXPECT_EQ(fb.dense_bytes, fc.dense_bytes);
  EXPECT_EQ(fb.head_bytes, fc.head_bytes);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    uint64_t expert = 0;  // expert 0's three EXL3 linears as the engine holds them
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      const std::string p = fmt::format("model.layers.{}.mlp.experts.0.{}", l, proj);
      expert += q->require(p + ".trellis").nbytes + q->require(p + ".suh").nbytes + q->require(p + ".svh").nbytes;
    }
    EXPECT_EQ(fq.expert_bytes[size_t(l)], expert) << "layer " << l;
    EXPECT_LT(fq.dense_bytes[size_t(l)], fb.dense_bytes[size_t(l)]) << "layer " << l;
  }
  EXPECT_LT(fq.head_bytes, fb.head_bytes);
  // The same budget holds more expert slots at the stored size.
  PlacementRequest req;
  req.context = 1024;
  req.workspace_bytes = 0;
  req.vram_budget = fb.dense_total() + kv_cache_bytes(c, req.context) + 20 * fb.expert_bytes[0];
  EXPECT_GT(plan_placement(c, fq, req).vram_experts / fq.expert_bytes[0],
            plan_placement(c, fb, req).vram_experts / fb.expert_bytes[0]);
}

#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA

}  // namespace
}  // namespace moesrv
#include <cuda_runtime.h>
namespace moesrv {
namespace {

// The CPU's slices of copied experts (cpu_expert_slices): each decode pass's last copied expert computed in two
// parts, its first intermediate blocks on the CPU and the rest on the GPU from a partial copy (gate's and up's scales
// zeroed there), the slot then topped up for later passes. A small GLM-5 model whose experts have 4 blocks of 128
// (the hf-tiny ones pad theirs to one block), every expert in 6 LRU slots per layer (misses every step), against the
// same engine without slices and against all in VRAM.
TEST(CudaExl3Synthetic, CpuSlicesMatchWholeCopies) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA backend or device";
  auto cfg = tiny_moe_config(3);
  cfg["moe_intermediate_size"] = 512;
  auto q = synthetic_exl3(make_synthetic_model(cfg), 3);
  std::vector<int32_t> prompt, steps;
  for (int i = 0; i < 24; ++i) prompt.push_back((i * 37 + 11) % 512);
  for (int i = 0; i < 12; ++i) steps.push_back((i * 53 + 7) % 512);
  CudaEngine all(q, CudaEngineOptions{});
  const int64_t V = all.vocab_size();
  const std::vector<float> want = test::prefill_then_steps(all, prompt, steps);
  const int64_t rows = int64_t(want.size()) / V;  // the prompt's and every step's
  std::vector<std::vector<ExpertPlacement>> cache = all.placement();
  for (auto& layer : cache) std::fill(layer.begin(), layer.end(), ExpertPlacement::Cache);
  std::vector<float> whole;  // the hybrid engine without slices
  // -2: 2 blocks without top-ups (the expert leaves its slot); 12: 2 blocks with gate and up copied whole
  for (int blocks : {0, 1, 3, -2, 12}) {
    const bool top_up = blocks >= 0, gate_up_whole = blocks > 10;
    blocks = std::abs(blocks) % 10;
    CudaEngineOptions opt;
    opt.cpu_slice_top_up = top_up;
    opt.cpu_slice_gate_up_whole = gate_up_whole;
    opt.placement = cache;
    opt.cache_slots = 6;
    opt.lend_pass_arena = false;
    opt.prefetch_experts = 0;
    opt.cpu_expert_slices = blocks > 0;
    opt.cpu_slice_blocks = blocks;
    CudaEngine e(q, opt);
    const std::vector<float> out = test::prefill_then_steps(e, prompt, steps);
    const CudaEngineStats st = e.stats();
    ASSERT_EQ(out.size(), want.size());
    const double vs_all = testing::max_rel_row_error(out.data(), want.data(), rows, V);
    std::printf(
        "[ info ] cpu slices of %d blocks%s: %ld slices (%ld rows), %ld grouped passes, misses %ld, worst rel "
        "error vs all in VRAM %.2e\n",
        blocks,
        !top_up         ? " (no top-up)"
        : gate_up_whole ? " (gate, up whole)"
                        : "",
        long(st.cpu_slices), long(st.cpu_slice_rows), long(st.grouped_hybrid_passes), long(st.cache_misses), vs_all);
    EXPECT_LE(vs_all, 1e-3) << blocks << " blocks";
    EXPECT_GT(st.grouped_hybrid_passes, 0) << blocks << " blocks";
    if (blocks == 0) {
      EXPECT_EQ(st.cpu_slices, 0);
      whole = out;
      continue;
    }
    EXPECT_GT(st.cpu_slices, 0) << blocks << " blocks";
    EXPECT_EQ(st.cpu_slice_rows, st.cpu_slices * blocks * 128) << blocks << " blocks";
    const double vs_whole = testing::max_rel_row_error(out.data(), whole.data(), rows, V);
    std::printf("[ info ] cpu slices of %d blocks vs whole copies: worst rel error %.2e\n", blocks, vs_whole);
    EXPECT_LE(vs_whole, 1e-4) << blocks << " blocks";
  }
}

// GLM-5 widths (2 layers, 32 experts top-8, synthetic weights), all experts in VRAM: bf16 vs EXL3 K=4 (random
// trellis). Device weight bytes, prefill 2048 tokens, decode ms/token. Opt-in: MOESRV_CUDA_BENCH=1.
TEST(CudaExl3SyntheticGlm5, Throughput) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA backend or device";
  if (!std::getenv("MOESRV_CUDA_BENCH")) GTEST_SKIP() << "set MOESRV_CUDA_BENCH=1";
  auto cfg = glm5_config(2);
  cfg["n_routed_experts"] = 32;
  SyntheticOptions so;
  so.distinct_experts = 4;
  auto bf = make_synthetic_model(cfg, so);
  for (int variant = 0; variant < 2; ++variant) {
    CudaEngineOptions opt;
    opt.max_ctx = 4096;
    opt.prefill_chunk = 2048;
    auto t0 = std::chrono::steady_clock::now();
    CudaEngine e(variant == 0 ? bf : synthetic_exl3(bf, 4), opt);
    const double load = seconds_since(t0);
    const auto timing = test::time_prefill_decode(e, test::bench_prompt(2048), 4, 64);
    const double prefill = timing.prefill_s, decode = timing.decode_s;
    const auto st = e.stats();
    std::printf(
        "[ perf ] glm5-width 2 layers %s: load %.1f s, weights %.2f GiB (EXL3 %.2f), VRAM %.2f GiB, prefill 2048 "
        "tok %.1f ms (%.0f tok/s), decode %.2f ms/token (%.1f tok/s) at ctx ~2k, graph replays %ld\n",
        variant == 0 ? "bf16" : "EXL3 K=4", load, double(st.weight_bytes) / double(1ull << 30),
        double(st.exl3_weight_bytes) / double(1ull << 30), double(st.vram_used) / double(1ull << 30), prefill * 1e3,
        2048 / prefill, decode * 1e3, 1.0 / decode, long(st.graph_replays));
  }
}

// GLM-5.3-Flash (glm5_next) at real width, EXL3 K=4 (random trellis; 288 experts aliasing 8 host weight sets, each
// uploaded or cached as its own block): slices of 4 and 12 layers (MOESRV_BENCH_SLICES=a,b: a and b, multiples of
// 4; i % 4 == 3 MLA with the k-pool indexer, the rest KDA; all MoE; mHC 4 streams). The difference of the two slices
// is the time of b - a layers (3 KDA : 1 MLA, the full model's 34:11 mix within 3%); the rest of the smaller slice is
// the embedding + head. Projection to 45 layers: head + 45 x (one layer).
// Placements: "all" (every expert in VRAM) and --vram-budget 22 / 44 GiB scaled to the slice: the planner
// (runtime/placement.h) plans the whole 45-layer model (footprint and usage of the slice repeated every 4 layers)
// at the largest context of the run, and the slice's layers get the plan's homes for its first layers (pinned ->
// VRAM, cached/fetch -> LRU slots fed from pinned RAM, cpu -> computed on the host). Usage statistics come from a
// recording run of the 4-layer slice with the same routing. Routing: "uniform" (random router) or "skewed" (router
// bias -0.05 ln(1 + rank), SyntheticOptions::router_skew; the measured share of the hottest half is reported).
// Floor per placement: max over HBM (dense weights, VRAM-served experts, recurrent state, selected latent rows and
// pooled keys), PCIe (expert bytes fetched per token) and host RAM (expert bytes the CPU read per token) of bytes /
// measured bandwidth (device copy, pinned H2D, host memcpy); expert traffic is counted by the engine (CudaEngineStats).
// Opt-in: MOESRV_CUDA_BENCH=1. MOESRV_BENCH_JSON=<file> writes docs/perf/glm5-next-h200.json's format;
// MOESRV_BENCH_CONTEXTS (default 8192,32768), MOESRV_BENCH_BUDGETS (default all; e.g. all,44,22),
// MOESRV_BENCH_ROUTING (default uniform; e.g. skewed,uniform) pick the matrix; MOESRV_BENCH_MLA_SPLIT=0 decodes MLA
// with the per-head kernel instead of the key-split one (the default); MOESRV_BENCH_PREFILL_RUNS (default 2): the
// prefill is timed that many times per slice and context, the best kept. Each row also has "mtp" (the verify cost and
// projected speed-up, issue 24); the JSON's "concurrency" has B = MOESRV_BENCH_STREAMS (default 1,2,4,8) streams
// decoding together at the first context (Engine::forward_batch; issue 23).
std::vector<std::string> env_list(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  std::string s = v && *v ? v : fallback;
  std::vector<std::string> out;
  for (size_t b = 0; b <= s.size();) {
    size_t e = s.find(',', b);
    if (e == std::string::npos) e = s.size();
    if (e > b) out.push_back(s.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

struct Bandwidths {
  double device_copy = 0, pcie_h2d = 0, host = 0;  // GB/s
  // Pinned H2D copies and host memcpy at once (GB/s of both together): what cold experts get from PCIe fetches and
  // CPU reads side by side, the hybrid rows' floor (issue 21).
  double host_and_pcie = 0;
};

// 5 H2D copies of n bytes from `pinned` on one thread while the pool copies host memory (parallel_host_copy, as
// measure_memcpy_gbps) until they finish: the bytes of both per second.
double measure_host_and_pcie_gbps(void* dev, const void* pinned, size_t n) {
  constexpr size_t kHost = size_t(256) << 20;
  std::vector<char> a(kHost, 1), b(kHost, 2);
  std::atomic<bool> done{false};
  const auto t0 = std::chrono::steady_clock::now();
  std::thread copier([&] {
    for (int i = 0; i < 5; ++i) cudaMemcpy(dev, pinned, n, cudaMemcpyHostToDevice);
    done = true;
  });
  double host_bytes = 0;
  while (!done) {
    parallel_host_copy(b.data(), a.data(), kHost);
    host_bytes += double(kHost);
  }
  copier.join();
  return (5.0 * double(n) + host_bytes) / seconds_since(t0) / 1e9;
}

Bandwidths measure_bandwidths() {
  Bandwidths bw;
  const size_t n = size_t(1) << 30;
  void *a = nullptr, *b = nullptr, *h = nullptr;
  EXPECT_EQ(cudaMalloc(&a, n), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&b, n), cudaSuccess);
  EXPECT_EQ(cudaMallocHost(&h, n), cudaSuccess);
  std::memset(h, 1, n);
  cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
  cudaMemcpy(a, h, n, cudaMemcpyHostToDevice);
  cudaDeviceSynchronize();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 10; ++i) cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
  cudaDeviceSynchronize();
  bw.device_copy = 2.0 * 10 * double(n) / seconds_since(t0) / 1e9;  // read + write
  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 5; ++i) cudaMemcpy(a, h, n, cudaMemcpyHostToDevice);
  cudaDeviceSynchronize();
  bw.pcie_h2d = 5.0 * double(n) / seconds_since(t0) / 1e9;
  bw.host_and_pcie = measure_host_and_pcie_gbps(a, h, n);
  cudaFree(a);
  cudaFree(b);
  cudaFreeHost(h);
  bw.host = measure_memcpy_gbps();
  return bw;
}

// What one routed EXL3 expert costs on the host CPU (the pool the hybrid path runs cold experts on): seconds for
// 1 and for 64 tokens, best of 3. The planner's CPU cost uses them (trellis decoding, not memory, bounds it).
struct CpuExpertRate {
  double s1 = 0, s64 = 0, bytes = 0, params = 0;
};

CpuExpertRate measure_cpu_expert(const std::shared_ptr<ModelPackage>& pkg) {
  auto w = ModelWeights::load(pkg, load_linear);
  CpuExpertRate r;
  for (const auto& L : w->layers) {
    if (!L.moe) continue;
    const MlpWeights& m = L.moe->experts[0];
    r.bytes = double(m.gate->stored_bytes() + m.up->stored_bytes() + m.down->stored_bytes());
    r.params =
        double(m.gate->in_features() * m.gate->out_features() * 2 + m.down->in_features() * m.down->out_features());
    const int64_t D = m.gate->in_features();
    std::vector<float> x(size_t(64 * D), 0.01f), y(size_t(64 * D));
    for (int64_t n : {int64_t(1), int64_t(64)}) {
      double best = 1e30;
      for (int i = 0; i < 3; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        cpu::mlp_forward(m, x.data(), n, y.data());
        best = std::min(best, seconds_since(t0));
      }
      (n == 1 ? r.s1 : r.s64) = best;
    }
    break;
  }
  return r;
}

// One placement of one slice at one context: prefill, then decode with the engine's expert traffic per token.
struct SliceRun {
  double prefill_s = 0, decode_s = 0;          // whole prompt, per token
  double selections = 0, vram_selections = 0;  // per decode token (host-planned passes only)
  double fetched_bytes = 0, cpu_bytes = 0;     // per decode token
  double zc_selections = 0, zc_bytes = 0;      // per decode token: host experts read in place (zero_copy_cold)
  double prefetched = 0, prefetch_hits = 0;    // per decode token: experts copied ahead, and of those used
  double cpu_slices = 0, cpu_slice_rows = 0;   // per decode token: experts the CPU shared (cpu_expert_slices), rows
  double cpu_slice_s = 0;                      // per decode token: the CPU's wall time on them
  double cpu_slice_scale = 0;                  // the engine's ratio of measured to estimated slice time
  double prefill_fetched_bytes = 0;            // experts copied over PCIe by the (best) prefill, whole prompt
  double prefill_cpu_bytes = 0;                // experts the host computed in that prefill (stored bytes)
  int64_t zc_layers = 0;
  int64_t graph_nodes = 0;                     // of the decode graph (all-VRAM placements; else 0)
  std::vector<double> verify_s;                // [k - 1]: MTP verify of k + 1 tokens (time_prefill_decode)
  // [k - 1]: the verify's 4 passes of k + 1 tokens together (host-planned placements): host-planned MoE passes, those
  // through the grouped GEMVs, bytes copied over PCIe, bytes the CPU read
  struct VerifyTraffic {
    int64_t passes = 0, grouped = 0;
    double fetched_bytes = 0, cpu_bytes = 0;
  };
  std::vector<VerifyTraffic> verify_traffic;
  bool hybrid = false;
  std::array<double, size_t(CudaPhase::Count)> prefill_phase_s{};  // device seconds per block kind
};

constexpr int kMtpVerifyK = 3;  // verify of 2, 3 and 4 tokens after the timed decode steps

SliceRun run_slice(CudaEngine& e, int64_t ctx, int decode_tokens) {
  SliceRun r;
  const CudaEngineStats before = e.stats();
  CudaEngineStats a, b;  // after the prefill and 4 warm steps (graph capture); after the timed steps
  // (b before the MTP verify passes: their tokens are not decode steps, and under a budget they fetch experts)
  CudaEngineStats v = {};  // before each k's verify passes
  const auto t = test::time_prefill_decode(
      e, test::bench_prompt(size_t(ctx)), 4, decode_tokens, false, [&] { a = e.stats(); }, kMtpVerifyK,
      [&] { v = b = e.stats(); },
      [&](int k) {  // (k runs 1 .. 3, or 3 .. 1 with MOESRV_BENCH_VERIFY_REVERSE)
        const CudaEngineStats w = e.stats();
        r.verify_traffic.resize(size_t(kMtpVerifyK));
        r.verify_traffic[size_t(k - 1)] = {w.hybrid_passes - v.hybrid_passes,
                                           w.grouped_hybrid_passes - v.grouped_hybrid_passes,
                                           w.fetched_bytes - v.fetched_bytes, w.cpu_expert_bytes - v.cpu_expert_bytes};
        v = w;
      });
  r.prefill_s = t.prefill_s;
  r.decode_s = t.decode_s;
  r.verify_s = t.verify_s;
  const double n = decode_tokens;
  r.selections = double(b.routed_selections - a.routed_selections) / n;
  r.vram_selections = double(b.vram_selections - a.vram_selections) / n;
  r.fetched_bytes = (b.fetched_bytes - a.fetched_bytes) / n;
  r.cpu_bytes = (b.cpu_expert_bytes - a.cpu_expert_bytes) / n;
  r.zc_selections = double(b.zero_copy_selections - a.zero_copy_selections) / n;
  r.zc_bytes = (b.zero_copy_bytes - a.zero_copy_bytes) / n;
  r.zc_layers = b.zero_copy_layers;
  r.prefetched = double(b.prefetched_experts - a.prefetched_experts) / n;
  r.prefetch_hits = double(b.prefetch_hits - a.prefetch_hits) / n;
  r.cpu_slices = double(b.cpu_slices - a.cpu_slices) / n;
  r.cpu_slice_rows = double(b.cpu_slice_rows - a.cpu_slice_rows) / n;
  r.cpu_slice_s = (b.cpu_slice_s - a.cpu_slice_s) / n;
  r.cpu_slice_scale = b.cpu_slice_scale;
  r.hybrid = r.selections > 0;
  r.graph_nodes = b.graph_replays > a.graph_replays ? b.graph_nodes : 0;
  for (size_t p = 0; p < r.prefill_phase_s.size(); ++p) r.prefill_phase_s[p] = a.phase_s[p] - before.phase_s[p];
  r.prefill_fetched_bytes = a.fetched_bytes - before.fetched_bytes;  // (+ the 4 warm decode steps' few)
  r.prefill_cpu_bytes = a.cpu_expert_bytes - before.cpu_expert_bytes;
  // The prefill's best of MOESRV_BENCH_PREFILL_RUNS (default 2) runs, with that run's phases: under a budget one
  // run's experts phase varies by up to ~30% (PCIe copies against the GPU's work), and the 45-layer projection
  // doubles the 4-layer slice's error (docs/perf-cuda.md, "Eighteenth round").
  static const int runs = [] {
    const char* v = std::getenv("MOESRV_BENCH_PREFILL_RUNS");
    return std::max(1, v && v[0] ? std::atoi(v) : 2);
  }();
  for (int i = 1; i < runs; ++i) {
    const CudaEngineStats s0 = e.stats();
    auto seq = e.new_sequence();
    const auto t0 = std::chrono::steady_clock::now();
    e.forward(*seq, test::bench_prompt(size_t(ctx)));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= r.prefill_s) continue;
    r.prefill_s = s;
    const CudaEngineStats s1 = e.stats();
    for (size_t p = 0; p < r.prefill_phase_s.size(); ++p) r.prefill_phase_s[p] = s1.phase_s[p] - s0.phase_s[p];
    r.prefill_fetched_bytes = s1.fetched_bytes - s0.fetched_bytes;
    r.prefill_cpu_bytes = s1.cpu_expert_bytes - s0.cpu_expert_bytes;
  }
  return r;
}

// Decode of B concurrent streams (issue 23): B clones of one sequence prefilled to `ctx`, each fed its own token, one
// forward_batch step for all of them, seconds per step (after 2 untimed steps: graph captures), for each B in
// `streams`.
std::map<int64_t, double> time_streams(CudaEngine& e, int64_t ctx, const std::vector<int64_t>& streams) {
  std::map<int64_t, double> out;
  auto base = e.new_sequence();
  const auto logits = e.forward(*base, test::bench_prompt(size_t(ctx)));
  const int32_t first = test::greedy(logits);
  for (int64_t B : streams) {
    std::vector<std::unique_ptr<SequenceState>> own;
    std::vector<SequenceState*> seqs;
    for (int64_t b = 0; b < B; ++b) own.push_back(base->clone()), seqs.push_back(own.back().get());
    std::vector<int32_t> tokens;  // a different token per stream: the streams route apart from the first step
    for (int64_t b = 0; b < B; ++b) tokens.push_back(int32_t((first + 97 * b) % e.vocab_size()));
    auto step = [&] {
      const auto l = e.forward_batch(seqs, tokens);
      for (size_t b = 0; b < l.size(); ++b) tokens[b] = test::greedy(l[b]);
    };
    step(), step();
    constexpr int kSteps = 8;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kSteps; ++i) step();
    out[B] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / kSteps;
  }
  return out;
}

TEST(CudaExl3SyntheticGlm5Next, Throughput) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA backend or device";
  if (!std::getenv("MOESRV_CUDA_BENCH")) GTEST_SKIP() << "set MOESRV_CUDA_BENCH=1";
  const Bandwidths bw = measure_bandwidths();
  std::printf(
      "[ perf ] bandwidths: device copy %.0f GB/s, pinned H2D %.1f GB/s, host memcpy %.1f GB/s, both at once "
      "%.1f GB/s\n",
      bw.device_copy, bw.pcie_h2d, bw.host, bw.host_and_pcie);
  std::vector<int64_t> contexts;
  for (const std::string& s : env_list("MOESRV_BENCH_CONTEXTS", "8192,32768")) contexts.push_back(std::stoll(s));
  const std::vector<std::string> budgets = env_list("MOESRV_BENCH_BUDGETS", "all");
  const std::vector<std::string> routings = env_list("MOESRV_BENCH_ROUTING", "uniform");
  const int64_t max_ctx = *std::max_element(contexts.begin(), contexts.end());
  constexpr int kFull = 45, kDecode = 32;
  const ModelSpec c45 = ModelSpec::from_json(glm5_next_config(kFull));
  const int64_t E = c45.n_routed_experts, K = c45.experts_per_token;
  nlohmann::json results = nlohmann::json::array(), concurrency = nlohmann::json::array();
  std::vector<int64_t> streams;  // MOESRV_BENCH_STREAMS (default 1,2,4,8; 0: none), at the first context
  // MOESRV_BENCH_SLICES=a,b: the two slices' layer counts (multiples of 4, a < b; default 4,12). The projection is
  // ra + (45 - a) (rb - ra) / (b - a): with 4,8 it weighs the slices' times -9.25 and 10.25, so one slow 4-layer run
  // moved the 45-layer decode by 20-40% (docs/perf-cuda.md, "Thirty-third round"); with 4,12, -4.1 and 5.1.
  const std::vector<std::string> slice_list = env_list("MOESRV_BENCH_SLICES", "4,12");
  const int la = slice_list.size() == 2 ? std::stoi(slice_list[0]) : 0, lb = la ? std::stoi(slice_list[1]) : 0;
  if (la < 4 || lb <= la || la % 4 || lb % 4) fail("MOESRV_BENCH_SLICES: two multiples of 4, the first smaller");
  for (const std::string& v : env_list("MOESRV_BENCH_STREAMS", "1,2,4,8"))
    if (std::stoll(v) > 0) streams.push_back(std::stoll(v));
  // MOESRV_BENCH_EXPERT_BITS: the routed experts' K. Default 3, as the published EXL3 3.05 bpw package stores them
  // (9.44 MB per expert); the other linears stay at K=4. Until session 36 every linear was K=4 (12.6 MB per expert).
  const int expert_bits = std::stoi(env_list("MOESRV_BENCH_EXPERT_BITS", "3").at(0));
  if (expert_bits < 1 || expert_bits > 8) fail("MOESRV_BENCH_EXPERT_BITS: 1..8");

  for (const std::string& routing : routings) {
    SyntheticOptions so;
    so.distinct_experts = 8;
    so.router_skew = routing == "skewed" ? 0.05 : 0.0;
    std::map<int, std::shared_ptr<ModelPackage>> pkg;
    for (int layers : {4, la, lb})
      if (!pkg.count(layers))
        pkg[layers] = synthetic_exl3(make_synthetic_model(glm5_next_config(layers), so), 4, expert_bits);
    const ModelSpec c4 = ModelSpec::from_json(pkg[4]->config());
    const ModelFootprint fp4 = footprint_from_package(c4, *pkg[4]);
    // The whole model's footprint and usage: the slice's 4 layers repeated.
    ModelFootprint fp45 = fp4;
    fp45.expert_bytes.clear(), fp45.expert_params.clear(), fp45.dense_bytes.clear(), fp45.dense_params.clear();
    UsageStats usage45(kFull, E, K);
    double hot_half_share = 0;
    {
      CudaEngineOptions opt;
      opt.max_ctx = 4096 + 64;
      CudaEngine rec(pkg[4], opt);
      auto seq = rec.new_sequence();
      std::vector<int32_t> prompt(4096);
      for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t((i * 104729) % 150000);
      rec.forward(*seq, prompt);
      const UsageStats& u4 = *rec.expert_usage();
      double top = 0, all = 0;
      for (int64_t l = 0; l < kFull; ++l) {
        const int64_t s = l % 4;
        fp45.expert_bytes.push_back(fp4.expert_bytes[size_t(s)]);
        fp45.expert_params.push_back(fp4.expert_params[size_t(s)]);
        fp45.dense_bytes.push_back(fp4.dense_bytes[size_t(s)]);
        fp45.dense_params.push_back(fp4.dense_params[size_t(s)]);
        std::vector<double> cnt = u4.counts(s);
        std::vector<uint32_t> c32(cnt.size());
        for (size_t i = 0; i < cnt.size(); ++i) c32[i] = uint32_t(cnt[i]);
        usage45.add_counts(l, c32.data(), u4.tokens(s));
        if (l < 4) {
          std::sort(cnt.rbegin(), cnt.rend());
          for (size_t i = 0; i < cnt.size(); ++i) (i < cnt.size() / 2 ? top : all) += cnt[i];
        }
      }
      hot_half_share = top / std::max(1.0, top + all);
    }
    std::printf(
        "[ perf ] routing %s: hottest half of each layer's experts takes %.1f%% of the selections; routed experts "
        "K=%d, %.2f MB each\n",
        routing.c_str(), 100 * hot_half_share, expert_bits, double(fp4.expert_bytes[0]) / 1e6);
    const CpuExpertRate cpu = measure_cpu_expert(pkg[4]);
    std::printf(
        "[ perf ] one EXL3 expert on the host CPU: %.2f ms for 1 token (%.2f GB/s of stored bytes), %.2f ms "
        "for 64 tokens (%.0f GFLOP/s)\n",
        cpu.s1 * 1e3, cpu.bytes / cpu.s1 / 1e9, cpu.s64 * 1e3, 2 * cpu.params * 64 / cpu.s64 / 1e9);

    for (const std::string& budget : budgets) {
      CudaEngineOptions base;
      base.max_ctx = max_ctx + 64;
      base.prefill_chunk = 8192;  // MOESRV_BENCH_PREFILL_CHUNK=N: tokens per prefill pass
      if (const char* v = std::getenv("MOESRV_BENCH_PREFILL_CHUNK")) base.prefill_chunk = std::max(1L, std::atol(v));
      base.time_phases = true;
      if (const char* v = std::getenv("MOESRV_BENCH_MLA_SPLIT")) base.mla_split_decode = std::string(v) != "0";
      PlacementRequest req;
      req.vram_budget = budget == "all" ? 0 : uint64_t(std::stod(budget) * double(kGiB));
      req.context = max_ctx;
      req.cost.hbm_gbps = bw.device_copy;
      req.cost.pcie_gbps = bw.pcie_h2d;
      // The CPU path as measured: a 1-token expert costs s1 (trellis decoding), tokens add FLOPs.
      req.cost.host_mem_gbps = std::min(bw.host, cpu.bytes / cpu.s1 / 1e9);
      req.cost.cpu_gflops = 2 * cpu.params * 64 / cpu.s64 / 1e9;
      // Zero copy (MOESRV_ZERO_COPY=1): decode uses no LRU, so the plan pins every slot but prefill's streaming ones,
      // as the engine factory does under --cold-experts read.
      if (const char* z = std::getenv("MOESRV_ZERO_COPY"); z && std::atoi(z) != 0) req.lru_slots = kPrefillStreamSlots;
      std::map<int, std::vector<SliceRun>> t;  // layers -> per context
      std::map<int, std::map<int64_t, double>> per_step;  // layers -> streams -> seconds per batched step
      int64_t group_tokens = 0;  // tokens per prefill group (pass x passes per group), as the engine runs them
      nlohmann::json hybrid;     // the engine's hybrid settings in effect (rows under a budget)
      for (int layers : {la, lb}) {
        CudaEngineOptions opt = base;
        if (budget != "all") {
          opt.prefill_group = EngineOptions::default_prefill_group(std::stod(budget));  // as the factory sets it
          // The 45-layer plan (its first layers' homes on the slice), planned as the engine factory does: inside the
          // engine once its activations and scratch are allocated, with them as the plan's workspace (the engine's
          // bytes beyond the slice's own dense weights and caches). The device holds the slice's explicit homes.
          const ModelSpec cs = ModelSpec::from_json(pkg[layers]->config());
          const ModelFootprint fps = footprint_from_package(cs, *pkg[layers]);
          opt.plan_placement = [&, cs, fps, layers](size_t engine_bytes, size_t, CudaEngineOptions& o) {
            PlacementRequest own = req;
            own.workspace_bytes = 0;
            const PlacementPlan counted = plan_placement(cs, fps, own, nullptr);
            PlacementRequest r = req;
            r.workspace_bytes = engine_bytes - std::min<uint64_t>(engine_bytes, counted.vram_dense + counted.vram_kv);
            PlacementPlan plan = plan_placement(c45, fp45, r, &usage45);
            if (!plan.fits) fail("plan at {} GiB: {}", budget, plan.note);
            if (layers == la)
              std::printf("[ perf ] plan at %s GiB, ctx %ld, workspace %.2f GiB: %s\n", budget.c_str(), long(max_ctx),
                          double(r.workspace_bytes) / double(kGiB), plan.summary().c_str());
            int cold_layers = 0;  // the whole model's MoE layers with experts outside VRAM share the lent arena
            for (const LayerPlacement& lp : plan.layers)
              cold_layers += !lp.home.empty() && lp.count(ExpertHome::Pinned) < int64_t(lp.home.size());
            plan.layers.resize(size_t(layers));
            apply_placement_plan(plan, o);
            o.vram_budget_gib = 0;
            o.lend_share_layers = cold_layers;
          };
        }
        CudaEngine e(pkg[layers], opt);
        group_tokens = e.prefill_chunk();
        const CudaEngineStats setup = e.stats();
        hybrid = {{"lanes", setup.hybrid_lanes},
                  {"lanes_copied", setup.hybrid_lanes_copied},
                  {"stream_window", setup.stream_window},
                  {"lent_slots", setup.lent_slots},
                  {"cold_pcie_gbps", setup.cold_pcie_gbps},
                  {"cold_cpu_expert_ms", setup.cold_cpu_expert_ms},
                  {"cpu_slice_fixed_ms", setup.cpu_slice_fixed_ms}};
        if (budget != "all" && layers == la)
          std::printf(
              "[ perf ] %s GiB: %ld lent slots over the %d layers (lend_pass_arena); cold rates: PCIe %.1f GB/s, CPU "
              "expert %.3f ms, slice fixed %.3f ms\n",
              budget.c_str(), long(setup.lent_slots), la, setup.cold_pcie_gbps, setup.cold_cpu_expert_ms,
              setup.cpu_slice_fixed_ms);
        {  // one-time costs (module loads, library handles, first-use allocations) before anything is timed: a
           // whole prefill pass, so the expert GEMMs meet the row counts of the timed passes (lazily loaded cuBLAS
           // kernels had put a fixed cost into the 4-layer runs that the 8 - 4 layer projection read as speed)
          auto warm = e.new_sequence();
          e.forward(*warm, test::bench_prompt(size_t(std::min<int64_t>(opt.prefill_chunk, max_ctx))));
        }
        for (int64_t ctx : contexts) {
          t[layers].push_back(run_slice(e, ctx, kDecode));
          const SliceRun& r = t[layers].back();
          std::printf(
              "[ perf ] glm5_next %d layers, %s GiB, %s, ctx %ld: prefill %.2f s (%.0f tok/s), decode %.2f "
              "ms/token, VRAM %.2f GiB\n",
              layers, budget.c_str(), routing.c_str(), long(ctx), r.prefill_s, double(ctx) / r.prefill_s,
              r.decode_s * 1e3, double(e.stats().vram_used) / double(kGiB));
        }
        if (!streams.empty()) per_step[layers] = time_streams(e, contexts[0], streams);
      }
      for (int64_t B : streams) {  // projected to 45 layers as decode is
        const double sl = (per_step[lb][B] - per_step[la][B]) / (lb - la), s45 = per_step[la][B] - la * sl + kFull * sl;
        std::printf("[ perf ] %ld streams, %s GiB, %s, ctx %ld: %.1f tok/s aggregate, %.1f per stream\n", long(B),
                    budget.c_str(), routing.c_str(), long(contexts[0]), double(B) / s45, 1 / s45);
        concurrency.push_back(
            {{"streams", B},
             {"vram_budget_gib", budget == "all" ? nlohmann::json("all") : nlohmann::json(std::stod(budget))},
             {"routing", routing},
             {"context", contexts[0]},
             {"expert_bits", expert_bits},
             {"aggregate_tok_s", double(B) / s45},
             {"per_stream_tok_s", 1 / s45}});
      }
      for (size_t i = 0; i < contexts.size(); ++i) {
        const SliceRun &ra = t[la][i], &rb = t[lb][i];
        const double span = lb - la, pl = (rb.prefill_s - ra.prefill_s) / span, dl = (rb.decode_s - ra.decode_s) / span;
        const double p45 = ra.prefill_s - la * pl + kFull * pl, d45 = ra.decode_s - la * dl + kFull * dl;
        const double ctx = double(contexts[i]);
        // Bytes per decode token, 45 layers. Dense weights and the head from the footprint; state per 4 layers:
        // 3 KDA states read + written (fp32), one MLA layer's selected latent rows (bf16) and pooled keys (fp32).
        double dense4 = 0;
        for (int64_t l = 0; l < 4; ++l) dense4 += double(fp4.dense_bytes[size_t(l)]);
        const double state4 = 3 * 2.0 * double(c4.linear.state_floats()) * 4 +
                              double(c4.index_topk + c4.index_kpool) * double(c4.kv_lora_rank) * 2 +
                              ctx / double(c4.index_kpool) * double(c4.index_head_dim) * 4;
        const double per_layer_expert = double(fp4.expert_bytes[0]);
        // Expert traffic of the larger slice per layer: measured on host-planned passes, else all in VRAM.
        // (Zero copy: decode takes the grouped path, host experts read in place over PCIe, counted on the device.)
        const double vram_sel = rb.hybrid ? rb.vram_selections / lb : double(K) - rb.zc_selections / lb;
        const double hbm =
            double(fp4.head_bytes) + kFull / 4.0 * (dense4 + state4) + kFull * vram_sel * per_layer_expert;
        const double pcie = kFull * (rb.fetched_bytes + rb.zc_bytes) / lb, host = kFull * rb.cpu_bytes / lb;
        // Cold experts' bytes (fetched or read by the CPU) at the rate of both paths together: the floor of any
        // split between them (issue 21); "as split" keeps each path's bytes of this run at its own rate.
        const double floor_s = std::max(hbm / (bw.device_copy * 1e9), (pcie + host) / (bw.host_and_pcie * 1e9));
        const double split_floor_s =
            std::max({hbm / (bw.device_copy * 1e9), pcie / (bw.pcie_h2d * 1e9), host / (bw.host * 1e9)});
        const double hit = rb.hybrid ? rb.vram_selections / std::max(1.0, rb.selections)
                                     : 1.0 - rb.zc_selections / (double(lb) * double(K));
        const double nodes_per_layer = double(rb.graph_nodes - ra.graph_nodes) / span;
        std::printf(
            "[ perf ] decode per layer %.1f us, head + embedding %.1f us, graph nodes per layer %.1f (%ld in "
            "the %d-layer graph)\n",
            dl * 1e6, (ra.decode_s - la * dl) * 1e6, nodes_per_layer, long(ra.graph_nodes), la);
        std::printf(
            "[ perf ] glm5_next 45 layers, %s GiB, %s, ctx %ld: decode %.1f tok/s (floor %.1f, %.0f%%; as split "
            "%.1f), prefill %.0f tok/s (TTFT %.1f s), hit rate %.3f, GB/token HBM %.2f PCIe %.3f host %.3f\n",
            budget.c_str(), routing.c_str(), long(contexts[i]), 1 / d45, 1 / floor_s, 100 * floor_s / d45,
            1 / split_floor_s, ctx / p45, p45, hit, hbm / 1e9, pcie / 1e9, host / 1e9);
        nlohmann::json phases = nlohmann::json::object();
        std::string phase_line;
        for (size_t p = 0; p < ra.prefill_phase_s.size(); ++p) {
          const double per_layer = (rb.prefill_phase_s[p] - ra.prefill_phase_s[p]) / span;
          const double v45 = std::max(0.0, ra.prefill_phase_s[p] - la * per_layer + kFull * per_layer);
          phases[cuda_phase_name(CudaPhase(p))] = v45;
          phase_line += " " + std::string(cuda_phase_name(CudaPhase(p))) + " " + std::to_string(v45).substr(0, 6);
        }
        std::printf("[ perf ] prefill device seconds per block kind, 45 layers projected:%s\n", phase_line.c_str());
        // Issue 20's hybrid prefill floor: the experts the prompt's groups copy over PCIe (45 layers, projected as the
        // time is) at the measured pinned H2D rate.
        const double fl = (rb.prefill_fetched_bytes - ra.prefill_fetched_bytes) / span;
        const double prefill_pcie = std::max(0.0, ra.prefill_fetched_bytes - la * fl + kFull * fl);
        const double prefill_floor_s = prefill_pcie / (bw.pcie_h2d * 1e9);
        if (prefill_pcie > 0)
          std::printf("[ perf ] prefill PCIe %.1f GB (45 layers): floor %.2f s (%.0f tok/s), TTFT %.2f s = %.1fx it\n",
                      prefill_pcie / 1e9, prefill_floor_s, ctx / prefill_floor_s, p45, p45 / prefill_floor_s);
        for (const SliceRun* run : {&ra, &rb}) {
          std::string raw;
          for (size_t p = 0; p < run->prefill_phase_s.size(); ++p)
            raw += " " + std::string(cuda_phase_name(CudaPhase(p))) + " " +
                   std::to_string(run->prefill_phase_s[p]).substr(0, 6);
          // (under a budget: the experts this slice's prefill copied and those the host computed, which the 45-layer
          // projection of the experts phase is most sensitive to)
          std::printf("[ perf ]   measured, %d layers:%s | PCIe %.2f GB, host experts %.3f GB\n", run == &ra ? la : lb,
                      raw.c_str(), run->prefill_fetched_bytes / 1e9, run->prefill_cpu_bytes / 1e9);
        }
        nlohmann::json row = {
            {"vram_budget_gib", budget == "all" ? nlohmann::json("all") : nlohmann::json(std::stod(budget))},
            {"routing", routing},
            {"context", contexts[i]},
            {"expert_bits", expert_bits},
            {"decode_tok_s", 1 / d45},
            {"floor_tok_s", 1 / floor_s},
            {"floor_as_split_tok_s", 1 / split_floor_s},
            {"prefill_tok_s", ctx / p45},
            {"ttft_s", p45},
            {"hit_rate", hit},
            {"prefill_pass_tokens", base.prefill_chunk},
            {"prefill_group_tokens", group_tokens},
            {"prefill_pcie_bytes", prefill_pcie},
            {"prefill_pcie_floor_s", prefill_floor_s},
            {"hot_half_share", hot_half_share},
            {"decode_us_per_layer", dl * 1e6},
            {"graph_nodes_per_layer", nodes_per_layer},
            {"prefill_phase_s", phases},
            {"bytes_per_token", {{"hbm", hbm}, {"pcie", pcie}, {"host", host}}}};
        if (rb.zc_layers) row["zero_copy_layers_of_" + std::to_string(lb)] = rb.zc_layers;
        if (budget != "all") row["hybrid"] = hybrid;
        if (rb.cpu_slices > 0) {  // per decode token, 45 layers (the slice's lb layers scaled)
          const double sl = kFull * rb.cpu_slices / lb, rows = rb.cpu_slice_rows / rb.cpu_slices;
          const double us = 1e6 * rb.cpu_slice_s / rb.cpu_slices;
          row["cpu_slices"] = {
              {"per_token", sl}, {"rows_per_slice", rows}, {"cpu_us_per_slice", us}, {"scale", rb.cpu_slice_scale}};
          std::printf(
              "[ perf ] cpu slices: %.1f experts per token shared with the CPU (45 layers), %.0f rows each, %.0f us "
              "of CPU each, time over estimate %.2f\n",
              sl, rows, us, rb.cpu_slice_scale);
        }
        if (rb.prefetched >
            0) {  // issue 21 item 3: per decode token; lb - 1 of the slice's layers have a next one, 44 of 45
          const double ahead = (kFull - 1) * rb.prefetched / (lb - 1), used = (kFull - 1) * rb.prefetch_hits / (lb - 1);
          row["prefetch"] = {{"experts_per_token", ahead}, {"used_per_token", used}};
          std::printf("[ perf ] prefetch: %.1f experts copied ahead per token (45 layers), %.1f of them used\n", ahead,
                      used);
        }
        // MTP (issue 24): the verify projected to 45 layers as decode is; a draft costs one decode layer + the head
        // (the MTP block is one decoder layer sharing the lm_head). The verify is the engine's forward_hidden with
        // rollback points (a graph per row count when all experts are in VRAM), then a cut back to its first token.
        nlohmann::json mtp = nlohmann::json::array();
        std::string mtp_line;
        std::vector<double> step_s{d45};  // a step of k drafts, k = 0.. (for the adaptive draft length)
        for (size_t k = 1; k <= ra.verify_s.size() && k <= rb.verify_s.size(); ++k) {
          const double vl = (rb.verify_s[k - 1] - ra.verify_s[k - 1]) / span;
          const double v45 = ra.verify_s[k - 1] - la * vl + kFull * vl, head = ra.decode_s - la * dl;
          // (a draft's cost, one layer + the head, can come out below 0 from noisy hybrid timings: 0 then)
          const double draft = std::max(0.0, dl + head);
          mtp.push_back(mtp_projection_json(int(k), d45, v45, draft));
          step_s.push_back(v45 + double(k) * draft);
          mtp_line += " k=" + std::to_string(k) + " verify/decode " + std::to_string(v45 / d45).substr(0, 5) +
                      " speed-up at 0.7 " +
                      std::to_string(mtp.back()["projected_speedup_at_0.7"].get<double>()).substr(0, 5);
        }
        row["mtp"] = mtp;
        if (step_s.size() > 1) {  // --speculative mtp:K (adaptive) from these step costs
          row["mtp_adaptive"] = mtp_adaptive_json(step_s);
          for (const char* a : {"0", "0.7"})
            mtp_line += std::string(" adaptive at ") + a + " " +
                        std::to_string(row["mtp_adaptive"][std::string("speedup_at_") + a].get<double>()).substr(0, 5);
        }
        std::printf("[ perf ] MTP, 45 layers projected:%s\n", mtp_line.c_str());
        if (rb.hybrid && !rb.verify_traffic.empty()) {  // (the hybrid verify's cost against decode: how its passes ran)
          nlohmann::json vt = nlohmann::json::array();
          std::string vt_line;
          for (size_t k = 1; k <= rb.verify_traffic.size(); ++k) {
            const auto& q = rb.verify_traffic[k - 1];
            vt.push_back({{"k", k},
                          {"moe_passes", q.passes},
                          {"grouped_passes", q.grouped},
                          {"pcie_bytes", q.fetched_bytes},
                          {"host_bytes", q.cpu_bytes}});
            char buf[160];
            std::snprintf(buf, sizeof buf, " k=%zu: %ld MoE passes, %ld grouped, PCIe %.2f GB, host %.2f GB;", k,
                          long(q.passes), long(q.grouped), q.fetched_bytes / 1e9, q.cpu_bytes / 1e9);
            vt_line += buf;
          }
          row["mtp_verify_traffic_" + std::to_string(lb) + "_layers"] = vt;
          std::printf("[ perf ] MTP verify passes (%d-layer slice, 4 forwards per k):%s\n", lb, vt_line.c_str());
        }
        results.push_back(row);
      }
    }
  }
  if (const char* path = std::getenv("MOESRV_BENCH_JSON")) {
    nlohmann::json j = {
        {"model", "glm5_next"},
        {"layers_measured", lb},
        {"slices", {la, lb}},
        {"weights", fmt::format("EXL3 (random MUL1 trellis): routed experts K={}, other linears K=4; 288 experts "
                                "aliasing 8 host weight sets",
                                expert_bits)},
        {"projection",
         "slices of a < b layers: per layer = (t_b - t_a) / (b - a), head = t_a - a x per layer, 45 layers = head + "
         "45 x per layer (prefill: the "
         "best of MOESRV_BENCH_PREFILL_RUNS runs, default 2); "
         "budgets: the 45-layer plan at the largest context, its first layers' homes on the slice"},
        {"bandwidth_gbps",
         {{"device_copy", bw.device_copy},
          {"pcie_h2d", bw.pcie_h2d},
          {"host", bw.host},
          {"host_and_pcie", bw.host_and_pcie}}},
        {"results", results},
        {"concurrency", concurrency}};
    std::ofstream(path) << j.dump(2) << "\n";
  }
}

#endif

}  // namespace
}  // namespace moesrv
