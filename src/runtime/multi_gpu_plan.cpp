#include "runtime/multi_gpu_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "model/state.h"
#include "util/error.h"

namespace moesrv {

LayerSplitCosts layer_split_costs(const ModelSpec& c, const ModelFootprint& fp, int64_t context,
                                  const std::vector<int64_t>& resident_experts, int kv_elem_bytes) {
  LayerSplitCosts out;
  const int64_t L = c.num_layers;
  const std::vector<StateSpec> states = state_specs(c);
  for (int64_t l = 0; l < L; ++l) {
    const uint64_t kv = states[size_t(l)].bytes(std::max<int64_t>(context, 0), kv_elem_bytes);
    const uint64_t expert = size_t(l) < fp.expert_bytes.size() ? fp.expert_bytes[size_t(l)] : 0;
    const int64_t resident = size_t(l) < resident_experts.size() ? resident_experts[size_t(l)] : 0;
    const uint64_t dense = fp.dense_bytes[size_t(l)];
    out.vram_bytes.push_back(dense + kv + uint64_t(resident) * expert);
    // A token reads every dense weight, the whole cache, and its routed experts; only resident ones hit VRAM.
    const double hit = c.n_routed_experts > 0 ? double(resident) / double(c.n_routed_experts) : 0;
    out.read_bytes.push_back(double(dense) + double(kv) + double(c.experts_per_token) * hit * double(expert));
  }
  out.embed_bytes = fp.embed_bytes;
  out.head_bytes = fp.head_bytes;
  out.head_read_bytes = double(fp.head_bytes);
  return out;
}

double MultiGpuPlan::max_read_bytes() const {
  double m = 0;
  for (const auto& g : gpus) m = std::max(m, g.read_bytes);
  return m;
}

static std::string gib(uint64_t b) { return fmt::format("{:.2f} GiB", double(b) / double(kGiB)); }

std::string MultiGpuPlan::summary() const {
  if (!fits) return "does not fit: " + error;
  std::string s;
  for (const auto& g : gpus)
    s += fmt::format("GPU {}: layers [{}, {}){}{} {} of {} ({:.2f} GB read per token)\n", g.gpu, g.layer_begin,
                     g.layer_end, g.embed_bytes ? " +embed" : "", g.head_bytes ? " +lm_head" : "", gib(g.total()),
                     gib(g.budget), g.read_bytes / 1e9);
  return s;
}

MultiGpuPlan plan_layer_split(const LayerSplitCosts& costs, const std::vector<uint64_t>& budgets) {
  MultiGpuPlan plan;
  const int64_t L = int64_t(costs.vram_bytes.size()), N = int64_t(budgets.size());
  if (N == 0) fail("plan_layer_split: no GPUs");
  if (int64_t(costs.read_bytes.size()) != L) fail("plan_layer_split: cost vectors differ in length");
  if (N > L) {
    plan.error = fmt::format("{} GPUs but only {} layers: every GPU needs at least one layer", N, L);
    return plan;
  }
  std::vector<uint64_t> bytes_pre(size_t(L + 1), 0);
  std::vector<double> read_pre(size_t(L + 1), 0);
  for (int64_t l = 0; l < L; ++l) {
    bytes_pre[size_t(l + 1)] = bytes_pre[size_t(l)] + costs.vram_bytes[size_t(l)];
    read_pre[size_t(l + 1)] = read_pre[size_t(l)] + costs.read_bytes[size_t(l)];
  }
  auto share = [&](int64_t g, int64_t a, int64_t b) {
    GpuShare s;
    s.gpu = int(g);
    s.layer_begin = a;
    s.layer_end = b;
    s.layer_bytes = bytes_pre[size_t(b)] - bytes_pre[size_t(a)];
    s.embed_bytes = g == 0 ? costs.embed_bytes : 0;
    s.head_bytes = g == N - 1 ? costs.head_bytes : 0;
    s.workspace_bytes = costs.workspace_bytes;
    s.budget = budgets[size_t(g)];
    s.read_bytes = read_pre[size_t(b)] - read_pre[size_t(a)] + (g == N - 1 ? costs.head_read_bytes : 0);
    return s;
  };
  // DP over (GPU g, first b layers placed). Pass 1 minimises the slowest stage; pass 2, capped at that, minimises
  // the sum of squared stage times so the other stages are balanced too.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  auto solve = [&](bool squares, double cap, std::vector<std::vector<int64_t>>& from) {
    std::vector<std::vector<double>> best(size_t(N + 1), std::vector<double>(size_t(L + 1), kInf));
    from.assign(size_t(N + 1), std::vector<int64_t>(size_t(L + 1), -1));
    best[0][0] = 0;
    for (int64_t g = 0; g < N; ++g)
      for (int64_t a = g; a < L; ++a) {
        if (best[size_t(g)][size_t(a)] == kInf) continue;
        for (int64_t b = a + 1; b <= L - (N - 1 - g); ++b) {
          GpuShare s = share(g, a, b);
          if (s.total() > s.budget) break;  // more layers only add bytes
          if (s.read_bytes > cap) break;
          double v = squares ? best[size_t(g)][size_t(a)] + s.read_bytes * s.read_bytes
                             : std::max(best[size_t(g)][size_t(a)], s.read_bytes);
          if (v < best[size_t(g + 1)][size_t(b)]) {
            best[size_t(g + 1)][size_t(b)] = v;
            from[size_t(g + 1)][size_t(b)] = a;
          }
        }
      }
    return best[size_t(N)][size_t(L)];
  };
  std::vector<std::vector<int64_t>> from;
  const double slowest = solve(false, kInf, from);
  if (slowest == kInf) {
    uint64_t need = bytes_pre[size_t(L)] + costs.embed_bytes + costs.head_bytes + uint64_t(N) * costs.workspace_bytes, have = 0;
    for (uint64_t b : budgets) have += b;
    const uint64_t largest = *std::max_element(costs.vram_bytes.begin(), costs.vram_bytes.end());
    plan.error = need > have
        ? fmt::format("the model needs {} of VRAM (layers {}, embedding {}, lm_head {}, workspace {} per GPU) but the "
                      "{} GPU budgets total {}; lower --max-ctx, keep fewer experts resident, or add VRAM",
                      gib(need), gib(bytes_pre[size_t(L)]), gib(costs.embed_bytes), gib(costs.head_bytes),
                      gib(costs.workspace_bytes), N, gib(have))
        : fmt::format("{} of VRAM fits the {} budgets' total {}, but no split into contiguous layer ranges does "
                      "(largest layer {}; GPU 0 also holds the embedding {}, the last GPU the lm_head {}); "
                      "raise the smallest budget or lower --max-ctx",
                      gib(need), N, gib(have), gib(largest), gib(costs.embed_bytes), gib(costs.head_bytes));
    return plan;
  }
  solve(true, slowest * (1 + 1e-12), from);
  std::vector<GpuShare> rev;
  for (int64_t g = N, b = L; g > 0; --g) {
    const int64_t a = from[size_t(g)][size_t(b)];
    rev.push_back(share(g - 1, a, b));
    b = a;
  }
  plan.gpus.assign(rev.rbegin(), rev.rend());
  plan.fits = true;
  return plan;
}

std::vector<uint64_t> vram_budgets_for(const std::vector<double>& gib, int gpus) {
  if (gpus < 1) fail("--gpus {}: expected at least 1", gpus);
  if (gib.size() != 1 && int(gib.size()) != gpus)
    fail("--vram-budget: {} values for {} GPUs (give one for all or one per GPU)", gib.size(), gpus);
  std::vector<uint64_t> out;
  for (int g = 0; g < gpus; ++g) {
    double v = gib.size() == 1 ? gib[0] : gib[size_t(g)];
    if (!(v > 0)) fail("--vram-budget: GPU {} budget must be > 0 GiB (got {})", g, v);
    out.push_back(uint64_t(v * double(kGiB)));
  }
  return out;
}

}  // namespace moesrv
