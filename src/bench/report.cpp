#include "bench/report.h"

#include <fmt/format.h>

#include <algorithm>

#include "bench/common.h"
#include "model/state.h"

namespace moesrv::bench {

using json = nlohmann::json;

BenchResult report_bench(const BenchOptions& opt, const BenchFacts& f) {
  const ModelSpec& c = f.loaded;
  const ModelFootprint& fp = f.footprint;
  const Calibration& cal = f.cal;
  const ProjectionSet& ps = f.projection;
  const ModelSpec& fc = ps.model;
  const ModelFootprint& ffp = ps.footprint;
  const std::vector<Projection>& proj = ps.rows;
  const int64_t full_layers = opt.full_layers > 0 ? opt.full_layers : c.num_layers;
  const int64_t moe_layer = first_moe_layer(c);
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

  BenchResult r;
  json& j = r.json;
  j["model"] = f.model_name;
  j["layers_measured"] = c.num_layers;
  j["full_layers"] = full_layers;
  j["load_s"] = f.load_s;
  j["calibration"] = {{"memcpy_gbps", cal.memcpy_gbps},
                      {"expert_bytes", fp.expert_bytes[size_t(std::min(moe_layer, c.num_layers - 1))]},
                      {"expert_1tok_s", cal.expert_1tok_s},
                      {"expert_gemv_gbps", cal.expert_gemv_gbps},
                      {"gemm_tokens", cal.gemm_tokens},
                      {"expert_gemm_s", cal.expert_gemm_s},
                      {"cpu_gflops", cal.cpu_gflops},
                      {"lm_head_s", cal.head_s}};
  j["cost_model"] = ps.cost.to_json();
  j["projection"] = {{"expert_bits", ps.expert_bits},
                     {"dense_bits", ps.dense_bits},
                     {"usage", ps.usage_source},
                     {"dense_gib", double(ffp.dense_total()) / kGiB},
                     {"experts_gib", double(ffp.experts_total(fc)) / kGiB}};
  std::string& md = r.markdown;
  md += fmt::format("### moesrv bench: {}\n\n", f.model_name);
  md += fmt::format(
      "Host calibration (measured): memcpy {:.1f} GB/s; one routed expert ({:.1f} MB) on the CPU: {:.3f} ms "
      "for 1 token = {:.1f} GB/s, {:.2f} ms for {} tokens = {:.0f} GFLOP/s; lm_head {:.2f} ms/token.\n\n",
      cal.memcpy_gbps, double(j["calibration"]["expert_bytes"].get<uint64_t>()) / 1e6, 1e3 * cal.expert_1tok_s,
      cal.expert_gemv_gbps, 1e3 * cal.expert_gemm_s, cal.gemm_tokens, cal.cpu_gflops, 1e3 * cal.head_s);
  if (!f.measured.empty()) {
    md += fmt::format(
        "**Measured** (CPU engine, {} layer(s); full = per-layer cost x {} layers + lm_head; floor = bytes a "
        "decode token reads / {:.1f} GB/s, the best host rate measured)\n\n",
        c.num_layers, full_layers, host_gbps);
    md +=
        "| context | TTFT s | prefill tok/s | decode tok/s | full TTFT s | full prefill tok/s | full decode tok/s | "
        "full decode floor tok/s |\n";
    md += "|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    json mj = json::array();
    for (const Measured& m : f.measured) {
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
      fc.num_layers, ps.expert_bits, ps.dense_bits, opt.kv_elem_bytes, double(ffp.dense_total()) / kGiB,
      double(ffp.experts_total(fc)) / kGiB, ps.usage_source, opt.hbm_gbps, opt.pcie_gbps, opt.gpu_tflops,
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
  for (const Projection& p : proj)
    if (p.placement.rfind("hybrid", 0) == 0) {
      j["hybrid_plan"] = p.decode_plan.to_json();
      j["hybrid_plan_summary"] = p.decode_plan.summary();
      break;
    }
  return r;
}

}  // namespace moesrv::bench
