#include "runtime/placement.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>

#include "backend/cold_split.h"
#include "backend/usage_stats.h"
#include "format/package.h"
#include "model/manifest.h"
#include "model/state.h"
#include "model/weights.h"
#include "util/error.h"

namespace moesrv {

using json = nlohmann::json;

const char* home_name(ExpertHome h) {
  switch (h) {
    case ExpertHome::Pinned: return "pinned";
    case ExpertHome::Cached: return "cached";
    case ExpertHome::Fetch: return "fetch";
    default: return "cpu";
  }
}

uint64_t ModelFootprint::dense_total(int64_t begin, int64_t end) const {
  const int64_t L = int64_t(dense_bytes.size());
  if (end < 0) end = L;
  return std::accumulate(dense_bytes.begin() + begin, dense_bytes.begin() + end, end == L ? head_bytes : uint64_t(0));
}

uint64_t ModelFootprint::experts_total(const ModelSpec& c, int64_t begin, int64_t end) const {
  if (end < 0) end = int64_t(expert_bytes.size());
  uint64_t t = 0;
  for (int64_t l = begin; l < end; ++l)
    t += expert_bytes[size_t(l)] * uint64_t(std::max<int64_t>(c.n_routed_experts, 0));
  return t;
}

namespace {

uint64_t to_bytes(double params, double bits) { return uint64_t(std::ceil(params * bits / 8.0)); }

}  // namespace

ModelFootprint footprint_from_config(const ModelSpec& c, double expert_bits, double dense_bits) {
  // Summed from the manifest (model/manifest.h): per layer the dense tensors, and one routed expert's matrices.
  ModelFootprint f;
  f.dense_params.assign(size_t(c.num_layers), 0.0);
  f.expert_params.assign(size_t(c.num_layers), 0.0);
  for (const TensorEntry& t : manifest(c)) {
    const double n = double(t.numel());
    if (t.layer < 0) {
      if (t.name == "lm_head.weight" || t.name.find("norm") != std::string::npos) f.head_params += n;
      else if (c.tie_embeddings) f.head_params += n;  // the embedding doubles as the head
      continue;
    }
    if (t.role != TensorRole::Expert) f.dense_params[size_t(t.layer)] += n;
    else if (t.expert == 0) f.expert_params[size_t(t.layer)] += n;
  }
  for (int64_t l = 0; l < c.num_layers; ++l) {
    f.dense_bytes.push_back(to_bytes(f.dense_params[size_t(l)], dense_bits));
    f.expert_bytes.push_back(to_bytes(f.expert_params[size_t(l)], expert_bits));
  }
  f.head_bytes = to_bytes(f.head_params, dense_bits);
  f.embed_bytes = c.tie_embeddings ? 0 : to_bytes(double(c.hidden_size) * double(c.vocab_size), dense_bits);
  return f;
}

ModelFootprint footprint_from_weights(const ModelWeights& w) {
  ModelFootprint f;
  auto add = [](const Linear* l, uint64_t& bytes, double& params) {
    if (!l) return;
    bytes += l->stored_bytes();
    params += double(l->in_features()) * double(l->out_features());
  };
  auto add_mlp = [&](const MlpWeights& m, uint64_t& bytes, double& params) {
    add(m.gate.get(), bytes, params), add(m.up.get(), bytes, params), add(m.down.get(), bytes, params);
  };
  auto add_norm = [](const NormWeights& n, uint64_t& bytes, double& params) {
    bytes += (n.weight.size() + n.bias.size()) * sizeof(float);
    params += double(n.weight.size() + n.bias.size());
  };
  for (const LayerWeights& L : w.layers) {
    uint64_t db = 0, eb = 0;
    double dp = 0, ep = 0;
    add_norm(L.input_norm, db, dp), add_norm(L.post_attention_norm, db, dp);
    if (L.mla) {
      const MlaWeights& a = *L.mla;
      for (const Linear* l : {a.q_a.get(), a.q_b.get(), a.q.get(), a.kv_a.get(), a.kv_b.get(), a.o.get()}) add(l, db, dp);
      add_norm(a.q_a_norm, db, dp), add_norm(a.kv_a_norm, db, dp);
      if (a.indexer) {
        add(a.indexer->wq_b.get(), db, dp), add(a.indexer->wk.get(), db, dp), add(a.indexer->weights_proj.get(), db, dp);
        add_norm(a.indexer->k_norm, db, dp);
      }
    } else if (L.gqa) {
      for (const Linear* l : {L.gqa->q.get(), L.gqa->k.get(), L.gqa->v.get(), L.gqa->o.get()}) add(l, db, dp);
    }
    if (L.mlp) add_mlp(*L.mlp, db, dp);
    if (L.moe) {
      db += (L.moe->router.size() + L.moe->router_bias.size()) * sizeof(float);
      dp += double(L.moe->router.size() + L.moe->router_bias.size());
      if (L.moe->shared) add_mlp(*L.moe->shared, db, dp);
      if (!L.moe->experts.empty()) add_mlp(L.moe->experts[0], eb, ep);
    }
    f.dense_bytes.push_back(db), f.dense_params.push_back(dp);
    f.expert_bytes.push_back(eb), f.expert_params.push_back(ep);
  }
  add(w.lm_head.get(), f.head_bytes, f.head_params);
  add_norm(w.final_norm, f.head_bytes, f.head_params);
  f.embed_bytes = w.embed ? w.embed->nbytes : 0;
  return f;
}

namespace {

// Number after `key` in a tensor name ("model.layers.12.mlp" -> 12 for ".layers."), or -1.
int64_t index_after(const std::string& name, const char* key) {
  const size_t p = name.find(key);
  return p == std::string::npos ? -1 : std::atoll(name.c_str() + p + std::strlen(key));
}

}  // namespace

ModelFootprint footprint_from_package(const ModelSpec& c, const ModelPackage& pkg) {
  ModelFootprint f = footprint_from_config(c);
  const size_t L = size_t(c.num_layers);
  std::vector<std::map<int64_t, int64_t>> expert_delta(L);  // [layer] expert -> device bytes - bf16 bytes
  std::vector<int64_t> expert_linears(L, 0);
  for (const std::string& name : pkg.names()) {
    if (!name.ends_with(".trellis")) continue;
    const TensorView& t = pkg.require(name);
    if (t.shape.size() != 3) continue;
    const std::string prefix = name.substr(0, name.size() - 8);
    if (prefix.find("kv_b_proj") != std::string::npos) continue;
    const int64_t in_pad = t.shape[0] * 16, out_pad = t.shape[1] * 16;
    long long out = out_pad, in = in_pad;  // logical shape: exl3_convert records padded ones
    for (const auto& [file, shard] : pkg.shards())
      if (auto m = shard->metadata().find("exl3.shape." + prefix); m != shard->metadata().end())
        std::sscanf(m->second.c_str(), "%lld,%lld", &out, &in);
    const int64_t delta = int64_t(t.nbytes) + 2 * (in_pad + out_pad) - 2 * int64_t(in) * int64_t(out);
    const int64_t l = index_after(prefix, ".layers.");
    if (prefix.ends_with("lm_head")) {
      f.head_bytes = uint64_t(int64_t(f.head_bytes) + delta);
    } else if (l >= 0 && size_t(l) < L) {  // (MTP layers beyond num_layers are not loaded)
      const int64_t e = index_after(prefix, ".mlp.experts.");
      if (e >= 0) expert_delta[size_t(l)][e] += delta, ++expert_linears[size_t(l)];
      else f.dense_bytes[size_t(l)] = uint64_t(int64_t(f.dense_bytes[size_t(l)]) + delta);
    }
  }
  for (size_t l = 0; l < L; ++l) {
    if (c.n_routed_experts <= 0 || expert_linears[l] != 3 * c.n_routed_experts) continue;
    int64_t worst = std::numeric_limits<int64_t>::min();
    for (const auto& [e, d] : expert_delta[l]) worst = std::max(worst, d);
    f.expert_bytes[l] = uint64_t(int64_t(f.expert_bytes[l]) + worst);
  }
  return f;
}

uint64_t kv_cache_bytes(const ModelSpec& c, int64_t context, int kv_elem_bytes, int index_elem_bytes, int64_t begin,
                        int64_t end) {
  return state_bytes(c, std::max<int64_t>(context, 0), kv_elem_bytes, 4, begin, end, index_elem_bytes);
}

double CostModel::cpu_s(uint64_t bytes, double params, double tokens) const {
  if (tokens <= 0) return 0;
  return std::max(double(bytes) / (host_mem_gbps * 1e9), 2 * params * tokens / (cpu_gflops * 1e9));
}

double CostModel::gpu_s(uint64_t bytes, double params, double tokens) const {
  if (tokens <= 0) return 0;
  return std::max(double(bytes) / (hbm_gbps * 1e9), 2 * params * tokens / (gpu_tflops * 1e12));
}

json CostModel::to_json() const {
  return json{{"pcie_gbps", pcie_gbps}, {"host_mem_gbps", host_mem_gbps}, {"hbm_gbps", hbm_gbps},
              {"cpu_gflops", cpu_gflops}, {"gpu_tflops", gpu_tflops}};
}

int64_t LayerPlacement::count(ExpertHome h) const { return std::count(home.begin(), home.end(), h); }

std::vector<int32_t> PlacementPlan::slots_per_layer() const {
  std::vector<int32_t> s;
  for (const auto& L : layers) s.push_back(int32_t(L.slots));
  return s;
}

bool PlacementPlan::prefer_fetch(int64_t layer, int64_t tokens) const {
  const LayerPlacement& L = layers.at(size_t(layer));
  return L.fetch_min_tokens > 0 && tokens >= L.fetch_min_tokens;
}

namespace {

// Per-step odds that a token batch of T touches an expert chosen with per-token probability p, and the tokens
// it then carries.
struct StepUse {
  double hit, tokens;
};
StepUse step_use(double p, int64_t T) {
  p = std::clamp(p, 0.0, 1.0);
  double h = 1 - std::pow(1 - p, double(T));
  return {h, h > 0 ? double(T) * p / h : 1.0};
}

std::vector<double> layer_probability(const ModelSpec& c, const UsageStats* usage, int64_t l) {
  if (usage && l < usage->layers() && usage->experts() == c.n_routed_experts) return usage->selection_probability(l);
  return std::vector<double>(size_t(c.n_routed_experts), double(c.experts_per_token) / double(c.n_routed_experts));
}

bool has_usage(const ModelSpec& c, const UsageStats* usage, int64_t l) {
  return usage && l < usage->layers() && usage->experts() == c.n_routed_experts && !usage->empty(l);
}

// Slots per MoE layer for `budget` bytes: proportional to weight[l] (water-filled at E), then leftovers greedily.
std::vector<int64_t> allocate_slots(const std::vector<double>& weight, const std::vector<uint64_t>& bytes, int64_t E,
                                    uint64_t budget) {
  const size_t n = weight.size();
  std::vector<int64_t> slots(n, 0);
  std::vector<bool> capped(n, false);
  double remaining = double(budget);
  for (bool changed = true; changed;) {
    changed = false;
    double denom = 0;
    for (size_t l = 0; l < n; ++l)
      if (!capped[l] && bytes[l] > 0) denom += weight[l] * double(bytes[l]);
    if (denom <= 0) break;
    for (size_t l = 0; l < n; ++l) {
      if (capped[l] || bytes[l] == 0) continue;
      if (remaining * weight[l] / denom >= double(E)) {
        capped[l] = changed = true;
        slots[l] = E;
        remaining -= double(E) * double(bytes[l]);
      }
    }
    if (!changed)
      for (size_t l = 0; l < n; ++l)
        if (!capped[l] && bytes[l] > 0) slots[l] = int64_t(std::floor(remaining * weight[l] / denom));
  }
  uint64_t used = 0;
  for (size_t l = 0; l < n; ++l) used += uint64_t(slots[l]) * bytes[l];
  for (;;) {  // hand leftover bytes out one slot at a time, to the layer with the largest weight per slot
    size_t best = n;
    for (size_t l = 0; l < n; ++l)
      if (bytes[l] > 0 && slots[l] < E && used + bytes[l] <= budget &&
          (best == n || weight[l] / double(slots[l] + 1) > weight[best] / double(slots[best] + 1)))
        best = l;
    if (best == n) break;
    ++slots[best];
    used += bytes[best];
  }
  return slots;
}

// Smallest token count at which fetching a cold expert beats computing it on the CPU (0: never).
int64_t fetch_threshold(const CostModel& m, uint64_t bytes, double params) {
  auto fetch_wins = [&](int64_t n) { return m.fetch_s(bytes) + m.gpu_s(bytes, params, double(n)) <= m.cpu_s(bytes, params, double(n)); };
  int64_t hi = 1;
  while (!fetch_wins(hi)) {
    if (hi >= (int64_t(1) << 24)) return 0;
    hi *= 2;
  }
  int64_t lo = hi / 2;  // fetch loses at lo (or lo == 0)
  while (hi - lo > 1) {
    int64_t mid = (lo + hi) / 2;
    (fetch_wins(mid) ? hi : lo) = mid;
  }
  return hi;
}

void place_layer(const ModelSpec& c, const ModelFootprint& fp, const PlacementRequest& req, const UsageStats* usage,
                 int64_t l, bool all_in_vram, LayerPlacement& L) {
  const int64_t E = c.n_routed_experts, T = std::max<int64_t>(1, req.step_tokens);
  const uint64_t b = fp.expert_bytes[size_t(l)];
  const double params = fp.expert_params[size_t(l)];
  const CostModel& m = req.cost;
  std::vector<double> p = layer_probability(c, usage, l);
  std::vector<int32_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t z) { return p[size_t(a)] > p[size_t(z)]; });
  L.home.assign(size_t(E), ExpertHome::Cpu);
  L.fetch_min_tokens = fetch_threshold(m, b, params);
  if (all_in_vram) {
    L.slots = L.pinned = E;
    std::fill(L.home.begin(), L.home.end(), ExpertHome::Pinned);
    L.hit_rate = 1;
    return;
  }
  L.pinned = req.lru_slots >= 0       ? std::max<int64_t>(0, L.slots - req.lru_slots)
             : has_usage(c, usage, l) ? int64_t(std::floor(req.pin_fraction * double(L.slots)))
                                      : 0;
  double resident_p = 0;
  for (int64_t i = 0; i < L.slots; ++i) {
    L.home[size_t(order[size_t(i)])] = i < L.pinned ? ExpertHome::Pinned : ExpertHome::Cached;
    resident_p += p[size_t(order[size_t(i)])];
  }
  const double total_p = std::accumulate(p.begin(), p.end(), 0.0);
  L.hit_rate = total_p > 0 ? resident_p / total_p : 0;
  // Cold experts: the CPU and the PCIe link work concurrently, so split them to minimise the slower path
  // (backend/cold_split.h, the rule the CUDA engine applies per step with the step's tokens).
  std::vector<ColdCost> cold;
  for (int64_t i = L.slots; i < E; ++i) {
    int32_t e = order[size_t(i)];
    StepUse u = step_use(p[size_t(e)], T);
    cold.push_back({e, u.hit * (m.fetch_s(b) + m.gpu_s(b, params, u.tokens)), u.hit * m.cpu_s(b, params, u.tokens)});
  }
  const size_t best_k = split_cold(cold, L.slots > L.pinned);  // fetched experts land in an LRU slot
  for (size_t i = 0; i < cold.size(); ++i) {
    L.home[size_t(cold[i].id)] = i < best_k ? ExpertHome::Fetch : ExpertHome::Cpu;
    (i < best_k ? L.cold_fetch_s : L.cold_cpu_s) += i < best_k ? cold[i].fetch_s : cold[i].cpu_s;
  }
}

}  // namespace

