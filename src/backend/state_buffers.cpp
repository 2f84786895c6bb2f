#include "backend/state_buffers.h"

namespace moesrv {

namespace {

const char* what(StateSlot s) {
  switch (s) {
    case StateSlot::Kv:
    case StateSlot::KRope:
    case StateSlot::V: return "KV cache";
    case StateSlot::KvScale:
    case StateSlot::VScale: return "KV cache scales";
    case StateSlot::IndexK: return "indexer key cache";
    case StateSlot::PoolK: return "indexer pooled keys";
    case StateSlot::Open:
    case StateSlot::OpenG: return "indexer open pool";
    case StateSlot::Conv: return "conv state";
    case StateSlot::Recurrent: return "recurrent state";
  }
  return "state";
}

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
      s = {x.growth, x.elems, 4, what(x.slot)};
      if (!device || x.growth != Growth::PerToken) continue;
      s.elem_bytes = x.indexer ? 2 : kv_q8 ? 1 : 2;
      if (x.int8_scale && kv_q8)
        slot(x.slot == StateSlot::V ? StateSlot::VScale : StateSlot::KvScale) = {Growth::PerToken, 1, 4,
                                                                                 what(StateSlot::KvScale)};
    }
    if (device) {
      slot(StateSlot::Kv).width += slot(StateSlot::KRope).width;
      slot(StateSlot::KRope) = {};
      if (slot(StateSlot::Open).width) slot(StateSlot::Open).width = 2 * st.pool * c.index_head_dim;
    } else if (slot(StateSlot::Open).width) {
      slot(StateSlot::Open).width /= 2;
      slot(StateSlot::OpenG) = slot(StateSlot::Open);
    }
  }
  return out;
}

}  // namespace moesrv
