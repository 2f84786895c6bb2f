#include "bench/bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <thread>

#include "backend/cpu/cpu_engine.h"
#include "backend/cuda/cuda_engine.h"
#include "backend/usage_stats.h"
#include "model/state.h"
#include "runtime/cpu_expert_pool.h"
#include "runtime/placement.h"
#include "util/error.h"
#include "util/thread_pool.h"

namespace moesrv {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

template <typename F>
double best_of(int reps, F&& f) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    f();
    best = std::min(best, since(t0));
  }
  return best;
}

// Host-side calibration: what the CPU path actually achieves on this machine.
struct Calibration {
  double memcpy_gbps = 0;
  double expert_1tok_s = 0, expert_gemv_gbps = 0;  // one routed expert, one token
  int64_t gemm_tokens = 0;
  double expert_gemm_s = 0, cpu_gflops = 0;  // one routed expert, gemm_tokens tokens
  double head_s = 0;                         // lm_head for one row
};

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

struct Measured {
  int64_t context = 0;
  double ttft_s = 0, decode_s = 0;  // decode: seconds per token
};

std::vector<int32_t> prompt_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (auto& v : t) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v = int32_t((s >> 33) % uint64_t(vocab));
  }
  return t;
}

Measured measure_engine(Engine& engine, int64_t context, int64_t decode_tokens) {
  Measured m;
  m.context = context;
  auto seq = engine.new_sequence();
  auto prompt = prompt_tokens(context, engine.vocab_size(), uint64_t(context));
  auto t0 = Clock::now();
  auto logits = engine.forward(*seq, prompt);
  m.ttft_s = since(t0);
  t0 = Clock::now();
  for (int64_t i = 0; i < decode_tokens; ++i) {
    int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    logits = engine.forward(*seq, {next});
  }
  m.decode_s = decode_tokens > 0 ? since(t0) / double(decode_tokens) : 0;
  return m;
}

// The config of the projected model: `full_layers` layers, the first `dense` of them dense.
json full_config(json cfg, const BenchOptions& opt) {
  if (opt.full_layers > 0) {
    cfg["num_hidden_layers"] = opt.full_layers;
    cfg.erase("mlp_layer_types");
    cfg.erase("indexer_types");
    cfg.erase("layer_types");
  }
  if (opt.full_dense_layers >= 0) {
    cfg.erase("mlp_layer_types");
    cfg["first_k_dense_replace"] = opt.full_dense_layers;
  }
  return cfg;
}

// Skewed synthetic routing (Zipf exponent s, a different random hot set per layer) to model real traffic.
UsageStats zipf_usage(const ModelSpec& c, double s, uint64_t seed) {
  UsageStats u(c.num_layers, c.n_routed_experts, c.experts_per_token);
  const int64_t E = c.n_routed_experts;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    std::vector<int32_t> perm(static_cast<size_t>(E));
    for (int32_t e = 0; e < E; ++e) perm[size_t(e)] = e;
    uint64_t r = seed ^ (uint64_t(l) * 0x9e3779b97f4a7c15ull);
    for (int64_t i = E - 1; i > 0; --i) {
      r = r * 6364136223846793005ull + 1442695040888963407ull;
      std::swap(perm[size_t(i)], perm[size_t((r >> 33) % uint64_t(i + 1))]);
    }
    // Expected counts over 10^4 tokens, scaled so each token selects k experts.
    double norm = 0;
    for (int64_t i = 0; i < E; ++i) norm += std::pow(double(i + 1), -s);
    std::vector<int32_t> ids;
    for (int64_t i = 0; i < E; ++i) {
      int64_t n = int64_t(std::llround(1e4 * double(c.experts_per_token) * std::pow(double(i + 1), -s) / norm));
      ids.assign(size_t(std::min<int64_t>(n, 10000)), perm[size_t(i)]);
      if (!ids.empty()) u.record(l, ids);
    }
  }
  // record() counted one "token" per call; reset token totals to the 10^4 modelled tokens.
  json j = u.to_json();
  for (auto& L : j["layers"]) L["tokens"] = 1e4;
  return UsageStats::from_json(j);
}

struct Projection {
  std::string placement;
  int64_t context = 0;
  PlacementPlan decode_plan;
  double ttft_s = 0, decode_s = 0, floor_s = 0, hit_rate = 0;
};

double floor_seconds(const StepEstimate& e, const CostModel& m) {
  return std::max(
      {e.hbm_bytes / (m.hbm_gbps * 1e9), e.pcie_bytes / (m.pcie_gbps * 1e9), e.host_bytes / (m.host_mem_gbps * 1e9)});
}

Projection project(const std::string& name, const ModelSpec& c, const ModelFootprint& fp, PlacementRequest req,
                   int64_t context, int64_t chunk, const UsageStats* usage) {
  Projection p;
  p.placement = name;
  p.context = context;
  req.context = context;
  req.step_tokens = 1;
  p.decode_plan = plan_placement(c, fp, req, usage);
  StepEstimate d = estimate_step(c, fp, p.decode_plan, req.cost, 1, context, usage);
  p.decode_s = d.seconds;
  p.floor_s = floor_seconds(d, req.cost);
  req.step_tokens = chunk;
  PlacementPlan prefill = plan_placement(c, fp, req, usage);
  for (int64_t done = 0; done < context; done += chunk) {
    int64_t n = std::min(chunk, context - done);
    p.ttft_s += estimate_step(c, fp, prefill, req.cost, n, done + n, usage).seconds;
  }
  double hits = 0;
  int64_t moe = 0;
  for (const auto& L : p.decode_plan.layers)
    if (!L.home.empty()) hits += L.hit_rate, ++moe;
  p.hit_rate = moe ? hits / double(moe) : 1;
  return p;
}