PlacementPlan plan_placement(const ModelSpec& c, const ModelFootprint& fp, const PlacementRequest& req,
                             const UsageStats* usage) {
  if (int64_t(fp.expert_bytes.size()) != c.num_layers || int64_t(fp.dense_bytes.size()) != c.num_layers)
    fail("placement: footprint has {} layers, the model {}", fp.expert_bytes.size(), c.num_layers);
  const int64_t l0 = req.layer_begin, l1 = req.layer_end < 0 ? c.num_layers : req.layer_end;
  if (l0 < 0 || l0 >= l1 || l1 > c.num_layers)
    fail("placement: layers [{}, {}) of a {}-layer model", l0, req.layer_end, c.num_layers);
  auto in_stage = [&](int64_t l) { return l >= l0 && l < l1 && c.layer_is_moe[size_t(l)]; };
  PlacementPlan plan;
  plan.context = req.context;
  plan.step_tokens = req.step_tokens;
  plan.vram_budget = req.vram_budget;
  plan.vram_dense = fp.dense_total(l0, l1);
  plan.vram_kv = kv_cache_bytes(c, req.context, req.kv_elem_bytes, req.index_elem_bytes, l0, l1);
  plan.vram_workspace = req.workspace_bytes;
  const int64_t E = c.n_routed_experts;
  const uint64_t stage_experts = fp.experts_total(c, l0, l1);
  plan.host_bytes = stage_experts + (l0 == 0 ? fp.embed_bytes : 0);
  const uint64_t fixed = plan.vram_dense + plan.vram_kv + plan.vram_workspace;
  uint64_t expert_budget = 0;
  if (fixed > req.vram_budget) {
    plan.fits = false;
    plan.note = fmt::format("dense weights + KV cache ({} tokens) + workspace need {:.2f} GiB, over the {:.2f} GiB budget",
                            req.context, double(fixed) / kGiB, double(req.vram_budget) / kGiB);
  } else {
    expert_budget = req.vram_budget - fixed;
  }
  plan.all_experts_in_vram = plan.fits && stage_experts <= expert_budget;
  std::vector<double> weight(size_t(c.num_layers), 0.0);
  std::vector<uint64_t> bytes(size_t(c.num_layers), 0);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (!in_stage(l)) continue;
    bytes[size_t(l)] = fp.expert_bytes[size_t(l)];
    bool entropy = req.slot_policy == SlotPolicy::Entropy && has_usage(c, usage, l);
    weight[size_t(l)] = entropy ? std::exp(usage->entropy(l)) : double(E);
  }
  std::vector<int64_t> slots = plan.all_experts_in_vram ? std::vector<int64_t>(size_t(c.num_layers), E)
                                                        : allocate_slots(weight, bytes, E, expert_budget);
  plan.layers.resize(size_t(c.num_layers));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (!in_stage(l)) continue;
    LayerPlacement& L = plan.layers[size_t(l)];
    L.slots = slots[size_t(l)];
    place_layer(c, fp, req, usage, l, plan.all_experts_in_vram, L);
    plan.vram_experts += uint64_t(L.slots) * fp.expert_bytes[size_t(l)];
  }
  return plan;
}

