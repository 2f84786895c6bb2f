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

}  // namespace moesrv
