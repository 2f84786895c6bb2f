#include "backend/expert_cache.h"

#include "util/error.h"

namespace moesrv {

ExpertCache::ExpertCache(const std::vector<int32_t>& slots_per_layer, int32_t experts,
                         const std::vector<int32_t>& lendable_per_layer)
    : experts_(experts) {
  if (experts <= 0) fail("expert cache: {} experts per layer", experts);
  if (!lendable_per_layer.empty() && lendable_per_layer.size() != slots_per_layer.size())
    fail("expert cache: lent slots of {} layers for {} layers", lendable_per_layer.size(), slots_per_layer.size());
  for (size_t l = 0; l < slots_per_layer.size(); ++l) {
    const int32_t s = slots_per_layer[l], lendable = lendable_per_layer.empty() ? 0 : lendable_per_layer[l];
    if (s < 0 || s > experts) fail("expert cache: {} slots for a layer of {} experts", s, experts);
    if (lendable < 0 || lendable > s) fail("expert cache: {} lent slots of {} in layer {}", lendable, s, l);
    auto L = std::make_unique<Layer>();
    L->slots = s;
    L->lendable = lendable;
    L->slot_of.assign(size_t(experts), -1);
    L->expert_in.assign(size_t(s), -1);
    L->pinned.assign(size_t(experts), 0);
    L->retained.assign(size_t(experts), 0);
    L->uses.assign(size_t(experts), 0);
    L->pos.resize(size_t(experts));
    for (int32_t i = s - lendable - 1; i >= 0; --i) L->free_slots.push_back(i);  // hand out slot 0 first
    layers_.push_back(std::move(L));
  }
}

ExpertCache::Layer& ExpertCache::layer_(int32_t l) {
  if (l < 0 || l >= int32_t(layers_.size())) fail("expert cache: layer {} out of range [0, {})", l, layers_.size());
  return *layers_[size_t(l)];
}
const ExpertCache::Layer& ExpertCache::layer_(int32_t l) const { return const_cast<ExpertCache*>(this)->layer_(l); }

void ExpertCache::check_expert(int32_t e) const {
  if (e < 0 || e >= experts_) fail("expert cache: expert {} out of range [0, {})", e, experts_);
}

int32_t ExpertCache::pin(int32_t layer, int32_t expert) {
  check_expert(expert);
  Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  const size_t e = size_t(expert);
  if (L.pinned[e]) return L.slot_of[e];
  if (L.slot_of[e] >= 0) {  // resident via LRU: keep its slot, leave the LRU list
    L.lru.erase(L.pos[e]);
  } else {
    if (L.free_slots.empty()) fail("expert cache: layer {} has no free slot to pin expert {}", layer, expert);
    L.slot_of[e] = L.free_slots.back();
    L.free_slots.pop_back();
    L.expert_in[size_t(L.slot_of[e])] = expert;
  }
  L.pinned[e] = 1;
  return L.slot_of[e];
}

std::optional<int32_t> ExpertCache::lookup(int32_t layer, int32_t expert) { return find(layer, expert, false); }

std::optional<int32_t> ExpertCache::acquire(int32_t layer, int32_t expert) { return find(layer, expert, true); }

std::optional<int32_t> ExpertCache::find(int32_t layer, int32_t expert, bool retain) {
  check_expert(expert);
  Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  const size_t e = size_t(expert);
  ++L.uses[e];
  if (++L.lookups >= int64_t(16) * experts_) {
    for (uint32_t& u : L.uses) u /= 2;
    L.lookups = 0;
  }
  if (L.slot_of[e] < 0) {
    ++L.stats.misses;
    return std::nullopt;
  }
  ++L.stats.hits;
  if (!L.pinned[e]) L.lru.splice(L.lru.end(), L.lru, L.pos[e]);
  if (retain) ++L.retained[e];
  return L.slot_of[e];
}

std::optional<int32_t> ExpertCache::peek(int32_t layer, int32_t expert) const {
  check_expert(expert);
  const Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  int32_t s = L.slot_of[size_t(expert)];
  return s < 0 ? std::nullopt : std::optional<int32_t>(s);
}

std::optional<Admission> ExpertCache::admit(int32_t layer, int32_t expert, int32_t stream_window) {
  check_expert(expert);
  Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  const size_t e = size_t(expert);
  if (L.slot_of[e] >= 0) {
    if (!L.pinned[e]) L.lru.splice(L.lru.end(), L.lru, L.pos[e]);
    return Admission{L.slot_of[e], -1};
  }
  Admission a;
  if (!L.free_slots.empty()) {
    a.slot = L.free_slots.back();
    L.free_slots.pop_back();
  } else {
    auto victim = L.lru.end();
    if (stream_window > 0 && int32_t(L.streamed.size()) >= stream_window)
      for (int32_t s : L.streamed)
        if (L.retained[size_t(s)] == 0) {
          victim = L.pos[size_t(s)];
          break;
        }
    if (victim == L.lru.end()) {
      victim = L.lru.begin();
      while (victim != L.lru.end() && L.retained[size_t(*victim)] > 0) ++victim;
      int32_t seen = 1;
      for (auto it = victim; victim != L.lru.end() && seen < victim_window_ && ++it != L.lru.end();) {
        if (L.retained[size_t(*it)] > 0) continue;
        ++seen;
        if (L.uses[size_t(*it)] < L.uses[size_t(*victim)]) victim = it;
      }
    }
    if (victim == L.lru.end()) return std::nullopt;
    a.evicted = *victim;
    a.slot = L.slot_of[size_t(a.evicted)];
    L.slot_of[size_t(a.evicted)] = -1;
    L.lru.erase(victim);
    std::erase(L.streamed, a.evicted);
    ++L.stats.evictions;
  }
  L.slot_of[e] = a.slot;
  L.expert_in[size_t(a.slot)] = expert;
  L.pos[e] = L.lru.insert(L.lru.end(), expert);
  if (stream_window > 0) L.streamed.push_back(expert);
  ++L.stats.admissions;
  return a;
}

void ExpertCache::end_stream(int32_t layer) {
  Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  L.streamed.clear();
}

void ExpertCache::retain(int32_t layer, int32_t expert) {
  check_expert(expert);
  Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  if (L.slot_of[size_t(expert)] < 0) fail("expert cache: retain of expert {} not resident in layer {}", expert, layer);
  ++L.retained[size_t(expert)];
}

void ExpertCache::release(int32_t layer, int32_t expert) {
  check_expert(expert);
  Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  if (L.retained[size_t(expert)] <= 0)
    fail("expert cache: release of expert {} in layer {} without retain", expert, layer);
  --L.retained[size_t(expert)];
}

bool ExpertCache::forget(int32_t layer, int32_t expert) {
  check_expert(expert);
  Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  const size_t e = size_t(expert);
  const int32_t slot = L.slot_of[e];
  if (slot < 0 || L.pinned[e] || L.retained[e] > 0) return false;
  L.slot_of[e] = -1;
  L.expert_in[size_t(slot)] = -1;
  L.lru.erase(L.pos[e]);
  std::erase(L.streamed, expert);
  L.free_slots.push_back(slot);
  return true;
}

void ExpertCache::set_victim_window(int32_t n) {
  if (n < 1) fail("expert cache: a victim window of {} experts", n);
  victim_window_ = n;
}

void ExpertCache::lend(int32_t layer) {
  Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  if (L.lent) return;
  for (int32_t i = L.slots - 1; i >= L.slots - L.lendable; --i) L.free_slots.push_back(i);
  L.lent = true;
}

std::vector<int32_t> ExpertCache::withdraw(int32_t layer) {
  Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  std::vector<int32_t> evicted;
  if (!L.lent) return evicted;
  const int32_t first = L.slots - L.lendable;
  for (int32_t i = first; i < L.slots; ++i) {
    const int32_t e = L.expert_in[size_t(i)];
    if (e < 0) continue;
    if (L.pinned[size_t(e)] || L.retained[size_t(e)] > 0)
      fail("expert cache: layer {} cannot withdraw slot {}: expert {} is pinned or retained", layer, i, e);
    L.slot_of[size_t(e)] = -1;
    L.expert_in[size_t(i)] = -1;
    L.lru.erase(L.pos[size_t(e)]);
    std::erase(L.streamed, e);
    evicted.push_back(e);
  }
  std::erase_if(L.free_slots, [&](int32_t i) { return i >= first; });
  L.lent = false;
  return evicted;
}

int32_t ExpertCache::usable_slots(int32_t layer) const {
  const Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  return L.lent ? L.slots : L.slots - L.lendable;
}

bool ExpertCache::is_pinned(int32_t layer, int32_t expert) const {
  check_expert(expert);
  const Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  return L.pinned[size_t(expert)] != 0;
}

std::vector<int32_t> ExpertCache::lru_order(int32_t layer) const {
  const Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  return {L.lru.begin(), L.lru.end()};
}

ExpertCacheStats ExpertCache::stats(int32_t layer) const {
  const Layer& L = layer_(layer);
  std::lock_guard lk(L.mu);
  return L.stats;
}

ExpertCacheStats ExpertCache::total_stats() const {
  ExpertCacheStats t;
  for (int32_t l = 0; l < layers(); ++l) {
    ExpertCacheStats s = stats(l);
    t.hits += s.hits, t.misses += s.misses, t.evictions += s.evictions, t.admissions += s.admissions;
  }
  return t;
}

void ExpertCache::reset_stats() {
  for (auto& L : layers_) {
    std::lock_guard lk(L->mu);
    L->stats = {};
  }
}

}  // namespace moesrv
