#include "bench/measure.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>

#include "backend/cuda/cuda_engine.h"
#include "bench/common.h"
#include "runtime/cuda_placement.h"

namespace moesrv::bench {

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
  struct Variant {
    std::string name;
    std::function<ExpertPlacement(size_t)> home;
  };
  std::vector<Variant> variants = {{"all-in-VRAM", [](size_t) { return ExpertPlacement::Vram; }},
                                   {"hybrid (full plan's layer homes)",
                                    [&](size_t e) { return engine_placement(tmpl->home[e % tmpl->home.size()]); }},
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

}  // namespace moesrv::bench
