#include "backend/expert_plan.h"

#include <algorithm>
#include <numeric>

namespace moesrv {

int64_t cache_slot_count(int64_t cached, int64_t streamable, int64_t wanted) {
  if (cached == 0) return std::min<int64_t>(streamable, 2);
  return std::min(cached + streamable, std::max<int64_t>(streamable > 0 ? 2 : 1, wanted));
}

bool ExpertLayer::uses_slots(size_t expert) const {
  const ExpertPlacement p = placement[expert];
  return p == ExpertPlacement::Cache || (p == ExpertPlacement::Cpu && streams);
}

SlotUse ExpertLayer::slot_use() const {
  SlotUse u;
  for (size_t e = 0; e < placement.size(); ++e) {
    if (!uses_slots(e)) continue;
    u.slot_bytes = std::max(u.slot_bytes, bytes[e]);
    (placement[e] == ExpertPlacement::Cache ? u.cached : u.streamable)++;
  }
  u.slots = cache_slot_count(u.cached, u.streamable, wanted_slots);
  return u;
}

size_t ExpertLayer::device_bytes() const {
  size_t vram = 0;
  for (size_t e = 0; e < placement.size(); ++e)
    if (placement[e] == ExpertPlacement::Vram) vram += bytes[e];
  const SlotUse u = slot_use();
  return vram + size_t(u.slots) * u.slot_bytes + (size_t(1) << 20);
}

namespace {

bool unplaced(const ExpertLayer& L) { return !L.bytes.empty() && L.placement.empty(); }

}  // namespace

size_t fill_in_order(std::vector<ExpertLayer>& layers, size_t planned, size_t limit) {
  size_t all = 0, stream_slots = 0;
  for (const ExpertLayer& L : layers) {
    if (!unplaced(L)) continue;
    all += std::accumulate(L.bytes.begin(), L.bytes.end(), size_t(0));
    if (L.streams)
      stream_slots += size_t(cache_slot_count(0, int64_t(L.bytes.size()), L.wanted_slots)) *
                      *std::max_element(L.bytes.begin(), L.bytes.end());
  }
  if (planned + all > limit) planned += stream_slots;
  for (ExpertLayer& L : layers) {
    if (!unplaced(L)) continue;
    L.placement.assign(L.bytes.size(), ExpertPlacement::Cpu);
    for (size_t e = 0; e < L.bytes.size(); ++e)
      if (planned + L.bytes[e] <= limit) {
        L.placement[e] = ExpertPlacement::Vram;
        planned += L.bytes[e];
      }
  }
  return planned;
}

int64_t fit_to_budget(std::vector<ExpertLayer>& layers, size_t planned, size_t limit) {
  size_t need = planned;
  for (const ExpertLayer& L : layers)
    if (!L.bytes.empty()) need += L.device_bytes();
  int64_t moved = 0;
  for (bool any = true; need > limit && any;) {
    any = false;
    for (size_t l = layers.size(); l-- > 0 && need > limit;) {
      ExpertLayer& L = layers[l];
      if (L.bytes.empty()) continue;
      const auto last = std::find(L.placement.rbegin(), L.placement.rend(), ExpertPlacement::Vram);
      if (last == L.placement.rend()) continue;
      const size_t before = L.device_bytes();
      const bool has_cache = std::count(L.placement.begin(), L.placement.end(), ExpertPlacement::Cache) > 0;
      *last = has_cache ? ExpertPlacement::Cache : ExpertPlacement::Cpu;
      need = need - before + L.device_bytes();
      ++moved;
      any = true;
    }
  }
  return moved;
}

int64_t place_experts(std::vector<ExpertLayer>& layers, size_t planned, size_t limit, bool given) {
  fill_in_order(layers, planned, limit);
  return given ? fit_to_budget(layers, planned, limit) : 0;  // (device_bytes counts the filled layers)
}

}  // namespace moesrv