std::string PlacementPlan::summary() const {
  auto gib = [](uint64_t b) { return double(b) / kGiB; };
  std::string s = fmt::format("placement: context {} tokens, step {} token(s), VRAM budget {:.2f} GiB{}\n", context,
                              step_tokens, gib(vram_budget), fits ? "" : " (DOES NOT FIT: " + note + ")");
  s += fmt::format("  VRAM: dense {:.2f} + KV {:.2f} + workspace {:.2f} + experts {:.2f} = {:.2f} GiB; host RAM {:.2f} GiB\n",
                   gib(vram_dense), gib(vram_kv), gib(vram_workspace), gib(vram_experts), gib(vram_total()), gib(host_bytes));
  if (all_experts_in_vram) return s + "  every routed expert is pinned in VRAM\n";
  s += "  layers  slots pinned cached  fetch    cpu  hit-rate  fetch>=tok  cold ms (pcie | cpu)\n";
  auto row = [&](const LayerPlacement& L) {
    return fmt::format("{:6d} {:6d} {:6d} {:6d} {:6d} {:8.1f}%  {:>10}  {:.3f} | {:.3f}", L.slots, L.pinned,
                       L.count(ExpertHome::Cached), L.count(ExpertHome::Fetch), L.count(ExpertHome::Cpu), 100 * L.hit_rate,
                       L.fetch_min_tokens > 0 ? std::to_string(L.fetch_min_tokens) : "never", 1e3 * L.cold_fetch_s,
                       1e3 * L.cold_cpu_s);
  };
  for (size_t l = 0; l < layers.size();) {  // runs of layers with identical rows print once
    if (layers[l].home.empty()) {
      ++l;
      continue;
    }
    const std::string r = row(layers[l]);
    size_t end = l + 1;
    while (end < layers.size() && !layers[end].home.empty() && row(layers[end]) == r) ++end;
    s += fmt::format("  {:>6} {}\n", end - l > 1 ? fmt::format("{}-{}", l, end - 1) : std::to_string(l), r);
    l = end;
  }
  return s;
}

