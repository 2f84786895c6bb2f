// `bench_glm5_next_cpu` (run_cpu_layer_bench): a synthetic model at real width on the CPU engine, timed layer by
// layer (cpu_layer_timing.h); prefill and decode at each context, decode beyond the longest prefill on a state whose
// rows are repeated (CpuSequence::repeat_rows_to), the engine's state against model/state.h, all projected to the
// full model by counting its layers of each kind.
#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <thread>

#include "bench/bench.h"
#include "bench/common.h"
#include "bench/cpu_layer_timing.h"
#include "bench/speculative_projection.h"
#include "model/state.h"
#include "util/error.h"
#include "util/thread_pool.h"

namespace moesrv {

using json = nlohmann::json;
using namespace bench;

namespace {

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

// Per-sequence state (model/state.h): one layer of each stateful mixer of `fc` and the whole of it at several
// contexts; appends the markdown table to `md`, returns the JSON.
json state_table(const ModelSpec& fc, std::string& md) {
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
  return stj;
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
  std::string prefill_rows, decode_rows, mtp_rows;
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
    // MTP verify (issue 24): k + 1 tokens in one forward with rollback points, as SpeculativeDecoder::step runs
    // them, then cut back (after one untimed verify). A draft costs one decode layer of the costliest kind plus the
    // head (the MTP block is one decoder layer sharing the lm_head). Full-model seconds, as `full`.
    double costliest = 0;
    for (const auto& [kk, v] : m) costliest = std::max(costliest, v);
    const double draft = costliest + t.head_s / n;
    json mtp = json::array();
    std::string mtp_cells;
    seq.checkpoint();
    const int64_t len = seq.length();
    for (int k = 0; k <= 3; ++k) {
      StepTimes vt;
      std::vector<float> hidden;
      engine.time_steps(&vt);
      engine.forward_hidden(seq, std::vector<int32_t>(size_t(std::max(k, 3) + 1), next()), true, true, hidden);
      engine.time_steps(nullptr);
      seq.truncate(len);
      if (k == 0) continue;  // the warm-up (k = 3)
      const json row = mtp_projection_json(k, full, full_seconds(vt, 1), draft);
      mtp_cells += fmt::format(" {:.2f} / {:.2f} |", row["verify_over_decode"].get<double>(),
                               row["projected_speedup_at_0.7"].get<double>());
      mtp.push_back(row);
    }
    mtp_rows += fmt::format("| {} |{}\n", ctx, mtp_cells);
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
                  {"mtp", mtp},
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
    seq.repeat_rows_to(ctx);
    std::vector<float> logits(size_t(c.vocab_size), 0.0f);
    decode(seq, logits, fmt::format("tiled from {}", longest_len));
  }

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
  md +=
      "**MTP verify** (issue 24; full model): k + 1 tokens in one forward with rollback points over one decode step, "
      "and the projected speed-up at acceptance 0.7 with drafts costing one decode layer + lm_head each "
      "(bench/speculative_projection.h)\n\n| context | k=1 verify/decode / speed-up | k=2 | k=3 |\n"
      "|---:|---:|---:|---:|\n" +
      mtp_rows + "\n";
  std::string bytes_list;
  for (const auto& [k, v] : kind_bytes) bytes_list += fmt::format("{} {:.0f} MB, ", k, v / 1e6);
  md += fmt::format(
      "Weights read per decode token: {}lm_head {:.0f} MB; full model {:.1f} GB per token, i.e. a floor of "
      "{:.2f} s/token at the {:.1f} GB/s memcpy rate measured here (decode reads weights at the rates in "
      "the JSON, per_layer_weight_gbps).\n\n",
      bytes_list, head_bytes / 1e6, full_bytes / 1e9, full_bytes / (memcpy_gbps * 1e9), memcpy_gbps);
  const json stj = state_table(fc, md);

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
