// Reuses engine state across requests: keeps SequenceState snapshots keyed by the exact token sequence they
// hold and hands out the one sharing the longest prefix with a new prompt. LRU eviction keeps the sum of
// SequenceState::bytes() under a bound. Entries are few (each is a whole KV cache), so lookup is a linear
// scan comparing token arrays — cheaper than maintaining a radix tree and exact at any divergence point.
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <vector>

#include "backend/engine.h"

namespace moesrv {

class PrefixCache {
 public:
  explicit PrefixCache(size_t max_bytes) : max_bytes_(max_bytes) {}

  struct Hit {
    std::unique_ptr<SequenceState> state;  // holds exactly `reused` tokens (already truncated)
    int64_t reused = 0;
  };
  // Returns a state holding the longest cached prefix of `tokens` that the state can resume from (any length for
  // KV caches, a checkpoint for recurrent state), at most `max_reuse` tokens long (callers
  // pass prompt length - 1 so at least one token is left to produce logits). An entry fully consumed by the
  // prompt is moved out (no copy; the caller re-inserts the extended state); a partial match is cloned.
  Hit acquire(const std::vector<int32_t>& tokens, int64_t max_reuse);
  // Stores `state` holding `tokens` (state->length() == tokens.size()). Entries that are a prefix of it are
  // dropped as redundant. Evicts least recently used entries beyond the memory bound.
  void insert(std::vector<int32_t> tokens, std::unique_ptr<SequenceState> state);

  size_t bytes() const;
  size_t entries() const;
  size_t max_bytes() const { return max_bytes_; }
  void clear();

 private:
  struct Entry {
    std::vector<int32_t> tokens;
    std::unique_ptr<SequenceState> state;
    size_t bytes = 0;
  };
  void evict_locked();
  size_t max_bytes_;
  size_t bytes_ = 0;
  std::list<Entry> lru_;  // front = most recently used
  mutable std::mutex mu_;
};

}  // namespace moesrv