json PlacementPlan::to_json() const {
  json layers_j = json::array();
  for (const LayerPlacement& L : layers) {
    std::string homes;
    for (ExpertHome h : L.home) homes += "PCFU"[int(h)];  // Pinned Cached Fetch cpU
    layers_j.push_back(json{{"slots", L.slots}, {"pinned", L.pinned}, {"homes", homes}, {"hit_rate", L.hit_rate},
                            {"cold_fetch_s", L.cold_fetch_s}, {"cold_cpu_s", L.cold_cpu_s},
                            {"fetch_min_tokens", L.fetch_min_tokens}});
  }
  return json{{"fits", fits}, {"note", note}, {"context", context}, {"step_tokens", step_tokens},
              {"vram_budget", vram_budget}, {"vram", {{"dense", vram_dense}, {"kv", vram_kv}, {"workspace", vram_workspace},
                                                     {"experts", vram_experts}, {"total", vram_total()}}},
              {"host_bytes", host_bytes}, {"all_experts_in_vram", all_experts_in_vram},
              {"homes_legend", "P=pinned C=cached F=fetch U=cpu"}, {"layers", layers_j}};
}

json StepEstimate::to_json() const {
  return json{{"seconds", seconds}, {"gpu_s", gpu_s}, {"cold_s", cold_s}, {"hbm_bytes", hbm_bytes},
              {"pcie_bytes", pcie_bytes}, {"host_bytes", host_bytes}};
}

