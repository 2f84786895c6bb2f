#include "tools/preflight.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include "format/lock.h"
#include "model/manifest.h"
#include "model/state.h"
#include "util/error.h"

namespace moesrv {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr double kGiB = double(1ull << 30);

std::string gib(uint64_t b) { return fmt::format("{:.2f} GiB", double(b) / kGiB); }

std::string human(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(b);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

int64_t geti(const json& c, const char* key, int64_t def = 0) {
  auto it = c.find(key);
  return it != c.end() && it->is_number() ? it->get<int64_t>() : def;
}

const json& text_config(const json& config) {
  auto it = config.find("text_config");
  return it != config.end() && it->is_object() ? *it : config;
}

// Weights a tensor holds: an EXL3 trellis [in/16][out/16][16K] int16 holds in*out; its suh/svh scales and
// codebook marker hold none.
uint64_t exl3_aware_params(const std::string& name, const TensorView& t) {
  if (name.ends_with(".trellis") && t.shape.size() == 3) return uint64_t(t.shape[0] * t.shape[1]) * 256;
  for (const char* s : {".suh", ".svh", ".su", ".sv", ".mcg", ".mul1"})
    if (name.ends_with(s)) return 0;
  return uint64_t(t.numel());
}

}  // namespace

ParamBytes count_parameter_bytes(const ModelPackage& pkg) {
  ParamBytes p;
  for (const auto& [file, shard] : pkg.shards())
    for (const auto& [name, t] : shard->tensors()) {
      bool expert = name.find(".mlp.experts.") != std::string::npos;
      (expert ? p.experts : p.dense) += t.nbytes;  // as stored: EXL3 stays in its trellis form on the GPU too
      (expert ? p.expert_params : p.dense_params) += exl3_aware_params(name, t);
      ++p.tensors;
    }
  return p;
}

ParamBytes estimate_parameter_bytes(const json& config, double bits) {
  const ModelSpec spec = ModelSpec::from_json(config);
  const std::string root = config.contains("text_config") ? "model.language_model." : "model.";
  ParamBytes p;
  for (const TensorEntry& t : manifest(spec, root)) {
    const double n = double(t.numel());
    const uint64_t b = uint64_t(std::ceil(n * (t.quantizable() ? bits : 16.0) / 8.0));
    (t.role == TensorRole::Expert ? p.experts : p.dense) += b;
    (t.role == TensorRole::Expert ? p.expert_params : p.dense_params) += uint64_t(n);
    ++p.tensors;
  }
  return p;
}

namespace {

// Supported architectures: the numbers come from model/state.h, the one state formula.
std::optional<KvCacheSpec> kv_cache_spec_from_model(const json& config, int dtype_bytes) {
  ModelSpec s;
  try {
    s = ModelSpec::from_json(config);
  } catch (const Error&) {
    return std::nullopt;  // an architecture moesrv does not run: estimated from the raw fields below
  }
  KvCacheSpec k;
  uint64_t kv = 0, index = 0, fixed = 0;
  for (const StateSpec& st : state_specs(s)) {
    if (st.recurrent) ++k.linear_layers;
    else ++k.attention_layers;
    for (const StateBuffer& b : st.buffers) {
      const bool indexer = b.indexer;
      if (indexer && b.growth != Growth::Fixed) ++k.indexer_layers;
      if (b.growth == Growth::Fixed) fixed += uint64_t(b.elems) * 4;
      else if (indexer)
        index += uint64_t(b.elems) * uint64_t(dtype_bytes) * uint64_t(b.growth == Growth::PerPool ? 1 : st.pool);
      else kv += uint64_t(b.elems) * uint64_t(dtype_bytes);
    }
  }
  k.kind = k.attention_layers == 0 ? "none" : s.attention == AttentionKind::MLA ? "MLA" : "GQA";
  k.kv_bytes_per_token = kv;
  // Pooled indexer keys grow by one key per index_kpool tokens: per token, their share (rounded up).
  k.indexer_bytes_per_token = (index + uint64_t(s.index_kpool) - 1) / uint64_t(s.index_kpool);
  k.linear_state_bytes = fixed;
  k.formula =
      fmt::format("model/state.h over {} layers: {} with a per-token cache ({} B/token), indexer keys {} B/token",
                  s.num_layers, k.attention_layers, kv, k.indexer_bytes_per_token);
  if (s.index_kpool > 1) k.formula += fmt::format(" (one pooled key per {} tokens)", s.index_kpool);
  if (fixed)
    k.formula +=
        fmt::format("; fixed state per sequence {} ({} recurrent layers, fp32)", human(fixed), k.linear_layers);
  return k;
}

}  // namespace

KvCacheSpec kv_cache_spec(const json& config, int dtype_bytes) {
  if (auto k = kv_cache_spec_from_model(config, dtype_bytes)) return *k;
  const json& c = text_config(config);
  KvCacheSpec k;
  int64_t layers = geti(c, "num_hidden_layers");
  json types = c.value("layer_types", json());
  json indexer_types = c.value("indexer_types", json());
  auto type_of = [&](int64_t i) -> std::string {
    return types.is_array() && size_t(i) < types.size() && types[size_t(i)].is_string()
               ? types[size_t(i)].get<std::string>()
               : "";
  };
  int64_t index_dim = geti(c, "index_head_dim");
  for (int64_t i = 0; i < layers; ++i) {
    std::string t = type_of(i);
    if (t.find("linear") != std::string::npos) {
      ++k.linear_layers;
      continue;
    }
    ++k.attention_layers;
    if (index_dim > 0) {
      bool own = indexer_types.is_array() && size_t(i) < indexer_types.size()
                     ? indexer_types[size_t(i)] == "full"
                     : t.empty() || t.find("sparse") != std::string::npos;
      k.indexer_layers += own;
    }
  }
  uint64_t b = uint64_t(dtype_bytes);
  int64_t kv_lora = geti(c, "kv_lora_rank");
  if (k.attention_layers == 0) {
    k.kind = "none";
  } else if (kv_lora > 0) {
    int64_t rope = geti(c, "qk_rope_head_dim");
    k.kind = "MLA";
    k.kv_bytes_per_token = uint64_t(kv_lora + rope) * b * uint64_t(k.attention_layers);
    k.formula = fmt::format("MLA: (kv_lora_rank {} + qk_rope_head_dim {}) x {} B x {} layers", kv_lora, rope, b,
                            k.attention_layers);
  } else {
    int64_t heads = geti(c, "num_attention_heads", 1);
    int64_t kv_heads = geti(c, "num_key_value_heads", heads);
    int64_t head_dim = geti(c, "head_dim");
    if (head_dim <= 0) head_dim = geti(c, "hidden_size") / std::max<int64_t>(1, heads);
    k.kind = "GQA";
    k.kv_bytes_per_token = uint64_t(2 * kv_heads * head_dim) * b * uint64_t(k.attention_layers);
    k.formula =
        fmt::format("GQA: 2 x {} kv heads x head_dim {} x {} B x {} layers", kv_heads, head_dim, b, k.attention_layers);
  }
  if (k.indexer_layers > 0) {
    k.indexer_bytes_per_token = uint64_t(index_dim) * b * uint64_t(k.indexer_layers);
    k.formula +=
        fmt::format(" + DSA indexer keys: index_head_dim {} x {} B x {} layers", index_dim, b, k.indexer_layers);
  }
  if (k.linear_layers > 0) {  // gated-delta-net style: fp32 recurrent state + conv window, per sequence
    int64_t nv = geti(c, "linear_num_value_heads", geti(c, "linear_num_heads"));
    int64_t nk = geti(c, "linear_num_key_heads", nv);
    int64_t dk = geti(c, "linear_key_head_dim", geti(c, "linear_head_dim"));
    int64_t dv = geti(c, "linear_value_head_dim", geti(c, "linear_head_dim"));
    int64_t kernel = geti(c, "linear_conv_kernel_dim", 4);
    uint64_t per_layer = uint64_t(nv * dk * dv) * 4 + uint64_t(kernel * (2 * nk * dk + nv * dv)) * b;
    k.linear_state_bytes = per_layer * uint64_t(k.linear_layers);
    k.formula += fmt::format("; {} linear-attention layers keep {} of state per sequence", k.linear_layers,
                             human(k.linear_state_bytes));
  }
  return k;
}

HostInfo probe_host(const std::string& model_dir) {
  return {probe_cpu(), probe_memory(), probe_gpus(), probe_disk(model_dir)};
}

static std::vector<PackageFileStatus> check_files(const std::string& dir, bool hash, bool& has_lock, bool& lock_ok) {
  std::vector<PackageFileStatus> out;
  fs::path lp = fs::path(dir) / kLockFileName;
  has_lock = fs::exists(lp);
  lock_ok = true;
  if (!has_lock) {
    for (const auto& rel : list_package_files(dir))
      out.push_back({rel, fs::file_size(fs::path(dir) / rel), "no lock", false});
    return out;
  }
  PackageLock lock = read_lock(lp.string());
  std::map<std::string, std::string> problems;
  if (hash) {
    VerifyOptions vo;
    VerifyReport r = verify_against(dir, lock, vo);
    for (const auto& i : r.issues) problems[i.path] = file_problem_name(i.problem);
  } else {
    for (const auto& rel : list_package_files(dir))
      if (!lock.files.count(rel)) problems[rel] = "not in lock";
    for (const auto& [rel, e] : lock.files) {
      std::error_code ec;
      uint64_t size = fs::file_size(fs::path(dir) / rel, ec);
      if (ec) problems[rel] = "missing";
      else if (size != e.size) problems[rel] = size < e.size ? "truncated" : "size mismatch";
    }
  }
  std::set<std::string> all;
  for (const auto& [rel, e] : lock.files) all.insert(rel);
  for (const auto& [rel, p] : problems) all.insert(rel);
  for (const auto& rel : all) {
    std::error_code ec;
    uint64_t size = fs::file_size(fs::path(dir) / rel, ec);
    auto p = problems.find(rel);
    bool bad = p != problems.end() && p->second != "not in lock";
    lock_ok = lock_ok && !bad;
    out.push_back({rel, ec ? 0 : size, p != problems.end() ? p->second : (hash ? "ok (sha256)" : "ok (size)"), bad});
  }
  return out;
}

PreflightReport run_preflight(const std::string& dir, const PreflightOptions& opt) {
  return run_preflight(dir, opt, probe_host(dir));
}

PreflightReport run_preflight(const std::string& dir, const PreflightOptions& opt, const HostInfo& host) {
  PreflightReport r;
  r.dir = dir;
  r.host = host;
  r.files = check_files(dir, opt.hash, r.has_lock, r.lock_ok);
  const json cfg = read_json_file((fs::path(dir) / "config.json").string());
  r.estimated = std::none_of(r.files.begin(), r.files.end(), [](const PackageFileStatus& f) {
    return f.path.size() > 12 && f.path.compare(f.path.size() - 12, 12, ".safetensors") == 0;
  });
  r.model_type = cfg.value("model_type", std::string("?"));
  r.params =
      r.estimated ? estimate_parameter_bytes(cfg, opt.assume_bits) : count_parameter_bytes(*ModelPackage::open(dir));
  r.kv = kv_cache_spec(cfg, opt.kv_dtype_bytes);
  int64_t max_pos = geti(text_config(cfg), "max_position_embeddings", 32768);
  r.ctx = opt.ctx > 0 ? opt.ctx : std::min<int64_t>(max_pos, 32768);
  r.kv_bytes = r.kv.bytes_per_token() * uint64_t(r.ctx) + r.kv.linear_state_bytes;
  for (int64_t ctx : {int64_t(8192), int64_t(131072), int64_t(262144)})
    if (ctx <= max_pos) r.kv_by_ctx.push_back({ctx, r.kv.bytes_per_token() * uint64_t(ctx) + r.kv.linear_state_bytes});
  r.overhead = uint64_t(std::max(0.0, opt.overhead_gib) * kGiB);

  uint64_t free_vram = 0;
  for (const auto& g : host.gpus) free_vram += g.free();
  r.vram_budget = opt.vram_budget_gib >= 0 ? uint64_t(opt.vram_budget_gib * kGiB) : free_vram;
  uint64_t avail = host.mem.available;
  uint64_t all = r.params.total() + r.kv_bytes + r.overhead;
  uint64_t gpu_min = r.params.dense + r.kv_bytes + r.overhead;
  const char* paging = " (weights are memory-mapped: it would start, but page experts from disk and run very slowly)";
  if (r.vram_budget > 0 && gpu_min <= r.vram_budget) {
    uint64_t experts_on_gpu = std::min(r.params.experts, r.vram_budget - gpu_min);
    r.vram_used = gpu_min + experts_on_gpu;
    r.ram_needed = r.params.experts - experts_on_gpu;
    r.fits = r.ram_needed <= avail;
    r.verdict =
        r.fits ? fmt::format(
                     "fits: {} on GPU (dense weights + KV cache + {} of experts), {} of experts in RAM ({} available)",
                     gib(r.vram_used), gib(experts_on_gpu), gib(r.ram_needed), gib(avail))
               : fmt::format(
                     "does not fit: needs {} more RAM (or as much more VRAM): {} of experts in RAM, {} available{}",
                     gib(r.ram_needed - avail), gib(r.ram_needed), gib(avail), paging);
  } else if (all <= avail) {
    r.ram_needed = all;
    r.fits = true;
    r.verdict = fmt::format("fits CPU-only: {} in RAM ({} available)", gib(all), gib(avail));
    if (r.vram_budget > 0)
      r.verdict += fmt::format("; GPU offload of dense weights + KV cache needs {} more VRAM ({} needed, {} budget)",
                               gib(gpu_min - r.vram_budget), gib(gpu_min), gib(r.vram_budget));
  } else if (r.vram_budget > 0) {
    r.ram_needed = r.params.experts;
    r.verdict = fmt::format("does not fit: needs {} more VRAM for dense weights + KV cache ({} needed, {} budget)",
                            gib(gpu_min - r.vram_budget), gib(gpu_min), gib(r.vram_budget));
    if (r.params.experts > avail)
      r.verdict += fmt::format(" and {} more RAM for the experts ({} needed, {} available)",
                               gib(r.params.experts - avail), gib(r.params.experts), gib(avail));
  } else {
    r.ram_needed = all;
    r.verdict =
        fmt::format("does not fit: needs {} more RAM ({} needed for weights + KV cache, {} available; no GPU){}",
                    gib(all - avail), gib(all), gib(avail), paging);
  }
  std::vector<std::pair<std::string, uint64_t>> budgets = {{"22 GiB", uint64_t(22 * kGiB)},
                                                           {"44 GiB", uint64_t(44 * kGiB)}};
  if (free_vram > 0) budgets.push_back({"all GPUs", free_vram});
  for (const auto& [label, b] : budgets) {
    PreflightReport::BudgetPlan p{label, b};
    p.dense_fits = gpu_min <= b;
    p.experts_on_gpu = p.dense_fits ? std::min(r.params.experts, b - gpu_min) : 0;
    p.vram_used = p.dense_fits ? gpu_min + p.experts_on_gpu : 0;
    p.ram_needed = r.params.experts - p.experts_on_gpu + (p.dense_fits ? 0 : gpu_min);
    p.fits = p.ram_needed <= avail;
    r.by_budget.push_back(p);
  }
  return r;
}

nlohmann::json PreflightReport::by_budget_json() const {
  nlohmann::json a = nlohmann::json::array();
  for (const BudgetPlan& p : by_budget)
    a.push_back({{"label", p.label},
                 {"vram_budget", p.budget},
                 {"dense_fits", p.dense_fits},
                 {"vram_used", p.vram_used},
                 {"experts_on_gpu", p.experts_on_gpu},
                 {"ram_needed", p.ram_needed},
                 {"fits", p.fits}});
  return a;
}

std::string PreflightReport::text() const {
  std::string o = fmt::format("moesrv preflight: {} ({})\n", dir, model_type);
  o += fmt::format("CPU      {} | {} cores, {} threads | {}\n", host.cpu.model.empty() ? "?" : host.cpu.model,
                   host.cpu.physical_cores, host.cpu.logical_cores, host.cpu.flags_summary());
  o += fmt::format("RAM      {} total, {} available\n", gib(host.mem.total), gib(host.mem.available));
  if (host.gpus.empty()) o += "GPU      none detected (nvidia-smi absent or no device)\n";
  for (size_t i = 0; i < host.gpus.size(); ++i)
    o += fmt::format("GPU {}    {} | {} total, {} used, {} free\n", i, host.gpus[i].name, gib(host.gpus[i].total),
                     gib(host.gpus[i].used), gib(host.gpus[i].free()));
  o += fmt::format("Disk     {} free of {} (model folder)\n", gib(host.disk.free), gib(host.disk.total));
  uint64_t bytes = 0;
  for (const auto& f : files) bytes += f.size;
  o += fmt::format("Files    {} files, {}; lock: {}\n", files.size(), human(bytes),
                   !has_lock ? "none (create one with `moesrv lock`)"
                   : lock_ok ? "all files match"
                             : "PROBLEMS (see below)");
  for (const auto& f : files)
    o += fmt::format("  {:<48} {:>12}  {}{}\n", f.path, human(f.size), f.problem ? "!! " : "", f.status);
  o += fmt::format("Params   {} = {} dense + {} routed experts ({} tensors, {:.3f} B params){}\n",
                   human(params.total()), human(params.dense), human(params.experts), params.tensors,
                   double(params.dense_params + params.expert_params) / 1e9,
                   estimated ? " [no weights here: estimated from the config's tensor manifest]" : "");
  o += fmt::format("KV cache {} B/token = {}\n", kv.bytes_per_token(),
                   kv.formula.empty() ? "no attention layers" : kv.formula);
  o += fmt::format("         ctx {} -> {}\n", ctx, human(kv_bytes));
  for (const auto& [c, b] : kv_by_ctx) o += fmt::format("         ctx {:>6} -> {}\n", c, human(b));
  o += fmt::format("Plan     VRAM budget {}, reserve {} for workspace\n", gib(vram_budget), gib(overhead));
  o += fmt::format("Verdict  {}\n", verdict);
  for (const BudgetPlan& p : by_budget)
    o +=
        !p.dense_fits
            ? fmt::format(
                  "  at {:<9} dense weights + KV cache + workspace do not fit ({} needed): CPU only, {} in RAM, {}\n",
                  p.label, gib(params.dense + kv_bytes + overhead), gib(p.ram_needed), p.fits ? "fits" : "does not fit")
            : fmt::format("  at {:<9} {} on GPU ({} of experts), {} of experts in RAM: {}\n", p.label, gib(p.vram_used),
                          gib(p.experts_on_gpu), gib(p.ram_needed),
                          p.fits ? "fits" : fmt::format("needs {} more RAM", gib(p.ram_needed - host.mem.available)));
  return o;
}

json PreflightReport::to_json() const {
  json gpus = json::array();
  for (const auto& g : host.gpus)
    gpus.push_back({{"name", g.name}, {"memory_total", g.total}, {"memory_used", g.used}});
  json fl = json::array();
  for (const auto& f : files)
    fl.push_back({{"path", f.path}, {"size", f.size}, {"status", f.status}, {"problem", f.problem}});
  return {
      {"model_dir", dir},
      {"model_type", model_type},
      {"cpu",
       {{"model", host.cpu.model},
        {"physical_cores", host.cpu.physical_cores},
        {"logical_cores", host.cpu.logical_cores},
        {"avx2", host.cpu.avx2},
        {"fma", host.cpu.fma},
        {"avx512f", host.cpu.avx512f},
        {"avx512bw", host.cpu.avx512bw},
        {"avx512_vnni", host.cpu.avx512_vnni},
        {"avx512_bf16", host.cpu.avx512_bf16},
        {"amx", host.cpu.amx}}},
      {"ram", {{"total", host.mem.total}, {"available", host.mem.available}}},
      {"gpus", gpus},
      {"disk", {{"total", host.disk.total}, {"free", host.disk.free}}},
      {"files", fl},
      {"lock", {{"present", has_lock}, {"ok", lock_ok}}},
      {"params",
       {{"dense_bytes", params.dense},
        {"expert_bytes", params.experts},
        {"total_bytes", params.total()},
        {"dense_params", params.dense_params},
        {"expert_params", params.expert_params},
        {"tensors", params.tensors}}},
      {"kv_cache",
       {{"kind", kv.kind},
        {"attention_layers", kv.attention_layers},
        {"linear_layers", kv.linear_layers},
        {"indexer_layers", kv.indexer_layers},
        {"kv_bytes_per_token", kv.kv_bytes_per_token},
        {"indexer_bytes_per_token", kv.indexer_bytes_per_token},
        {"bytes_per_token", kv.bytes_per_token()},
        {"linear_state_bytes", kv.linear_state_bytes},
        {"ctx", ctx},
        {"total_bytes", kv_bytes},
        {"formula", kv.formula}}},
      {"plan",
       {{"vram_budget", vram_budget}, {"vram_used", vram_used}, {"ram_needed", ram_needed}, {"overhead", overhead}}},
      {"fits", fits},
      {"verdict", verdict},
      {"by_budget", by_budget_json()},
  };
}

}  // namespace moesrv
