// Top-k selection with PyTorch's CPU tie order. DSA indexer scores are ReLU sums and tie at exactly 0 often
// (models with few indexer heads); transformers' choice among tied keys comes from torch.topk's algorithm, so
// the same algorithm reproduces it: a heap of k when k * 64 <= n, else nth_element over the whole row.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace moesrv::cpu {

// ranked: (score, index) for every candidate of the row, in index order (masked ones scored -inf). Writes the
// selected indices below n_valid (masked candidates that fill up k are dropped, as attention never reads them).
inline void topk_like_torch(std::vector<std::pair<float, int64_t>>& ranked, int64_t k, int64_t n_valid,
                            std::vector<int32_t>& out) {
  out.clear();
  k = std::min<int64_t>(k, int64_t(ranked.size()));
  if (k <= 0) return;
  auto greater = [](const std::pair<float, int64_t>& x, const std::pair<float, int64_t>& y) { return x.first > y.first; };
  if (k * 64 <= int64_t(ranked.size())) {
    std::make_heap(ranked.begin(), ranked.begin() + k, greater);
    for (size_t i = size_t(k); i < ranked.size(); ++i)
      if (greater(ranked[i], ranked[0])) {
        auto v = ranked[i];
        std::pop_heap(ranked.begin(), ranked.begin() + k, greater);
        ranked[size_t(k - 1)] = v;
        std::push_heap(ranked.begin(), ranked.begin() + k, greater);
      }
  } else {
    std::nth_element(ranked.begin(), ranked.begin() + k - 1, ranked.end(), greater);
  }
  for (int64_t i = 0; i < k; ++i)
    if (ranked[size_t(i)].second < n_valid) out.push_back(int32_t(ranked[size_t(i)].second));
}

}  // namespace moesrv::cpu