StepEstimate estimate_step(const ModelSpec& c, const ModelFootprint& fp, const PlacementPlan& plan, const CostModel& m,
                           int64_t tokens, int64_t context, const UsageStats* usage) {
  StepEstimate est;
  const double T = double(std::max<int64_t>(1, tokens));
  const double ctx = double(std::max<int64_t>(1, context));
  const std::vector<StateSpec> states = state_specs(c);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    // The mixer's state: one pass over what a step reads (shared by the step's tokens, bf16 caches, fp32 fixed
    // state), FLOPs per token. Attention layers with a DSA indexer attend at most index_topk rows.
    const LayerSpec& spec = c.layers[size_t(l)];
    const double kv_read = double(step_state_bytes(c, states[size_t(l)], int64_t(ctx), 2));
    const double attended = spec.indexer != IndexerKind::None ? std::min(ctx, double(c.index_topk)) : ctx;
    double attn_flops = T * mixer_flops_per_token(c, spec.mixer, attended);
    if (spec.indexer == IndexerKind::Own)
      attn_flops +=
          T * (ctx / double(std::max<int64_t>(1, c.index_kpool))) * double(c.index_n_heads * c.index_head_dim) * 2;
    const double dense_bytes = double(fp.dense_bytes[size_t(l)]) + kv_read;
    double gpu = std::max(dense_bytes / (m.hbm_gbps * 1e9), (2 * fp.dense_params[size_t(l)] * T + attn_flops) / (m.gpu_tflops * 1e12));
    est.hbm_bytes += dense_bytes;
    double gpu_experts = 0, fetch = 0, cpu = 0;
    const LayerPlacement& L = plan.layers.at(size_t(l));
    if (!L.home.empty()) {
      const uint64_t b = fp.expert_bytes[size_t(l)];
      const double params = fp.expert_params[size_t(l)];
      std::vector<double> p = layer_probability(c, usage, l);
      for (size_t e = 0; e < L.home.size(); ++e) {
        StepUse u = step_use(p[e], int64_t(T));
        switch (L.home[e]) {
          case ExpertHome::Pinned: case ExpertHome::Cached:
            gpu_experts += u.hit * m.gpu_s(b, params, u.tokens);
            est.hbm_bytes += u.hit * double(b);
            break;
          case ExpertHome::Fetch:
            fetch += u.hit * (m.fetch_s(b) + m.gpu_s(b, params, u.tokens));
            est.pcie_bytes += u.hit * double(b);
            break;
          case ExpertHome::Cpu:
            cpu += u.hit * m.cpu_s(b, params, u.tokens);
            est.host_bytes += u.hit * double(b);
            break;
        }
      }
    }
    const double cold = std::max(fetch, cpu);
    est.gpu_s += gpu + gpu_experts;
    est.cold_s += cold;
    est.seconds += gpu + std::max(gpu_experts, cold);
  }
  const double head = m.gpu_s(fp.head_bytes, fp.head_params, 1);
  est.gpu_s += head;
  est.seconds += head;
  est.hbm_bytes += double(fp.head_bytes);
  return est;
}

}  // namespace moesrv