std::string fmt_rate(double per_s) {
  return per_s >= 100 ? fmt::format("{:.0f}", per_s) : fmt::format("{:.2f}", per_s);
}

// GPU measurement (CUDA builds with a visible device): the same engine runs under three expert placements on
// the loaded layers. The hybrid one copies the per-layer homes of the full model's hybrid plan, so each measured
// layer sees the VRAM share it would get in the full model.
void measure_gpu(const BenchOptions& opt, const std::shared_ptr<ModelPackage>& pkg, const ModelSpec& c,
                 const PlacementPlan& full_hybrid, const ModelFootprint& fp, BenchResult& r) {
#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
  if (!cuda_available()) return;
  const LayerPlacement* tmpl = nullptr;
  for (const auto& L : full_hybrid.layers)
    if (!L.home.empty()) {
      tmpl = &L;
      break;
    }
  if (!tmpl) return;
  auto map_home = [](ExpertHome h) {
    return h == ExpertHome::Pinned ? ExpertPlacement::Vram
           : h == ExpertHome::Cpu  ? ExpertPlacement::Cpu
                                   : ExpertPlacement::Cache;
  };
  struct Variant {
    std::string name;
    std::function<ExpertPlacement(size_t)> home;
  };
  std::vector<Variant> variants = {
      {"all-in-VRAM", [](size_t) { return ExpertPlacement::Vram; }},
      {"hybrid (full plan's layer homes)", [&](size_t e) { return map_home(tmpl->home[e % tmpl->home.size()]); }},
      {"baseline: GPU dense, CPU experts", [](size_t) { return ExpertPlacement::Cpu; }}};
  const int64_t full_layers = opt.full_layers > 0 ? opt.full_layers : c.num_layers;
  const double head_s = double(fp.head_bytes) / (opt.hbm_gbps * 1e9);  // lm_head on the GPU, bandwidth-bound
  auto full = [&](double t) { return head_s + std::max(0.0, t - head_s) / double(c.num_layers) * double(full_layers); };
  std::string& md = r.markdown;
  md += fmt::format(
      "\n**Measured on the GPU** (CUDA engine, {} layer(s); full = step time x {} layers, "
      "pessimistic as it also scales fixed per-step costs; ratios are of the measured steps; hybrid "
      "layer: {} pinned, {} LRU slots, {} fetch, {} CPU experts)\n\n",
      c.num_layers, full_layers, tmpl->pinned, tmpl->slots - tmpl->pinned, tmpl->count(ExpertHome::Fetch),
      tmpl->count(ExpertHome::Cpu));
  md +=
      "| context | placement | TTFT s | prefill tok/s | decode tok/s | full TTFT s | full decode tok/s | decode vs "
      "baseline |\n";
  md += "|---:|---|---:|---:|---:|---:|---:|---:|\n";
  std::vector<std::vector<Measured>> runs;
  for (const Variant& v : variants) {
    CudaEngineOptions co;
    co.served_name = "bench";
    co.max_ctx = *std::max_element(opt.contexts.begin(), opt.contexts.end()) + opt.decode_tokens + 16;
    co.cache_slots = int(std::max<int64_t>(1, tmpl->slots - tmpl->pinned));
    co.placement.assign(size_t(c.num_layers), {});
    for (int64_t l = 0; l < c.num_layers; ++l)
      if (c.layer_is_moe[size_t(l)])
        for (int64_t e = 0; e < c.n_routed_experts; ++e) co.placement[size_t(l)].push_back(v.home(size_t(e)));
    auto engine = make_cuda_engine(pkg, co);
    std::vector<Measured> ms;
    for (int64_t ctx : opt.contexts) ms.push_back(measure_engine(*engine, ctx, opt.decode_tokens));
    runs.push_back(std::move(ms));
  }
  nlohmann::json gj = nlohmann::json::array();
  for (size_t ci = 0; ci < opt.contexts.size(); ++ci)
    for (size_t vi = 0; vi < variants.size(); ++vi) {
      const Measured& m = runs[vi][ci];
      // Ratios of the measured step times: extrapolation would also scale fixed per-step costs.
      const double ratio = runs.back()[ci].decode_s / m.decode_s, mine = full(m.decode_s);
      md += fmt::format("| {} | {} | {:.3f} | {} | {} | {:.2f} | {} | {:.2f}x |\n", m.context, variants[vi].name,
                        m.ttft_s, fmt_rate(double(m.context) / m.ttft_s), fmt_rate(1 / m.decode_s), full(m.ttft_s),
                        fmt_rate(1 / mine), ratio);
      gj.push_back({{"context", m.context},
                    {"placement", variants[vi].name},
                    {"ttft_s", m.ttft_s},
                    {"decode_tps", 1 / m.decode_s},
                    {"full_ttft_s", full(m.ttft_s)},
                    {"full_decode_tps", 1 / mine},
                    {"decode_vs_baseline", ratio}});
    }
  r.json["measured_gpu"] = gj;
#else
  (void)opt, (void)pkg, (void)c, (void)full_hybrid, (void)fp, (void)r;
#endif
}

}  // namespace

double measure_memcpy_gbps(size_t bytes, int reps) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  constexpr int64_t kChunk = 1 << 20;  // every core copies a share, as the GEMV kernels read
  const int64_t chunks = int64_t(bytes) / kChunk;
  double t = best_of(reps, [&] {
    ThreadPool::global().parallel_for(chunks, [&](int64_t c0, int64_t c1) {
      std::memcpy(b.data() + c0 * kChunk, a.data() + c0 * kChunk, size_t((c1 - c0) * kChunk));
    });
  });
  return double(chunks * kChunk) / t / 1e9;
}

