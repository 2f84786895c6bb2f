// Per-layer LRU of routed experts over a fixed number of VRAM slots, some of which may be lent (usable only at times),
// the victim optionally the least used of the least recent few. Pure bookkeeping: it hands out slot indices; the GPU
// engine maps (layer, slot) to device buffers. Pinned experts hold their slot forever.
// Thread-safe for a decode thread (lookup/retain/release) racing a copy thread (admit); one mutex per layer.
#pragma once
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace moesrv {

struct ExpertCacheStats {
  uint64_t hits = 0, misses = 0, evictions = 0, admissions = 0;
  double hit_rate() const { return hits + misses ? double(hits) / double(hits + misses) : 0.0; }
};

struct Admission {
  int32_t slot = -1;
  int32_t evicted = -1;  // expert that lost the slot, -1 when the slot was free
};

class ExpertCache {
 public:
  // slots_per_layer[l] VRAM slots for layer l (0: nothing cached), `experts` routed experts per layer. The last
  // lendable_per_layer[l] of a layer's slots (none where not given) are lent: memory the engine has only at times.
  // They start withdrawn (never handed out); lend() makes them free slots, withdraw() takes them back.
  ExpertCache(const std::vector<int32_t>& slots_per_layer, int32_t experts,
              const std::vector<int32_t>& lendable_per_layer = {});

  int32_t layers() const { return int32_t(layers_.size()); }
  int32_t slots(int32_t layer) const { return layer_(layer).slots; }

  // Puts `expert` in a free slot for good (start-up). Throws when the layer has no free slot.
  int32_t pin(int32_t layer, int32_t expert);
  // Hit: the expert's slot (marked most recently used). Miss: nullopt. Counts either.
  std::optional<int32_t> lookup(int32_t layer, int32_t expert);
  // Like lookup but without touching LRU order or statistics.
  std::optional<int32_t> peek(int32_t layer, int32_t expert) const;
  // Gives `expert` a slot: a free one, else the least recently used unpinned, unretained one (evicted).
  // nullopt when every slot is pinned or retained; an expert already present keeps its slot (evicted = -1).
  // stream_window > 0: a pass that scans more experts than the layer holds (prefill walks all of them in expert
  // order, pass after pass). Once `stream_window` experts have been admitted since end_stream(), the victim is the
  // oldest of those instead of the LRU one, so the experts cached before the scan stay for the next one (an LRU over
  // a cyclic scan evicts every expert just before its reuse). The window keeps that many copies in flight.
  std::optional<Admission> admit(int32_t layer, int32_t expert, int32_t stream_window = 0);
  // Ends a streaming pass of `layer`: its admissions become ordinary LRU entries.
  void end_stream(int32_t layer);
  // While retained (e.g. a kernel reads it), an expert's slot is never chosen as a victim.
  void retain(int32_t layer, int32_t expert);
  // lookup + retain under one lock: the slot stays valid until release(), even while a copy thread admits.
  std::optional<int32_t> acquire(int32_t layer, int32_t expert);
  void release(int32_t layer, int32_t expert);
  // Drops a resident expert that is neither pinned nor retained: its slot becomes free (its memory's content no
  // longer counts as that expert). Returns whether it did.
  bool forget(int32_t layer, int32_t expert);

  // The layer's lent slots join its free slots (no-op while lent).
  void lend(int32_t layer);
  // Empties the layer's lent slots and takes them back (no-op while withdrawn): returns the experts they held, now
  // misses. Throws if one of them is pinned or retained.
  std::vector<int32_t> withdraw(int32_t layer);
  // Slots the layer can hand out now: all of them while lent, the others while withdrawn.
  int32_t usable_slots(int32_t layer) const;
  // Victims outside a streaming pass: 1 (the default) the least recently used unretained expert; n > 1 the least
  // used (lookups, halved every 16 lookups per expert of the layer) of the n least recently used unretained ones,
  // ties to the less recent. With skewed routing this keeps the often-routed experts over the once-routed ones.
  void set_victim_window(int32_t n);

  bool is_pinned(int32_t layer, int32_t expert) const;
  // Experts from least to most recently used (unpinned only): for tests and debugging.
  std::vector<int32_t> lru_order(int32_t layer) const;

  ExpertCacheStats stats(int32_t layer) const;
  ExpertCacheStats total_stats() const;
  void reset_stats();

 private:
  std::optional<int32_t> find(int32_t layer, int32_t expert, bool retain);
  struct Layer {
    int32_t slots = 0;
    int32_t lendable = 0;  // the last `lendable` slots are lent ones
    bool lent = false;
    std::vector<int32_t> slot_of;                   // [experts] -> slot or -1
    std::vector<int32_t> expert_in;                 // [slots] -> expert or -1
    std::vector<uint8_t> pinned;                    // [experts]
    std::vector<int32_t> retained;                  // [experts] retain count
    std::list<int32_t> lru;                         // unpinned resident experts, front = least recent
    std::vector<std::list<int32_t>::iterator> pos;  // [experts] position in lru
    std::vector<int32_t> free_slots;
    std::deque<int32_t> streamed;  // admitted by the current streaming pass, oldest first
    std::vector<uint32_t> uses;    // [experts] lookups, halved every 16 * experts lookups of the layer
    int64_t lookups = 0;
    ExpertCacheStats stats;
    mutable std::mutex mu;
  };
  Layer& layer_(int32_t l);
  const Layer& layer_(int32_t l) const;
  void check_expert(int32_t e) const;

  int32_t experts_;
  int32_t victim_window_ = 1;
  std::vector<std::unique_ptr<Layer>> layers_;
};

}  // namespace moesrv
