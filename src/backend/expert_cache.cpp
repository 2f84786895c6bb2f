#include "backend/expert_cache.h"

#include "util/error.h"

namespace moesrv {

ExpertCache::ExpertCache(const std::vector<int32_t>& slots_per_layer, int32_t experts) : experts_(experts) {
  if (experts <= 0) fail("expert cache: {} experts per layer", experts);
  for (int32_t s : slots_per_layer) {
    if (s < 0 || s > experts) fail("expert cache: {} slots for a layer of {} experts", s, experts);
    auto L = std::make_unique<Layer>();
    L->slots = s;
    L->slot_of.assign(size_t(experts), -1);
    L->expert_in.assign(size_t(s), -1);
    L->pinned.assign(size_t(experts), 0);
    L->retained.assign(size_t(experts), 0);
    L->pos.resize(size_t(experts));
    for (int32_t i = s - 1; i >= 0; --i) L->free_slots.push_back(i);  // hand out slot 0 first
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