BenchResult run_bench(const BenchOptions& opt) {
  auto t_load = Clock::now();
  std::shared_ptr<ModelPackage> pkg;
  std::string model_name;
  if (opt.model_dir.empty()) {
    json cfg = opt.synthetic_config.is_null() ? glm5_config(1) : opt.synthetic_config;
    pkg = make_synthetic_model(cfg, opt.synthetic);
    model_name = fmt::format("synthetic {} ({} layer(s), hidden {})", cfg.value("model_type", "?"),
                             cfg.value("num_hidden_layers", 0), cfg.value("hidden_size", 0));
  } else {
    pkg = ModelPackage::open(opt.model_dir);
    model_name = std::filesystem::path(opt.model_dir).filename().string();
  }
  // The CPU engine always runs (calibration, baseline); CUDA builds add measure_gpu() below.
  CpuEngine engine(pkg, "bench");
  const double load_s = since(t_load);
  const ModelSpec& c = engine.config();
  const ModelFootprint fp = footprint_from_weights(engine.weights());
  const Calibration cal = calibrate(engine.weights(), fp);

  // Measured: the engine end to end, then per-layer costs extrapolated to the full layer count.
  const int64_t full_layers = opt.full_layers > 0 ? opt.full_layers : c.num_layers;
  std::vector<Measured> measured;
  if (opt.measure_engine)
    for (int64_t ctx : opt.contexts) measured.push_back(measure_engine(engine, ctx, opt.decode_tokens));
  // The host's best measured streaming rate: memcpy over all cores, or the expert GEMV if it reads faster.
  const double host_gbps = std::max(cal.memcpy_gbps, cal.expert_gemv_gbps);
  auto extrapolate = [&](double total, double head) {
    return head + std::max(0.0, total - head) / double(c.num_layers) * double(full_layers);
  };
  // Physical floor of the CPU decode: every byte a token touches, read once at memcpy speed.
  auto cpu_decode_bytes = [&](int64_t ctx, int64_t layers) {
    double b = double(fp.head_bytes), per_layer = 0;
    const std::vector<StateSpec> states = state_specs(c);
    for (int64_t l = 0; l < c.num_layers; ++l) {
      per_layer += double(fp.dense_bytes[size_t(l)]) + double(c.experts_per_token) * double(fp.expert_bytes[size_t(l)]);
      per_layer += double(step_state_bytes(c, states[size_t(l)], ctx, 4));  // the CPU engine's fp32 caches
    }
    return b + per_layer / double(c.num_layers) * double(layers);
  };

  // Projected: the full model under three placements, cost model calibrated by this run.
  const json full_cfg_json = full_config(pkg->config(), opt);
  const ModelSpec fc = ModelSpec::from_json(full_cfg_json);
  int64_t moe_layer = 0;
  while (moe_layer < c.num_layers && !c.layer_is_moe[size_t(moe_layer)]) ++moe_layer;
  double loaded_expert_bits =
      moe_layer < c.num_layers && fp.expert_params[size_t(moe_layer)] > 0
          ? 8.0 * double(fp.expert_bytes[size_t(moe_layer)]) / fp.expert_params[size_t(moe_layer)]
          : 16;
  const double expert_bits = opt.expert_bits > 0 ? opt.expert_bits : loaded_expert_bits;
  const double dense_bits = opt.dense_bits > 0 ? opt.dense_bits : 16;
  const ModelFootprint ffp = footprint_from_config(fc, expert_bits, dense_bits);
  std::optional<UsageStats> usage;
  std::string usage_source = "uniform routing";
  if (!opt.usage_path.empty()) {
    usage = UsageStats::load(opt.usage_path, fc.num_layers, fc.n_routed_experts);
    if (!usage)
      fail("{}: no usable expert usage for {} layers x {} experts", opt.usage_path, fc.num_layers, fc.n_routed_experts);
    usage_source = opt.usage_path;
  } else if (opt.usage_zipf > 0) {
    usage = zipf_usage(fc, opt.usage_zipf, opt.synthetic.seed);
    usage_source = fmt::format("synthetic Zipf s={}", opt.usage_zipf);
  } else if (!opt.model_dir.empty()) {
    usage = UsageStats::load(UsageStats::default_path(opt.model_dir), fc.num_layers, fc.n_routed_experts);
    if (usage) usage_source = UsageStats::default_path(opt.model_dir);
  }
  const UsageStats* up = usage ? &*usage : nullptr;
  PlacementRequest base;
  base.workspace_bytes = uint64_t(opt.workspace_gib * double(kGiB));
  base.kv_elem_bytes = base.index_elem_bytes = opt.kv_elem_bytes;
  base.cost.hbm_gbps = opt.hbm_gbps;
  base.cost.pcie_gbps = opt.pcie_gbps;
  base.cost.gpu_tflops = opt.gpu_tflops;
  base.cost.host_mem_gbps = opt.host_mem_gbps > 0 ? opt.host_mem_gbps : cal.expert_gemv_gbps;
  base.cost.cpu_gflops = opt.cpu_gflops > 0 ? opt.cpu_gflops : cal.cpu_gflops;
  base.slot_policy = up ? SlotPolicy::Entropy : SlotPolicy::Equal;
  std::vector<Projection> proj;
  for (int64_t ctx : opt.model_contexts) {
    PlacementRequest all = base, hybrid = base, cpu_experts = base;
    all.vram_budget = uint64_t(1) << 62;
    hybrid.vram_budget = uint64_t(opt.vram_budget_gib * double(kGiB));
    cpu_experts.vram_budget = ffp.dense_total() + kv_cache_bytes(fc, ctx, opt.kv_elem_bytes, opt.kv_elem_bytes) +
                              base.workspace_bytes;  // no expert slots
    proj.push_back(project("all-in-VRAM", fc, ffp, all, ctx, opt.prefill_chunk, up));
    proj.push_back(
        project(fmt::format("hybrid {:g} GiB", opt.vram_budget_gib), fc, ffp, hybrid, ctx, opt.prefill_chunk, up));
    proj.push_back(project("baseline: GPU dense, CPU experts", fc, ffp, cpu_experts, ctx, opt.prefill_chunk, up));
  }

  // Report.
  BenchResult r;
  json& j = r.json;
  j["model"] = model_name;
  j["layers_measured"] = c.num_layers;
  j["full_layers"] = full_layers;
  j["load_s"] = load_s;
  j["calibration"] = {{"memcpy_gbps", cal.memcpy_gbps},
                      {"expert_bytes", fp.expert_bytes[size_t(std::min(moe_layer, c.num_layers - 1))]},
                      {"expert_1tok_s", cal.expert_1tok_s},
                      {"expert_gemv_gbps", cal.expert_gemv_gbps},
                      {"gemm_tokens", cal.gemm_tokens},
                      {"expert_gemm_s", cal.expert_gemm_s},
                      {"cpu_gflops", cal.cpu_gflops},
                      {"lm_head_s", cal.head_s}};
  j["cost_model"] = base.cost.to_json();
  j["projection"] = {{"expert_bits", expert_bits},
                     {"dense_bits", dense_bits},
                     {"usage", usage_source},
                     {"dense_gib", double(ffp.dense_total()) / kGiB},
                     {"experts_gib", double(ffp.experts_total(fc)) / kGiB}};
  std::string& md = r.markdown;
  md += fmt::format("### moesrv bench: {}\n\n", model_name);
  md += fmt::format(
      "Host calibration (measured): memcpy {:.1f} GB/s; one routed expert ({:.1f} MB) on the CPU: {:.3f} ms "
      "for 1 token = {:.1f} GB/s, {:.2f} ms for {} tokens = {:.0f} GFLOP/s; lm_head {:.2f} ms/token.\n\n",
      cal.memcpy_gbps, double(j["calibration"]["expert_bytes"].get<uint64_t>()) / 1e6, 1e3 * cal.expert_1tok_s,
      cal.expert_gemv_gbps, 1e3 * cal.expert_gemm_s, cal.gemm_tokens, cal.cpu_gflops, 1e3 * cal.head_s);
  if (!measured.empty()) {
    md += fmt::format(
        "**Measured** (CPU engine, {} layer(s); full = per-layer cost x {} layers + lm_head; floor = bytes a "
        "decode token reads / {:.1f} GB/s, the best host rate measured)\n\n",
        c.num_layers, full_layers, host_gbps);
    md +=
        "| context | TTFT s | prefill tok/s | decode tok/s | full TTFT s | full prefill tok/s | full decode tok/s | "
        "full decode floor tok/s |\n";
    md += "|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    json mj = json::array();
    for (const Measured& m : measured) {
      double full_ttft = extrapolate(m.ttft_s, cal.head_s), full_dec = extrapolate(m.decode_s, cal.head_s);
      double floor_s = cpu_decode_bytes(m.context, full_layers) / (host_gbps * 1e9);
      md += fmt::format("| {} | {:.3f} | {} | {} | {:.2f} | {} | {} | {} |\n", m.context, m.ttft_s,
                        fmt_rate(double(m.context) / m.ttft_s), m.decode_s > 0 ? fmt_rate(1 / m.decode_s) : "-",
                        full_ttft, fmt_rate(double(m.context) / full_ttft), full_dec > 0 ? fmt_rate(1 / full_dec) : "-",
                        fmt_rate(1 / floor_s));
      mj.push_back({{"context", m.context},
                    {"ttft_s", m.ttft_s},
                    {"prefill_tps", double(m.context) / m.ttft_s},
                    {"decode_tps", m.decode_s > 0 ? 1 / m.decode_s : 0.0},
                    {"full_ttft_s", full_ttft},
                    {"full_decode_tps", full_dec > 0 ? 1 / full_dec : 0.0},
                    {"full_decode_floor_tps", 1 / floor_s}});
    }
    j["measured"] = mj;
    md += "\n";
  }
  md += fmt::format(
      "**Projected** (cost model; {} layers, experts {:.2f} bits, dense {:.2f} bits, KV {} byte(s)/element: dense "
      "{:.1f} GiB, experts "
      "{:.1f} GiB; {}; HBM {:g} GB/s, PCIe {:g} GB/s, GPU {:g} TFLOP/s from flags; CPU numbers from the "
      "calibration above; prefill in {}-token chunks; floor = max over HBM/PCIe/host of bytes moved / bandwidth)\n\n",
      fc.num_layers, expert_bits, dense_bits, opt.kv_elem_bytes, double(ffp.dense_total()) / kGiB,
      double(ffp.experts_total(fc)) / kGiB, usage_source, opt.hbm_gbps, opt.pcie_gbps, opt.gpu_tflops,
      opt.prefill_chunk);
  md +=
      "| context | placement | VRAM GiB | VRAM hit rate | TTFT s | prefill tok/s | decode tok/s | decode floor tok/s | "
      "decode vs baseline |\n";
  md += "|---:|---|---:|---:|---:|---:|---:|---:|---:|\n";
  json pj = json::array();
  for (size_t i = 0; i < proj.size(); ++i) {
    const Projection& p = proj[i];
    const Projection& baseline = proj[i - i % 3 + 2];
    const bool fits = p.decode_plan.fits;
    std::string vram = fmt::format("{:.1f}{}", double(p.decode_plan.vram_total()) / kGiB, fits ? "" : " (over budget)");
    md += fmt::format("| {} | {} | {} | {:.1f}% | {:.1f} | {} | {} | {} | {:.2f}x |\n", p.context, p.placement, vram,
                      100 * p.hit_rate, p.ttft_s, fmt_rate(double(p.context) / p.ttft_s), fmt_rate(1 / p.decode_s),
                      fmt_rate(1 / p.floor_s), baseline.decode_s / p.decode_s);
    pj.push_back({{"context", p.context},
                  {"placement", p.placement},
                  {"fits", fits},
                  {"note", p.decode_plan.note},
                  {"vram_bytes", p.decode_plan.vram_total()},
                  {"hit_rate", p.hit_rate},
                  {"ttft_s", p.ttft_s},
                  {"prefill_tps", double(p.context) / p.ttft_s},
                  {"decode_tps", 1 / p.decode_s},
                  {"decode_floor_tps", 1 / p.floor_s},
                  {"decode_vs_baseline", baseline.decode_s / p.decode_s}});
  }
  j["projected"] = pj;
  if (opt.measure_engine && !proj.empty()) measure_gpu(opt, pkg, c, proj[1].decode_plan, fp, r);
  for (const Projection& p : proj)
    if (p.placement.rfind("hybrid", 0) == 0) {
      j["hybrid_plan"] = p.decode_plan.to_json();
      j["hybrid_plan_summary"] = p.decode_plan.summary();
      break;
    }
  return r;
}

