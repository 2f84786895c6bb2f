// EXL3 at synthetic shapes: the planner's package footprint (CPU), and GLM-5-width bf16 vs EXL3 throughput on
// the CUDA engine (opt-in benchmark; skipped without CUDA or a device).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <map>
#include <vector>

#include "backend/cuda/cuda_engine.h"
#include "format/exl3_convert.h"
#include "model/synthetic_model.h"
#include "runtime/placement.h"

namespace moesrv {
namespace {

// A synthetic model with every 128-aligned projection the converter would take replaced by random K-bit MUL1
// trellis (any bit pattern is a valid stream; suh = ±1, svh = ±0.02 give the bf16 model's weight scale). Tensors
// of one shape share one random trellis.
std::shared_ptr<ModelPackage> synthetic_exl3(std::shared_ptr<ModelPackage> bf, int K) {
  struct Store {
    std::shared_ptr<ModelPackage> base;
    std::deque<std::vector<uint16_t>> bufs;
    std::map<std::pair<int64_t, int64_t>, size_t> by_shape;  // (out, in) -> first of trellis, suh, svh
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
    auto [it, fresh] = st->by_shape.emplace(std::make_pair(out, in), st->bufs.size());
    if (fresh) {
      auto& tr = st->bufs.emplace_back(size_t(in * out * K / 16));
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
    view(p + ".trellis", DType::I16, {in / 16, out / 16, 16 * K}, b[0].data(), b[0].size() * 2);
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
  const ModelConfig c = ModelConfig::from_json(cfg);
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

int32_t argmax(const float* v, int64_t n) { return int32_t(std::max_element(v, v + n) - v); }

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
  auto secs = [](auto a) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count(); };
  for (int variant = 0; variant < 2; ++variant) {
    CudaEngineOptions opt;
    opt.max_ctx = 4096;
    opt.prefill_chunk = 2048;
    auto t0 = std::chrono::steady_clock::now();
    CudaEngine e(variant == 0 ? bf : synthetic_exl3(bf, 4), opt);
    const double load = secs(t0);
    auto seq = e.new_sequence();
    std::vector<int32_t> prompt(2048);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t((i * 7919) % 150000);
    e.forward(*seq, std::vector<int32_t>(prompt.begin(), prompt.begin() + 64));  // warm-up
    seq->truncate(0);
    t0 = std::chrono::steady_clock::now();
    auto l = e.forward(*seq, prompt);
    const double prefill = secs(t0);
    for (int i = 0; i < 4; ++i) l = e.forward(*seq, {argmax(l.data(), e.vocab_size())});
    t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 64; ++i) l = e.forward(*seq, {argmax(l.data(), e.vocab_size())});
    const double decode = secs(t0) / 64;
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
// uploaded as its own block), all in VRAM: slices of 4 and 8 layers (i % 4 == 3 MLA with the k-pool indexer, the
// rest KDA; all MoE; mHC 4 streams). The difference of the two slices is the time of 4 layers (3 KDA + 1 MLA, the
// full model's 34:11 mix within 3%); the rest of the 4-layer slice is the embedding + head. Projection to 45 layers:
// head + 45/4 x (4 layers). Decode after prefills of 8K and 32K tokens; the floor is the bytes a decode step must
// read (head, 45/4 x the dense weights + 8 routed experts of the 4 layers, the recurrent state read and written,
// the MLA latent rows the indexer selects and its pooled keys) over the measured device copy bandwidth.
// Opt-in: MOESRV_CUDA_BENCH=1; MOESRV_BENCH_JSON=<file> writes the results (docs/perf/glm5-next-h200.json format).
TEST(CudaExl3SyntheticGlm5Next, Throughput) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA backend or device";
  if (!std::getenv("MOESRV_CUDA_BENCH")) GTEST_SKIP() << "set MOESRV_CUDA_BENCH=1";
  auto secs = [](auto a) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count(); };
  // Device copy bandwidth (read + write), 1 GiB.
  double copy_gbps = 0;
  {
    const size_t n = size_t(1) << 30;
    void *a = nullptr, *b = nullptr;
    ASSERT_EQ(cudaMalloc(&a, n), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&b, n), cudaSuccess);
    cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
    copy_gbps = 2.0 * 10 * double(n) / secs(t0) / 1e9;
    cudaFree(a);
    cudaFree(b);
  }
  const std::vector<int64_t> contexts = {8192, 32768};
  std::map<int, std::vector<std::pair<double, double>>> t;  // layers -> per context (prefill s, decode s/token)
  double floor_bytes_4 = 0, head_bytes = 0;                 // decode bytes of the first 4 layers, of the head
  ModelConfig c4;
  for (int layers : {4, 8}) {
    SyntheticOptions so;
    so.distinct_experts = 8;
    auto cfg = glm5_next_config(layers);
    auto q = synthetic_exl3(make_synthetic_model(cfg, so), 4);
    if (layers == 4) {
      c4 = ModelConfig::from_json(cfg);
      const ModelFootprint fp = footprint_from_package(c4, *q);
      head_bytes = double(fp.head_bytes);
      for (int64_t l = 0; l < 4; ++l)
        floor_bytes_4 +=
            double(fp.dense_bytes[size_t(l)] + uint64_t(c4.experts_per_token) * fp.expert_bytes[size_t(l)]);
    }
    CudaEngineOptions opt;
    opt.max_ctx = contexts.back() + 64;
    opt.prefill_chunk = 8192;
    auto t0 = std::chrono::steady_clock::now();
    CudaEngine e(q, opt);
    const double load = secs(t0);
    for (int64_t ctx : contexts) {
      auto seq = e.new_sequence();
      std::vector<int32_t> prompt(static_cast<size_t>(ctx));
      for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t((i * 7919) % 150000);
      t0 = std::chrono::steady_clock::now();
      auto l = e.forward(*seq, prompt);
      const double prefill = secs(t0);
      for (int i = 0; i < 4; ++i) l = e.forward(*seq, {argmax(l.data(), e.vocab_size())});  // capture + warm
      t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 32; ++i) l = e.forward(*seq, {argmax(l.data(), e.vocab_size())});
      const double decode = secs(t0) / 32;
      t[layers].push_back({prefill, decode});
      const auto st = e.stats();
      std::printf(
          "[ perf ] glm5_next %d layers EXL3 K=4, ctx %ld: load %.1f s, weights %.2f GiB (EXL3 %.2f), VRAM "
          "%.2f GiB, prefill %.2f s (%.0f tok/s), decode %.2f ms/token, graph replays %ld\n",
          layers, long(ctx), load, double(st.weight_bytes) / double(1ull << 30),
          double(st.exl3_weight_bytes) / double(1ull << 30), double(st.vram_used) / double(1ull << 30), prefill,
          double(ctx) / prefill, decode * 1e3, long(st.graph_replays));
    }
  }
  nlohmann::json results = nlohmann::json::array();
  const ModelConfig& c = c4;
  for (size_t i = 0; i < contexts.size(); ++i) {
    const auto [p4, d4] = t[4][i];
    const auto [p8, d8] = t[8][i];
    const double pl = (p8 - p4) / 4, dl = (d8 - d4) / 4;  // per layer (mixed)
    const double p45 = p4 - 4 * pl + 45 * pl, d45 = d4 - 4 * dl + 45 * dl;
    // State traffic per decode step of the 4 layers: 3 KDA states read + written (fp32), one MLA layer's selected
    // latent rows (bf16) and pooled indexer keys (fp32).
    const double ctx = double(contexts[i]);
    const double kda = 2.0 * double(c.linear.state_floats()) * 4;
    const double mla = double(c.index_topk + c.index_kpool) * double(c.kv_lora_rank) * 2 +
                       ctx / double(c.index_kpool) * double(c.index_head_dim) * 4;
    const double bytes45 = head_bytes + 45.0 / 4 * (floor_bytes_4 + 3 * kda + mla);
    const double floor_tok_s = copy_gbps * 1e9 / bytes45;
    std::printf(
        "[ perf ] glm5_next projected to 45 layers, ctx %ld: decode %.2f ms/token (%.1f tok/s; %.3f ms per "
        "layer, head+embed %.3f ms), prefill %.1f s (%.0f tok/s); floor %.1f tok/s (%.2f GB/token at %.0f "
        "GB/s copy), %.0f%% of it\n",
        long(contexts[i]), d45 * 1e3, 1.0 / d45, dl * 1e3, (d4 - 4 * dl) * 1e3, p45, ctx / p45, floor_tok_s,
        bytes45 / 1e9, copy_gbps, 100.0 / d45 / floor_tok_s);
    results.push_back({{"vram_budget_gib", "all"},
                       {"routing", "uniform"},
                       {"context", contexts[i]},
                       {"decode_tok_s", 1.0 / d45},
                       {"floor_tok_s", floor_tok_s},
                       {"prefill_tok_s", ctx / p45},
                       {"ttft_s", p45},
                       {"hit_rate", 1.0},
                       {"decode_bytes_per_token", bytes45},
                       {"copy_gbps", copy_gbps}});
  }
  if (const char* path = std::getenv("MOESRV_BENCH_JSON")) {
    nlohmann::json j = {
        {"model", "glm5_next"},
        {"layers_measured", 8},
        {"weights", "EXL3 K=4 (random trellis), 288 experts aliasing 8 host weight sets"},
        {"projection", "per layer = (t8 - t4) / 4, head = t4 - 4 x per layer, 45 layers = head + 45 x per layer"},
        {"results", results}};
    std::ofstream(path) << j.dump(2) << "\n";
  }
}

#endif

}  // namespace
}  // namespace moesrv
