// How many MTP draft tokens the next speculative step should verify (0..k), learnt from what the steps cost and how
// often drafts are accepted: the choice that commits the most tokens per second. With nothing accepted it settles on
// 0 (a plain decode step, the MTP block's catch-up deferred) and now and then probes one draft more than its choice
// (every kProbePeriod steps after a probe whose drafts were all accepted, twice as far apart after each one that was
// not, up to kMaxProbePeriod), so speculation never costs much more than plain decoding; with high acceptance it
// drafts all k.
#pragma once
#include <cstdint>
#include <mutex>
#include <vector>

namespace moesrv {

class DraftPolicy {
 public:
  static constexpr int kProbePeriod = 16;      // steps between probes of one more draft than the choice: at least
  static constexpr int kMaxProbePeriod = 256;  // and at most
  static constexpr int kWarmupSteps = 2;       // steps of k and of 0 at the start (the first of each is not timed)
  static constexpr double kDecay = 0.9;        // weight of the past per new observation (~10 steps of memory)

  explicit DraftPolicy(int max_k);

  int max_k() const { return max_k_; }
  // Draft tokens for the next step.
  int next();
  // What a step with `k` drafts did: `accepted` of them kept, `seconds` of model forward and drafting (without any
  // deferred catch-up of the MTP block).
  void record(int k, int64_t accepted, double seconds);

  // Estimates (for /metrics and tests): the probability that draft j (1-based) is accepted when drafts 1..j-1 were,
  // seconds of a step of k drafts (< 0: not measured yet), committed tokens per second of a step of k drafts.
  double acceptance(int j) const;
  double step_seconds(int k) const;
  double tokens_per_second(int k) const;
  int choice() const;  // the k that commits the most tokens per second now (warm-up and probes aside)

 private:
  struct Decayed {  // a decayed mean
    double sum = 0, weight = 0;
    void add(double x) { sum = kDecay * sum + x, weight = kDecay * weight + 1; }
    double mean(double otherwise) const { return weight > 0 ? sum / weight : otherwise; }
  };
  double cost(int k) const;  // measured, or interpolated between the measured k
  double expected_tokens(int k) const;
  int best() const;

  const int max_k_;
  mutable std::mutex mu_;
  std::vector<Decayed> accept_;  // [max_k + 1], index j: draft j given 1..j-1 accepted (prior: one half-accept)
  std::vector<Decayed> cost_;    // [max_k + 1]
  std::vector<int> seen_;        // steps recorded per k (the first is not timed)
  int64_t steps_ = 0;            // steps chosen after the warm-up
  int64_t probe_interval_ = kProbePeriod, next_probe_ = kProbePeriod;
  int probe_k_ = -1;  // the k of a probe handed out and not yet recorded
};

}  // namespace moesrv