// ---- run_cpu_layer_bench ----

namespace {

const char* mixer_name(Mixer m) {
  switch (m) {
    case Mixer::Mla: return "MLA";
    case Mixer::Gqa: return "GQA";
    case Mixer::Kda: return "KDA";
    case Mixer::GatedDelta: return "GatedDeltaNet";
  }
  return "?";
}

std::string layer_kind(const LayerSpec& L) {
  return std::string(mixer_name(L.mixer)) + (L.ffn == FfnKind::Moe ? "+MoE" : "+dense");
}

struct StepTimes {
  std::vector<double> layer_s;  // per layer
  double embed_s = 0, head_s = 0;
  double total() const {
    double t = embed_s + head_s;
    for (double x : layer_s) t += x;
    return t;
  }
  void add(const StepTimes& o) {
    layer_s.resize(o.layer_s.size(), 0.0);
    for (size_t i = 0; i < o.layer_s.size(); ++i) layer_s[i] += o.layer_s[i];
    embed_s += o.embed_s;
    head_s += o.head_s;
  }
};

// CpuEngine::forward through its public steps (embed, forward_layers one layer at a time, logits of the last row),
// with the same checkpoint cuts and checkpoints, timing each step.
std::vector<float> timed_forward(CpuEngine& engine, CpuSequence& seq, const std::vector<int32_t>& tokens,
                                 StepTimes& t) {
  const ModelSpec& c = engine.config();
  const int64_t S = int64_t(tokens.size()), pos0 = seq.length(), W = c.stream_width();
  t.layer_s.resize(size_t(c.num_layers), 0.0);
  std::vector<float> out;
  for (int64_t done = 0; done < S;) {
    int64_t n = S - done;
    if (c.has_recurrent_layers() && S > 1)
      n = std::min(n, CpuEngine::kCheckpointInterval - (pos0 + done) % CpuEngine::kCheckpointInterval);
    std::vector<int32_t> piece(tokens.begin() + done, tokens.begin() + done + n);
    std::vector<float> x(size_t(n * W));
    auto t0 = Clock::now();
    engine.embed(piece, x.data());
    t.embed_s += since(t0);
    cpu::TokenSelection selection;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      t0 = Clock::now();
      engine.forward_layers(seq, x.data(), n, pos0 + done, l, l + 1, selection);
      t.layer_s[size_t(l)] += since(t0);
    }
    seq.length_ = pos0 + done + n;
    done += n;
    if (S > 1) seq.checkpoint();
    if (done == S) {
      t0 = Clock::now();
      out = engine.logits(x.data(), n, 1);
      t.head_s += since(t0);
    }
  }
  return out;
}

