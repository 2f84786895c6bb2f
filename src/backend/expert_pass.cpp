#include "backend/expert_pass.h"

#include <algorithm>
#include <tuple>

#include "util/error.h"

namespace moesrv {

ExpertPass plan_expert_pass(const int32_t* ids, int64_t tokens, int64_t k, const std::vector<ExpertWhere>& where,
                            const std::function<ColdCost(int32_t expert, int64_t tokens)>& cold_cost, bool can_fetch) {
  const int64_t E = int64_t(where.size());
  ExpertPass p;
  p.by_expert.resize(size_t(E));
  for (int64_t i = 0; i < tokens * k; ++i) {
    if (ids[i] < 0 || ids[i] >= E) fail("MoE pass: selection {} names expert {} of {}", i, ids[i], E);
    p.by_expert[size_t(ids[i])].push_back(int32_t(i));
  }
  std::vector<uint8_t> on_gpu(size_t(E), 0);
  std::vector<ColdCost> cold;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = int64_t(p.by_expert[size_t(e)].size());
    if (!n) continue;
    if (where[size_t(e)] == ExpertWhere::Gpu) on_gpu[size_t(e)] = 1;
    else if (where[size_t(e)] == ExpertWhere::Cold) cold.push_back(cold_cost(int32_t(e), n));
  }
  const size_t fetch = split_cold(cold, can_fetch);
  for (size_t i = 0; i < fetch; ++i) {
    on_gpu[size_t(cold[i].id)] = 1;
    p.streamed.push_back(cold[i].id);
  }
  p.rowmap.assign(size_t(tokens * k), -1);
  for (int64_t e = 0; e < E; ++e) {
    const auto& entries = p.by_expert[size_t(e)];
    if (entries.empty()) continue;
    if (!on_gpu[size_t(e)]) {
      p.cpu_experts.push_back(int32_t(e));
      continue;
    }
    p.gpu_runs.push_back({int32_t(e), int32_t(p.sorted_tok.size())});
    for (int32_t i : entries) {
      p.rowmap[size_t(i)] = int32_t(p.sorted_tok.size());
      p.sorted_tok.push_back(i / int32_t(k));
    }
  }
  return p;
}

void order_gpu_runs(ExpertPass& p, int64_t k, const std::function<int(int32_t expert)>& rank) {
  std::stable_sort(p.gpu_runs.begin(), p.gpu_runs.end(),
                   [&](const auto& a, const auto& b) { return rank(a.first) < rank(b.first); });
  p.sorted_tok.clear();
  for (auto& [e, row0] : p.gpu_runs) {
    row0 = int32_t(p.sorted_tok.size());
    for (int32_t i : p.by_expert[size_t(e)]) {
      p.rowmap[size_t(i)] = int32_t(p.sorted_tok.size());
      p.sorted_tok.push_back(i / int32_t(k));
    }
  }
}

std::vector<int32_t> plan_prefetch(const int32_t* picks, int64_t tokens, int64_t k, int64_t limit,
                                   const std::function<bool(int32_t expert)>& fetchable) {
  struct Pick {
    int32_t expert;
    int64_t count, best_rank;
  };
  std::vector<Pick> seen;  // a few tokens' picks: a linear scan is enough
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = picks[t * k + j];
      if (e < 0) fail("prefetch: token {} pick {} names expert {}", t, j, e);
      auto it = std::find_if(seen.begin(), seen.end(), [&](const Pick& p) { return p.expert == e; });
      if (it == seen.end()) seen.push_back({e, 1, j});
      else ++it->count, it->best_rank = std::min(it->best_rank, j);
    }
  std::sort(seen.begin(), seen.end(), [](const Pick& a, const Pick& b) {
    return std::make_tuple(-a.count, a.best_rank, a.expert) < std::make_tuple(-b.count, b.best_rank, b.expert);
  });
  std::vector<int32_t> out;
  for (const Pick& p : seen) {
    if (int64_t(out.size()) >= limit) break;
    if (fetchable(p.expert)) out.push_back(p.expert);
  }
  return out;
}

}  // namespace moesrv
