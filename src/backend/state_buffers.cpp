#include "backend/state_buffers.h"

namespace moesrv {

namespace {

// Names in allocation errors, by StateSlot.
constexpr const char* kWhat[kStateSlots] = {
    "KV cache",   "KV cache",        "KV cache",        "indexer key cache", "indexer pooled keys", "indexer open pool",
    "conv state", "recurrent state", "KV cache scales", "KV cache scales",   "indexer open pool"};

}  // namespace

std::vector<LayerLayout> state_layout(const ModelSpec& c, StateStore store, bool kv_q8) {
  const bool device = store == StateStore::Device;
  std::vector<LayerLayout> out(size_t(c.num_layers));
  for (const StateSpec& st : state_specs(c)) {
    LayerLayout& L = out[size_t(st.layer)];
    L.pool = st.pool;
    auto slot = [&L](StateSlot s) -> SlotShape& { return L.slots[size_t(s)]; };
    for (const StateBuffer& x : st.buffers) {
      SlotShape& s = slot(x.slot);
      s = {x.growth, x.elems, 4, kWhat[size_t(x.slot)]};
      if (!device || x.growth != Growth::PerToken) continue;
      s.elem_bytes = x.indexer ? 2 : kv_q8 ? 1 : 2;
      if (x.int8_scale && kv_q8)
        slot(x.slot == StateSlot::V ? StateSlot::VScale : StateSlot::KvScale) = {Growth::PerToken, 1, 4,
                                                                                 kWhat[size_t(StateSlot::KvScale)]};
    }
    if (device) {
      slot(StateSlot::Kv).width += slot(StateSlot::KRope).width;
      slot(StateSlot::KRope) = {};
    } else if (slot(StateSlot::Open).width) {
      slot(StateSlot::Open).width /= 2;
      slot(StateSlot::OpenG) = slot(StateSlot::Open);
    }
  }
  return out;
}

}  // namespace moesrv