// Grows every per-token buffer of `seq` (MLA latent / rope key, GQA K/V, indexer keys, pooled keys) to `tokens`
// tokens by repeating its rows; fixed-size state (recurrent, conv, open pool) is kept. Needs pool-aligned lengths.
void tile_state(CpuSequence& seq, const ModelSpec& c, int64_t tokens) {
  const int64_t t0 = seq.length(), pool = std::max<int64_t>(1, c.index_kpool);
  if (t0 <= 0 || tokens < t0 || t0 % pool || tokens % pool)
    fail("tile_state: {} -> {} tokens (pool {})", t0, tokens, pool);
  auto tile = [](std::vector<float>& v, int64_t rows0, int64_t rows) {
    if (v.empty()) return;
    const size_t width = v.size() / size_t(rows0);
    v.resize(size_t(rows) * width);
    for (int64_t r = rows0; r < rows; ++r)
      std::copy_n(v.begin() + (r % rows0) * int64_t(width), width, v.begin() + r * int64_t(width));
  };
  for (cpu::LayerState& L : seq.layers) {
    for (auto* v : {&L.latent, &L.k_rope, &L.index_k, &L.k, &L.v}) tile(*v, t0, tokens);
    tile(L.pool_k, t0 / pool, tokens / pool);
  }
  seq.length_ = tokens;
}

