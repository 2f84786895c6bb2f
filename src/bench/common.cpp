#include "bench/common.h"

#include <fmt/format.h>

namespace moesrv::bench {

std::vector<int32_t> prompt_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (auto& v : t) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v = int32_t((s >> 33) % uint64_t(vocab));
  }
  return t;
}

std::string fmt_rate(double per_s) {
  return per_s >= 100 ? fmt::format("{:.0f}", per_s) : fmt::format("{:.2f}", per_s);
}

}  // namespace moesrv::bench
