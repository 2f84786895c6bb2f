// One sequence's per-layer state buffers, for every engine: which buffers a layer has in each engine's storage
// (derived from model/state.h's StateSpec), and the one implementation of what a sequence does with them
// (truncate, clone, checkpoint, byte counts) over a backend's storage.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/state.h"

namespace moesrv {

// Where the state lives: fp32 host vectors that grow with the sequence (CPU engine), or device buffers of max_ctx
// rows (CUDA engine: bf16 or int8 rows with fp32 scales under kv_q8, fp16 DSA keys, fp32 pooled keys and fixed state).
enum class StateStore { Host, Device };

struct SlotShape {
  Growth growth = Growth::Fixed;
  int64_t width = 0;  // elements per row (PerToken, PerPool) or in total (Fixed); 0: the layer has no such buffer
  int elem_bytes = 4;
  const char* what = "";  // names the buffer in allocation errors
};

struct LayerLayout {
  int64_t pool = 1;
  std::array<SlotShape, kStateSlots> slots{};
  // Rows a buffer of `g` holds after `tokens` tokens (Fixed: 1).
  int64_t rows(Growth g, int64_t tokens) const {
    return g == Growth::PerToken ? tokens : g == Growth::PerPool ? tokens / pool : 1;
  }
};

// Every layer's buffers in `store` (stateless layers have none). What differs from the StateSpec, and where:
// Device: the MLA rope key sits in the latent's row (no KRope); under kv_q8 each int8 Kv / V row has an fp32 scale
//         (KvScale, VScale); Open holds the open pool's keys then gate logits, kpool rows each.
// Host:   Open holds the open pool's keys and OpenG its gate logits (< kpool rows each).
std::vector<LayerLayout> state_layout(const ModelSpec& c, StateStore store, bool kv_q8 = false);

// A layer's buffers by slot (empty where the layer has none).
template <class Buffer>
struct LayerBuffers {
  std::array<Buffer, kStateSlots> buf{};
  Buffer& operator[](StateSlot s) { return buf[size_t(s)]; }
  const Buffer& operator[](StateSlot s) const { return buf[size_t(s)]; }
};

// The operations below over a backend's storage `Store`, which provides
//   using Buffer;
//   void keep(Buffer&, size_t elems): a growing buffer's state is its first `elems` elements now
//   void assign(Buffer& to, const Buffer& from): a fixed buffer from a saved copy
//   void zero(Buffer&): a fixed buffer back to its start (zeros)
//   Buffer saved(const Buffer&): a copy of a fixed buffer (checkpoint)
//   void copy(Buffer& to, const Buffer& from, size_t bytes): the first `bytes` of a buffer into another's (clone)
//   size_t bytes(const Buffer&)
template <class F>
void for_each_slot(const LayerLayout& lay, F&& f) {
  for (size_t i = 0; i < kStateSlots; ++i)
    if (lay.slots[i].width) f(i, lay.slots[i]);
}

// Truncate to n tokens: growing buffers keep their first rows; fixed ones come from `from` (a saved copy of this
// layer's; &L: kept as they are) or are zeroed (nullptr).
template <class Store>
void cut_to(const Store& store, const LayerLayout& lay, LayerBuffers<typename Store::Buffer>& L, int64_t n,
            const LayerBuffers<typename Store::Buffer>* from) {
  for_each_slot(lay, [&](size_t i, const SlotShape& s) {
    if (s.growth != Growth::Fixed) store.keep(L.buf[i], size_t(lay.rows(s.growth, n) * s.width));
    else if (from != &L) from ? store.assign(L.buf[i], from->buf[i]) : store.zero(L.buf[i]);
  });
}

// Checkpoint: copies of the fixed buffers.
template <class Store>
LayerBuffers<typename Store::Buffer> save_fixed(const Store& store, const LayerLayout& lay,
                                                const LayerBuffers<typename Store::Buffer>& L) {
  LayerBuffers<typename Store::Buffer> out;
  for_each_slot(lay, [&](size_t i, const SlotShape& s) {
    if (s.growth == Growth::Fixed) out.buf[i] = store.saved(L.buf[i]);
  });
  return out;
}

// Clone: the first n tokens' rows of the growing buffers and all of the fixed ones.
template <class Store>
void copy_state(const Store& store, const LayerLayout& lay, const LayerBuffers<typename Store::Buffer>& from,
                LayerBuffers<typename Store::Buffer>& to, int64_t n) {
  for_each_slot(lay, [&](size_t i, const SlotShape& s) {
    const size_t bytes =
        s.growth == Growth::Fixed ? store.bytes(from.buf[i]) : size_t(lay.rows(s.growth, n) * s.width * s.elem_bytes);
    store.copy(to.buf[i], from.buf[i], bytes);
  });
}

template <class Store>
size_t layer_bytes(const Store& store, const LayerBuffers<typename Store::Buffer>& L) {
  size_t b = 0;
  for (const auto& x : L.buf) b += store.bytes(x);
  return b;
}

}  // namespace moesrv