// Bytes of weights one decode token reads in layer L: every linear the token passes through (MLA: the absorbed
// fp32 w_uk/w_uv instead of kv_b; MoE: the shared expert and experts_per_token routed experts), convs, router, mHC.
double decode_weight_bytes(const LayerWeights& L, const ModelSpec& c) {
  double b = 0;
  auto lin = [&b](const Linear* l) { b += l ? double(l->stored_bytes()) : 0.0; };
  auto mlp = [&](const MlpWeights& m) { lin(m.gate.get()), lin(m.up.get()), lin(m.down.get()); };
  auto floats = [&b](const std::vector<float>& v) { b += 4.0 * double(v.size()); };
  if (L.kda) {
    for (const Linear* l : {L.kda->q.get(), L.kda->k.get(), L.kda->v.get(), L.kda->f_a.get(), L.kda->f_b.get(),
                            L.kda->b.get(), L.kda->g_a.get(), L.kda->g_b.get(), L.kda->o.get()})
      lin(l);
    floats(L.kda->conv);
  }
  if (L.mla) {
    for (const Linear* l : {L.mla->q_a.get(), L.mla->q_b.get(), L.mla->q.get(), L.mla->kv_a.get(), L.mla->o.get()})
      lin(l);
    floats(L.mla->w_uk), floats(L.mla->w_uv);
    if (L.mla->indexer) {
      const IndexerWeights& ix = *L.mla->indexer;
      for (const Linear* l : {ix.wq_b.get(), ix.wk.get(), ix.weights_proj.get(), ix.pool_gate.get()}) lin(l);
    }
  }
  if (L.gqa)
    for (const Linear* l : {L.gqa->q.get(), L.gqa->k.get(), L.gqa->v.get(), L.gqa->o.get()}) lin(l);
  if (L.gated_delta)
    for (const Linear* l : {L.gated_delta->qkvz.get(), L.gated_delta->ba.get(), L.gated_delta->out.get()}) lin(l);
  if (L.mlp) mlp(*L.mlp);
  if (L.moe) {
    floats(L.moe->router);
    if (L.moe->shared) mlp(*L.moe->shared);
    for (int64_t e = 0; e < c.experts_per_token && e < int64_t(L.moe->experts.size()); ++e)
      mlp(L.moe->experts[size_t(e)]);
  }
  floats(L.attn_hc.fn), floats(L.ffn_hc.fn);
  return b;
}

double read_loadavg() {
  std::ifstream f("/proc/loadavg");
  double l = -1;
  f >> l;
  return l;
}

double rss_gib() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / (1024.0 * 1024.0);  // kB
  return 0;
}

// The per-layer loop above reproduces CpuEngine::forward (prefill across a checkpoint cut, then decode) exactly.
double self_check() {
  json cfg = tiny_glm5_next_config(4);
  CpuEngine engine(make_synthetic_model(cfg, {3, 0.05f, 0}), "check");
  auto a = engine.new_sequence(), b = engine.new_sequence();
  auto prompt = prompt_tokens(CpuEngine::kCheckpointInterval + 40, engine.vocab_size(), 5);
  StepTimes t;
  auto la = engine.forward(*a, prompt);
  auto lb = timed_forward(engine, engine.own_sequence(*b), prompt, t);
  double diff = 0;
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < la.size(); ++i) diff = std::max(diff, double(std::abs(la[i] - lb[i])));
    const int32_t next = int32_t(std::max_element(la.begin(), la.end()) - la.begin());
    la = engine.forward(*a, {next});
    lb = timed_forward(engine, engine.own_sequence(*b), {next}, t);
  }
  for (size_t i = 0; i < la.size(); ++i) diff = std::max(diff, double(std::abs(la[i] - lb[i])));
  if (la.size() != lb.size() || diff != 0)
    fail("bench self-check: the per-layer loop differs from CpuEngine::forward by {}", diff);
  return diff;
}

json default_layer_bench_config() {
  json c = glm5_next_config(4);
  c["mlp_layer_types"] = {"dense", "sparse", "sparse", "sparse"};
  return c;
}

json default_full_config() {
  json c = glm5_next_config(45);
  std::vector<std::string> mlp(45, "sparse");
  for (int i = 0; i < 3; ++i) mlp[size_t(i)] = "dense";
  c["mlp_layer_types"] = mlp;
  return c;
}

}  // namespace

