// The resume points of one sequence's fixed-size state (recurrent, conv, open k-pool): copies of that state at
// given lengths, ascending, at most `cap` of them (the oldest dropped first), immutable and shared by clones. The
// CPU (host copies) and CUDA (device copies) sequences keep theirs in one of these.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

namespace moesrv {

template <class Saved>
class CheckpointList {
 public:
  explicit CheckpointList(size_t cap) : cap_(cap < 1 ? 1 : cap) {}

  // Whether a checkpoint at `length` would be new (none yet at that length).
  bool wants(int64_t length) const { return length > 0 && (items_.empty() || items_.back().length != length); }
  // Drops the oldest while the list is full: call before building the next copy (device memory is freed first).
  void make_room() {
    while (items_.size() >= cap_) items_.erase(items_.begin());
  }
  void push(int64_t length, std::shared_ptr<const Saved> saved) {
    make_room();
    items_.push_back({length, std::move(saved)});
  }
  const Saved* at(int64_t length) const {
    for (const auto& it : items_)
      if (it.length == length) return it.saved.get();
    return nullptr;
  }
  // The longest checkpointed length <= n (0 when none).
  int64_t latest_at_or_before(int64_t n) const {
    int64_t best = 0;
    for (const auto& it : items_)
      if (it.length <= n && it.length > best) best = it.length;
    return best;
  }
  void drop_after(int64_t n) {
    while (!items_.empty() && items_.back().length > n) items_.pop_back();
  }
  template <class F>
  void for_each(F&& f) const {
    for (const auto& it : items_) f(it.length, *it.saved);
  }
  size_t size() const { return items_.size(); }
  size_t cap() const { return cap_; }

 private:
  struct Item {
    int64_t length;
    std::shared_ptr<const Saved> saved;
  };
  size_t cap_;
  std::vector<Item> items_;
};

// Where a sequence can resume (truncate to), one rule for the CPU and CUDA sequences. Growing state (KV rows, pooled
// keys) cuts anywhere; fixed-size state (recurrent, conv, the open k-pool) only at 0, the current length, a rollback
// point of the last forward (lengths in (steps_from, steps_end)), a checkpoint, or, without recurrent state, at a
// multiple of the k-pool (the open pool is empty there).
struct ResumeRule {
  bool fixed_state = false;  // some layer keeps state that per-token truncation cannot rewind
  bool recurrent = false;    // some of it is a recurrence (not only the open k-pool)
  int64_t pool = 1;          // index_kpool

  template <class Saved>
  bool resumable(int64_t n, int64_t length, int64_t steps_from, int64_t steps_end,
                 const CheckpointList<Saved>& checkpoints) const {
    if (n == length || n == 0 || !fixed_state) return true;
    if (n > steps_from && n < steps_end) return true;
    if (!recurrent && pool > 1 && n % pool == 0) return true;
    return checkpoints.at(n) != nullptr;
  }
  // n itself when resumable, else the nearest earlier length that is (n capped at length).
  template <class Saved>
  int64_t point(int64_t n, int64_t length, int64_t steps_from, int64_t steps_end,
                const CheckpointList<Saved>& checkpoints) const {
    n = n < length ? n : length;
    if (resumable(n, length, steps_from, steps_end, checkpoints)) return n;
    int64_t best = checkpoints.latest_at_or_before(n);
    if (!recurrent && pool > 1 && n / pool * pool > best) best = n / pool * pool;
    return best;
  }
};

}  // namespace moesrv
