#include "serving/prefix_cache.h"

#include <algorithm>

namespace moesrv {

static int64_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  auto [ia, ib] = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  return int64_t(ia - a.begin());
}

PrefixCache::Hit PrefixCache::acquire(const std::vector<int32_t>& tokens, int64_t max_reuse) {
  std::lock_guard lock(mu_);
  auto best = lru_.end();
  int64_t best_len = 0;
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    // A recurrent state resumes only where it was checkpointed: the longest such point within the match.
    int64_t n = it->state->resume_point(std::min(common_prefix(it->tokens, tokens), max_reuse));
    if (n > best_len) best = it, best_len = n;
  }
  Hit hit;
  if (best == lru_.end()) return hit;
  try {
    if (best_len == int64_t(best->tokens.size())) {  // fully reused: take it, the caller extends it
      hit.state = std::move(best->state);
      bytes_ -= best->bytes;
      lru_.erase(best);
    } else {
      hit.state = best->state->clone();
      hit.state->truncate(best_len);
      lru_.splice(lru_.begin(), lru_, best);
    }
    hit.reused = best_len;
  } catch (...) {  // a state that cannot be cloned or truncated is a miss
    hit = Hit{};
  }
  return hit;
}

void PrefixCache::insert(std::vector<int32_t> tokens, std::unique_ptr<SequenceState> state) {
  if (!state || tokens.empty() || int64_t(tokens.size()) != state->length()) return;
  size_t b = state->bytes();
  std::lock_guard lock(mu_);
  if (b > max_bytes_) return;
  for (auto it = lru_.begin(); it != lru_.end();) {
    bool redundant =
        it->tokens.size() <= tokens.size() && common_prefix(it->tokens, tokens) == int64_t(it->tokens.size());
    if (redundant) {
      bytes_ -= it->bytes;
      it = lru_.erase(it);
    } else {
      ++it;
    }
  }
  lru_.push_front(Entry{std::move(tokens), std::move(state), b});
  bytes_ += b;
  evict_locked();
}

void PrefixCache::evict_locked() {
  while (bytes_ > max_bytes_ && !lru_.empty()) {
    bytes_ -= lru_.back().bytes;
    lru_.pop_back();
  }
}

size_t PrefixCache::bytes() const {
  std::lock_guard lock(mu_);
  return bytes_;
}

size_t PrefixCache::entries() const {
  std::lock_guard lock(mu_);
  return lru_.size();
}

void PrefixCache::clear() {
  std::lock_guard lock(mu_);
  lru_.clear();
  bytes_ = 0;
}

}  // namespace moesrv
