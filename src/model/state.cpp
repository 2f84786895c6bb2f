#include "model/state.h"

#include <algorithm>

namespace moesrv {

namespace {

// Bytes of one buffer holding `rows` token rows (PerPool: one row per `pool` of them), or its fixed size.
uint64_t buffer_bytes(const StateBuffer& x, int64_t rows, int64_t pool, int kv_bytes, int fixed_bytes,
                      int index_bytes) {
  const uint64_t elem = uint64_t(x.indexer && index_bytes >= 0 ? index_bytes : kv_bytes);
  switch (x.growth) {
    case Growth::PerToken: return uint64_t(rows * x.elems) * elem + (x.int8_scale && elem == 1 ? uint64_t(rows) * 4 : 0);
    case Growth::PerPool: return uint64_t(rows / pool * x.elems) * elem;
    case Growth::Fixed: return uint64_t(x.elems) * uint64_t(fixed_bytes);
  }
  return 0;
}

}  // namespace

uint64_t StateSpec::bytes(int64_t tokens, int kv_bytes, int fixed_bytes, int index_bytes) const {
  uint64_t b = 0;
  for (const StateBuffer& x : buffers) b += buffer_bytes(x, tokens, pool, kv_bytes, fixed_bytes, index_bytes);
  return b;
}

std::vector<StateSpec> state_specs(const ModelSpec& s) {
  std::vector<StateSpec> out;
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const LayerSpec& L = s.layers[size_t(l)];
    StateSpec st;
    st.layer = l;
    switch (L.mixer) {
      case Mixer::Mla:
        st.buffers.push_back({StateSlot::Kv, Growth::PerToken, s.kv_lora_rank, false, true});
        if (s.qk_rope_dim > 0) st.buffers.push_back({StateSlot::KRope, Growth::PerToken, s.qk_rope_dim});
        break;
      case Mixer::Gqa:
        st.buffers.push_back({StateSlot::Kv, Growth::PerToken, s.num_kv_heads * s.head_dim, false, true});
        st.buffers.push_back({StateSlot::V, Growth::PerToken, s.num_kv_heads * s.head_dim, false, true});
        break;
      case Mixer::Kda:
      case Mixer::GatedDelta:
        st.recurrent = true;
        st.buffers.push_back({StateSlot::Conv, Growth::Fixed, s.linear.conv_state_floats()});
        st.buffers.push_back({StateSlot::Recurrent, Growth::Fixed, s.linear.state_floats()});
        break;
    }
    if (L.indexer == IndexerKind::Own) {
      if (s.index_kpool > 1) {
        st.pool = s.index_kpool;
        st.buffers.push_back({StateSlot::PoolK, Growth::PerPool, s.index_head_dim, true});
        // The open pool's raw keys and gate logits: room for kpool tokens (a GPU writes the closing token into its
        // slot before pooling it; the CPU holds at most kpool - 1 between calls).
        st.buffers.push_back({StateSlot::Open, Growth::Fixed, 2 * s.index_kpool * s.index_head_dim, true});
      } else {
        st.buffers.push_back({StateSlot::IndexK, Growth::PerToken, s.index_head_dim, true});
      }
    }
    out.push_back(std::move(st));
  }
  return out;
}

uint64_t step_state_bytes(const ModelSpec& s, const StateSpec& st, int64_t ctx, int kv_bytes, int fixed_bytes,
                          int index_bytes) {
  const bool selects = s.layers[size_t(st.layer)].indexer != IndexerKind::None;
  const int64_t attended = selects ? std::min(ctx, s.index_topk) : ctx;
  uint64_t b = 0;
  for (const StateBuffer& x : st.buffers) {
    const int64_t rows = x.growth == Growth::PerToken && !x.indexer ? attended : ctx;
    const uint64_t once = buffer_bytes(x, rows, st.pool, kv_bytes, fixed_bytes, index_bytes);
    b += x.growth == Growth::Fixed ? 2 * once : once;  // fixed state is read and written back
  }
  return b;
}

uint64_t state_bytes(const ModelSpec& s, int64_t tokens, int kv_bytes, int fixed_bytes, int64_t begin, int64_t end,
                     int index_bytes) {
  if (end < 0) end = s.num_layers;
  uint64_t b = 0;
  for (const StateSpec& st : state_specs(s))
    if (st.layer >= begin && st.layer < end) b += st.bytes(tokens, kv_bytes, fixed_bytes, index_bytes);
  return b;
}

}  // namespace moesrv