BenchResult run_cpu_layer_bench(const CpuLayerBenchOptions& opt) {
  const auto t_start = Clock::now();
  const double load_start = read_loadavg();
  BenchResult r;
  json& j = r.json;
  std::string& md = r.markdown;
  if (opt.self_check) j["self_check_max_abs_diff"] = self_check();

  const json cfg = opt.config.is_null() ? default_layer_bench_config() : opt.config;
  const json full_cfg = opt.full_config.is_null() ? default_full_config() : opt.full_config;
  auto t0 = Clock::now();
  CpuEngine engine(make_synthetic_model(cfg, opt.synthetic), "bench");
  const double load_s = since(t0);
  const ModelSpec& c = engine.config();
  const ModelSpec fc = ModelSpec::from_json(full_cfg);
  const int threads = ThreadPool::global().size();

  // Layer kinds: measured layers of each kind, and how many the full model has.
  std::map<std::string, std::vector<int64_t>> kind_layers;
  for (int64_t l = 0; l < c.num_layers; ++l) kind_layers[layer_kind(c.layers[size_t(l)])].push_back(l);
  std::map<std::string, int64_t> full_kinds;
  for (const LayerSpec& L : fc.layers) ++full_kinds[layer_kind(L)];
  for (const auto& [k, n] : full_kinds)
    if (!kind_layers.count(k)) fail("bench: the full model has {} {} layer(s), the measured model none", n, k);
  std::map<std::string, double> kind_bytes;  // weights read per decode token, one layer of the kind
  for (const auto& [k, ls] : kind_layers)
    kind_bytes[k] = decode_weight_bytes(engine.weights().layers[size_t(ls[0])], c);
  const double head_bytes = double(engine.weights().lm_head->stored_bytes());
  const double memcpy_gbps = measure_memcpy_gbps();
  double full_bytes = head_bytes;
  for (const auto& [k, n] : full_kinds) full_bytes += double(n) * kind_bytes.at(k);
  auto per_kind = [&](const StepTimes& t, double div) {
    std::map<std::string, double> m;
    for (const auto& [k, ls] : kind_layers) {
      double s = 0;
      for (int64_t l : ls) s += t.layer_s[size_t(l)];
      m[k] = s / double(ls.size()) / div;
    }
    return m;
  };
  auto full_seconds = [&](const StepTimes& t, double div) {
    double s = (t.embed_s + t.head_s) / div;
    const auto m = per_kind(t, div);
    for (const auto& [k, n] : full_kinds) s += double(n) * m.at(k);
    return s;
  };
  std::vector<std::string> kinds;
  for (const auto& [k, ls] : kind_layers) kinds.push_back(k);
  auto kind_json = [&](const std::map<std::string, double>& m, double scale) {
    json o = json::object();
    for (const auto& [k, v] : m) o[k] = v * scale;
    return o;
  };

  // Prefill (each followed by decode at its context); the longest one's state seeds the extended contexts.
  json pj = json::array(), dj = json::array();
  std::string prefill_rows, decode_rows;
  std::unique_ptr<SequenceState> longest;
  int64_t longest_len = 0;
  auto decode = [&](CpuSequence& seq, std::vector<float> logits, const std::string& state_note) {
    const int64_t ctx = seq.length();
    StepTimes warm, t;
    auto next = [&] { return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()); };
    logits = timed_forward(engine, seq, {next()}, warm);  // first step: not counted
    for (int64_t i = 0; i < opt.decode_tokens; ++i) logits = timed_forward(engine, seq, {next()}, t);
    const double n = double(std::max<int64_t>(1, opt.decode_tokens)), step = t.total() / n, full = full_seconds(t, n);
    const auto m = per_kind(t, n);
    std::string cells;
    for (const std::string& k : kinds) cells += fmt::format(" {:.1f} |", 1e3 * m.at(k));
    decode_rows += fmt::format("| {} | {} | {:.3f} | {} |{} {:.1f} | {:.2f} | {} |\n", ctx, state_note, step,
                               fmt_rate(1 / step), cells, 1e3 * t.head_s / n, full, fmt_rate(1 / full));
    // The engine's state after this context vs model/state.h (fp32 buffers: 4 bytes per element).
    std::map<std::string, std::pair<uint64_t, uint64_t>> state;  // mixer -> (engine bytes, formula bytes) per layer
    for (const StateSpec& st : state_specs(c)) {
      auto& e = state[mixer_name(c.layers[size_t(st.layer)].mixer)];
      e.first = seq.layers[size_t(st.layer)].bytes();
      e.second = st.bytes(seq.length(), 4, 4);
    }
    json sj = json::object();
    for (const auto& [k, v] : state)
      sj[k] = {{"engine_bytes_per_layer", v.first}, {"formula_bytes_per_layer", v.second}};
    json gbps = json::object();
    for (const auto& [kk, v] : m) gbps[kk] = kind_bytes.at(kk) / v / 1e9;
    dj.push_back({{"context", ctx},
                  {"state", state_note},
                  {"seconds_per_token", step},
                  {"decode_tps", 1 / step},
                  {"per_layer_ms", kind_json(m, 1e3)},
                  {"per_layer_weight_gbps", gbps},
                  {"lm_head_ms", 1e3 * t.head_s / n},
                  {"embed_ms", 1e3 * t.embed_s / n},
                  {"full_seconds_per_token", full},
                  {"full_decode_tps", 1 / full},
                  {"state_bytes", sj}});
  };
  for (int64_t S : opt.prefill) {
    auto seq_base = engine.new_sequence();
    CpuSequence& seq = engine.own_sequence(*seq_base);
    StepTimes t;
    auto logits = timed_forward(engine, seq, prompt_tokens(S, c.vocab_size, uint64_t(S)), t);
    const double total = t.total(), full = full_seconds(t, 1);
    const auto m = per_kind(t, 1);
    std::string cells;
    for (const std::string& k : kinds) cells += fmt::format(" {:.2f} |", m.at(k));
    prefill_rows += fmt::format("| {} | {:.2f} | {} |{} {:.3f} | {:.1f} | {} |\n", S, total,
                                fmt_rate(double(S) / total), cells, t.head_s, full, fmt_rate(double(S) / full));
    pj.push_back({{"tokens", S},
                  {"seconds", total},
                  {"prefill_tps", double(S) / total},
                  {"per_layer_s", kind_json(m, 1)},
                  {"lm_head_s", t.head_s},
                  {"embed_s", t.embed_s},
                  {"full_seconds", full},
                  {"full_prefill_tps", double(S) / full}});
    if (S >= longest_len) longest = seq.clone(), longest_len = S;
    decode(seq, logits, "prefill");
  }
  for (int64_t ctx : opt.extra_contexts) {
    if (!longest || ctx <= longest_len) continue;
    auto seq_base = longest->clone();
    CpuSequence& seq = engine.own_sequence(*seq_base);
    tile_state(seq, c, ctx);
    std::vector<float> logits(size_t(c.vocab_size), 0.0f);
    decode(seq, logits, fmt::format("tiled from {}", longest_len));
  }

  // Per-sequence state (model/state.h): per layer of each stateful mixer, and the full model.
  std::vector<int64_t> ctxs = {512, 2048, 8192, 32768, 131072, fc.max_position};
  std::map<std::string, const StateSpec*> rep;
  const auto specs = state_specs(fc);
  std::map<std::string, int64_t> full_mixers;
  for (const StateSpec& st : specs) {
    const std::string k = mixer_name(fc.layers[size_t(st.layer)].mixer);
    if (!rep.count(k)) rep[k] = &st;
    ++full_mixers[k];
  }
  json stj = {{"kv_bytes_cpu", 4}, {"fixed_bytes", 4}, {"contexts", ctxs}};
  md += fmt::format("### moesrv CPU bench: synthetic {} at real width, {} layer(s) measured\n\n",
                    cfg.value("model_type", "?"), c.num_layers);
  std::string layer_list;
  for (int64_t l = 0; l < c.num_layers; ++l)
    layer_list += fmt::format("{}{}", l ? ", " : "", layer_kind(c.layers[size_t(l)]));
  std::string full_list;
  for (const auto& [k, n] : full_kinds) full_list += fmt::format("{}{} x {}", full_list.empty() ? "" : ", ", n, k);
  md += fmt::format(
      "Measured layers: {} (hidden {}, vocab {}, {} routed experts top-{} with {} distinct weight sets, "
      "bf16 weights, fp32 activations and state). {} thread(s) ({} hardware); load average {:.1f} at "
      "start; model built in {:.1f} s, resident {:.1f} GiB.\n\n",
      layer_list, c.hidden_size, c.vocab_size, c.n_routed_experts, c.experts_per_token, opt.synthetic.distinct_experts,
      threads, std::thread::hardware_concurrency(), load_start, load_s, rss_gib());
  md += fmt::format(
      "Full model (projection): {} layers = {}; full = embed + lm_head + sum over kinds of (layers of that "
      "kind x measured seconds per layer of that kind).\n\n",
      fc.num_layers, full_list);
  std::string kind_hdr, kind_sep;
  for (const std::string& k : kinds) kind_hdr += " " + k + " |", kind_sep += "---:|";
  md += "**Prefill** (seconds per layer of each kind)\n\n";
  md += "| tokens | s | tok/s |" + kind_hdr + " lm_head s | full model s | full tok/s |\n";
  md += "|---:|---:|---:|" + kind_sep + "---:|---:|---:|\n" + prefill_rows + "\n";
  md += fmt::format("**Decode** (mean of {} steps after one warm-up step; ms per layer of each kind)\n\n",
                    opt.decode_tokens);
  md += "| context | state | s/token | tok/s |" + kind_hdr + " lm_head ms | full s/token | full tok/s |\n";
  md += "|---:|---|---:|---:|" + kind_sep + "---:|---:|---:|\n" + decode_rows + "\n";
  std::string bytes_list;
  for (const auto& [k, v] : kind_bytes) bytes_list += fmt::format("{} {:.0f} MB, ", k, v / 1e6);
  md += fmt::format(
      "Weights read per decode token: {}lm_head {:.0f} MB; full model {:.1f} GB per token, i.e. a floor of "
      "{:.2f} s/token at the {:.1f} GB/s memcpy rate measured here (decode reads weights at the rates in "
      "the JSON, per_layer_weight_gbps).\n\n",
      bytes_list, head_bytes / 1e6, full_bytes / 1e9, full_bytes / (memcpy_gbps * 1e9), memcpy_gbps);
  md += "**Per-sequence state** (model/state.h; CPU engine: fp32, 4 bytes per element; MiB)\n\n| layer |";
  for (int64_t x : ctxs) md += fmt::format(" {} |", x);
  md += "\n|---|";
  for (size_t i = 0; i < ctxs.size(); ++i) md += "---:|";
  md += "\n";
  json per_layer = json::object(), full = json::array();
  for (const auto& [k, st] : rep) {
    md += fmt::format("| one {} layer |", k);
    json b = json::array();
    for (int64_t x : ctxs) {
      const uint64_t bytes = st->bytes(x, 4, 4);
      b.push_back(bytes);
      md += fmt::format(" {:.2f} |", double(bytes) / double(1 << 20));
    }
    md += "\n";
    per_layer[k] = {{"layers_in_full_model", full_mixers[k]}, {"bytes", b}, {"recurrent", st->recurrent}};
  }
  for (int kvb : {4, 2}) {
    md += fmt::format("| full model ({} B/elem growing) |", kvb);
    json b = json::array();
    for (int64_t x : ctxs) {
      const uint64_t bytes = state_bytes(fc, x, kvb, 4);
      b.push_back(bytes);
      md += fmt::format(" {:.1f} |", double(bytes) / double(1 << 20));
    }
    md += "\n";
    full.push_back({{"kv_bytes", kvb}, {"bytes", b}});
  }
  stj["per_layer"] = per_layer;
  stj["full_model"] = full;

  j["model"] = fmt::format("synthetic {} ({} layers measured)", cfg.value("model_type", "?"), c.num_layers);
  j["layers"] = json::array();
  for (int64_t l = 0; l < c.num_layers; ++l) j["layers"].push_back(layer_kind(c.layers[size_t(l)]));
  j["full_model"] = {{"layers", fc.num_layers}, {"kinds", full_kinds}};
  j["threads"] = threads;
  j["hardware_threads"] = std::thread::hardware_concurrency();
  j["distinct_experts"] = opt.synthetic.distinct_experts;
  j["vocab"] = c.vocab_size;
  j["load_s"] = load_s;
  j["rss_gib"] = rss_gib();
  j["memcpy_gbps"] = memcpy_gbps;
  j["decode_weight_bytes_per_layer"] = kind_bytes;
  j["decode_weight_bytes_lm_head"] = head_bytes;
  j["decode_weight_bytes_full_model"] = full_bytes;
  j["prefill"] = pj;
  j["decode"] = dj;
  j["state"] = stj;
  j["loadavg_start"] = load_start;
  j["loadavg_end"] = read_loadavg();
  j["wall_s"] = since(t_start);
  md +=
      fmt::format("\nWall time {:.0f} s; load average {:.1f} -> {:.1f}.\n", since(t_start), load_start, read_loadavg());
  return r;
}

}  // namespace moesrv
