#include "serving/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace moesrv {

namespace {
// A mask shorter than the logits (a tokenizer smaller than the model's padded vocabulary) disallows the rest.
bool ok(const std::vector<uint8_t>* allowed, size_t i) { return !allowed || (i < allowed->size() && (*allowed)[i]); }
}  // namespace

int32_t argmax(std::span<const float> logits, const std::vector<uint8_t>* allowed) {
  int32_t best = -1;
  float best_v = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < logits.size(); ++i) {
    if (!ok(allowed, i)) continue;
    if (best < 0 || logits[i] > best_v) best = int32_t(i), best_v = logits[i];
  }
  return best;
}

Sampler::Sampler(SamplingParams params) : params_(params), rng_(params.seed ? *params.seed : std::random_device{}()) {}

double Sampler::distribution(std::span<const float> logits, const std::vector<uint8_t>* allowed) {
  candidates_.clear();
  if (greedy()) return 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (!ok(allowed, i)) continue;
    if (std::isfinite(logits[i])) candidates_.emplace_back(logits[i], int32_t(i));
  }
  if (candidates_.empty()) return 0;
  auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first; };
  size_t keep = candidates_.size();
  if (params_.top_k > 0 && size_t(params_.top_k) < keep) {
    keep = size_t(params_.top_k);
    std::partial_sort(candidates_.begin(), candidates_.begin() + keep, candidates_.end(), by_logit);
    candidates_.resize(keep);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), by_logit);
  }
  // Softmax at temperature over the kept candidates (sorted, so max is first).
  float inv_t = 1.0f / params_.temperature, max_logit = candidates_[0].first;
  double total = 0;
  for (auto& c : candidates_) total += (c.first = std::exp((c.first - max_logit) * inv_t));
  if (params_.top_p < 1.0f) {
    double cum = 0, limit = params_.top_p * total;
    size_t n = 0;
    while (n < candidates_.size() && cum < limit) cum += candidates_[n++].first;
    candidates_.resize(std::max<size_t>(n, 1));
    total = cum > 0 ? cum : candidates_[0].first;
  }
  return total;
}

int32_t Sampler::sample(std::span<const float> logits, const std::vector<uint8_t>* allowed) {
  int32_t best = argmax(logits, allowed);
  if (best < 0) return argmax(logits);  // mask excluded everything: ignore it rather than emit garbage
  const double total = distribution(logits, allowed);
  if (total <= 0) return best;
  double r = std::uniform_real_distribution<double>(0.0, total)(rng_);
  for (auto& c : candidates_) {
    if ((r -= c.first) <= 0) return c.second;
  }
  return candidates_.back().second;
}

int32_t Sampler::accept_draft(std::span<const float> logits, int32_t draft, const std::vector<uint8_t>* allowed) {
  int32_t best = argmax(logits, allowed);
  if (best < 0) return argmax(logits);
  const double total = distribution(logits, allowed);
  if (total <= 0) return best;
  double p_draft = 0;
  for (const auto& c : candidates_)
    if (c.second == draft) p_draft = c.first;
  if (std::uniform_real_distribution<double>(0.0, total)(rng_) < p_draft) return draft;
  // The residual max(0, p - q): p with the draft's mass removed.
  const double rest = total - p_draft;
  if (rest <= 0) return draft;
  double r = std::uniform_real_distribution<double>(0.0, rest)(rng_);
  int32_t last = draft;
  for (auto& c : candidates_) {
    if (c.second == draft) continue;
    last = c.second;
    if ((r -= c.first) <= 0) return c.second;
  }
  return last;
}

TokenLogprobs token_logprobs(std::span<const float> logits, int32_t token, int top) {
  TokenLogprobs r;
  if (logits.empty()) return r;
  float mx = -std::numeric_limits<float>::infinity();
  for (float v : logits) mx = std::max(mx, v);
  double sum = 0;
  for (float v : logits) sum += std::exp(double(v) - mx);
  float lse = float(mx + std::log(sum));
  if (token >= 0 && size_t(token) < logits.size()) r.logprob = logits[size_t(token)] - lse;
  size_t k = std::min(size_t(std::max(top, 0)), logits.size());
  if (k) {
    std::vector<int32_t> ids(logits.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i);
    std::partial_sort(ids.begin(), ids.begin() + long(k), ids.end(), [&](int32_t a, int32_t b) {
      return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
    });
    for (size_t i = 0; i < k; ++i) r.top.push_back({ids[i], logits[size_t(ids[i])] - lse});
  }
  return r;
}

}  // namespace moesrv
