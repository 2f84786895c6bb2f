#include "backend/cold_split.h"

#include <algorithm>

namespace moesrv {

size_t split_cold(std::vector<ColdCost>& cold, bool can_fetch) {
  auto ratio = [](const ColdCost& c) { return c.fetch_s > 0 ? c.cpu_s / c.fetch_s : 0.0; };
  std::stable_sort(cold.begin(), cold.end(), [&](const ColdCost& a, const ColdCost& z) { return ratio(a) > ratio(z); });
  double cpu_total = 0;
  for (const ColdCost& x : cold) cpu_total += x.cpu_s;
  size_t best_k = 0;
  double fetch_sum = 0, cpu_rest = cpu_total, best = cpu_total, best_sum = cpu_total;
  for (size_t k = 1; can_fetch && k <= cold.size(); ++k) {
    fetch_sum += cold[k - 1].fetch_s;
    cpu_rest -= cold[k - 1].cpu_s;
    const double worst = std::max(fetch_sum, cpu_rest), sum = fetch_sum + cpu_rest;
    if (worst < best - 1e-15 || (worst <= best + 1e-15 && sum < best_sum)) best = worst, best_sum = sum, best_k = k;
  }
  return best_k;
}

}  // namespace moesrv
