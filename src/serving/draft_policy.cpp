#include "serving/draft_policy.h"

#include <algorithm>

#include "util/error.h"

namespace moesrv {

DraftPolicy::DraftPolicy(int max_k)
    : max_k_(max_k), accept_(size_t(max_k) + 1), cost_(size_t(max_k) + 1), seen_(size_t(max_k) + 1, 0) {
  if (max_k < 1) fail("draft policy: {} draft tokens (at least 1)", max_k);
}

int DraftPolicy::next() {
  const std::lock_guard lock(mu_);
  if (seen_[size_t(max_k_)] < kWarmupSteps) return max_k_;  // what was asked for first, then plain steps
  if (seen_[0] < kWarmupSteps) return 0;
  const int b = best();
  ++steps_;
  if (b == max_k_ || steps_ < next_probe_) return b;
  probe_k_ = b + 1;
  next_probe_ = steps_ + probe_interval_;  // (until the probe's outcome sets it)
  return probe_k_;
}

void DraftPolicy::record(int k, int64_t accepted, double seconds) {
  if (k < 0 || k > max_k_ || accepted < 0 || accepted > k) fail("draft policy: {} of {} drafts accepted", accepted, k);
  const std::lock_guard lock(mu_);
  if (++seen_[size_t(k)] > 1) cost_[size_t(k)].add(seconds);  // the first step of a k captures its graphs
  for (int j = 1; j <= k && j <= accepted + 1; ++j) accept_[size_t(j)].add(j <= accepted ? 1.0 : 0.0);
  if (probe_k_ >= 0) {  // a probe that kept every draft asks for more probes; one that did not, for fewer
    if (k == probe_k_)
      probe_interval_ = accepted == k ? kProbePeriod : std::min<int64_t>(2 * probe_interval_, kMaxProbePeriod);
    next_probe_ = steps_ + probe_interval_;
    probe_k_ = -1;
  }
}

double DraftPolicy::acceptance(int j) const {
  const std::lock_guard lock(mu_);
  double a = 0.5;  // prior of the first draft; a deeper draft not yet seen is taken as likely as the one before
  for (int i = 1; i <= std::min(j, max_k_); ++i) a = accept_[size_t(i)].mean(a);
  return a;
}

double DraftPolicy::cost(int k) const {
  if (cost_[size_t(k)].weight > 0) return cost_[size_t(k)].mean(0);
  int lo = k - 1, hi = k + 1;
  while (lo >= 0 && cost_[size_t(lo)].weight == 0) --lo;
  while (hi <= max_k_ && cost_[size_t(hi)].weight == 0) ++hi;
  if (lo < 0 || hi > max_k_) return -1;  // (warm-up measures 0 and max_k)
  const double c0 = cost_[size_t(lo)].mean(0), c1 = cost_[size_t(hi)].mean(0);
  return c0 + (c1 - c0) * double(k - lo) / double(hi - lo);
}

double DraftPolicy::expected_tokens(int k) const {
  double tokens = 1, p = 1, a = 0.5;
  for (int j = 1; j <= k; ++j) {
    a = accept_[size_t(j)].mean(a);
    p *= a;
    tokens += p;
  }
  return tokens;
}

int DraftPolicy::best() const {
  int b = max_k_;
  double best_rate = -1;
  for (int k = 0; k <= max_k_; ++k) {
    const double c = cost(k);
    if (c <= 0) continue;
    const double rate = expected_tokens(k) / c;
    if (rate > best_rate) best_rate = rate, b = k;
  }
  return b;
}

double DraftPolicy::step_seconds(int k) const {
  const std::lock_guard lock(mu_);
  return k < 0 || k > max_k_ ? -1 : cost(k);
}

double DraftPolicy::tokens_per_second(int k) const {
  const std::lock_guard lock(mu_);
  if (k < 0 || k > max_k_) return -1;
  const double c = cost(k);
  return c > 0 ? expected_tokens(k) / c : -1;
}

int DraftPolicy::choice() const {
  const std::lock_guard lock(mu_);
  return best();
}

}  // namespace moesrv
