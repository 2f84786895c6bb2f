// The one size formula for per-sequence state: what each stateful layer keeps (KV / latent cache, indexer keys,
// recurrent and convolution state), read by the engines, planner, preflight, bench and prefix cache.
#pragma once
#include <cstdint>
#include <vector>

#include "model/spec.h"

namespace moesrv {

enum class Growth { PerToken, PerPool, Fixed };

// What a state buffer holds. The last three are companions an engine may store beside a buffer of the spec
// (backend/state_buffers.h says which engine does): int8 scale rows, the open pool's gate logits kept apart.
enum class StateSlot : uint8_t {
  Kv,         // MLA normalised latent, or GQA keys
  KRope,      // MLA roped shared key
  V,          // GQA values
  IndexK,     // DSA indexer keys
  PoolK,      // k-pool indexer: one pooled key per completed pool
  Open,       // k-pool indexer: the open pool's raw keys and gate logits
  Conv,       // linear attention: the last kernel - 1 conv inputs
  Recurrent,  // linear attention: delta-rule state
  KvScale,    // companions: fp32 scale per int8 row of Kv, of V
  VScale,
  OpenG,  // the open pool's gate logits, when not stored with its keys
};
inline constexpr size_t kStateSlots = 11;

struct StateBuffer {
  StateSlot slot;
  Growth growth;
  int64_t elems;  // per token, per completed pool, or in total
  bool indexer = false;  // DSA indexer keys (may be stored at another precision than the KV cache)
  // Stored as int8 (1 byte per element), each token row carries an fp32 scale (MLA: latent and rope key share the
  // latent's; GQA: one for K, one for V).
  bool int8_scale = false;
};

struct StateSpec {
  int64_t layer = 0;
  int64_t pool = 1;        // PerPool buffers grow by one row every `pool` tokens
  bool recurrent = false;  // holds a fixed-size recurrence: resumable only from checkpoints
  std::vector<StateBuffer> buffers;
  // Bytes after `tokens` tokens with `kv_bytes` per growing element (1: int8 with per-token scales; `index_bytes`
  // for indexer keys; < 0: the same) and `fixed_bytes` per fixed element.
  uint64_t bytes(int64_t tokens, int kv_bytes, int fixed_bytes = 4, int index_bytes = -1) const;
};

// The stateful layers of a model (layers without state are left out).
std::vector<StateSpec> state_specs(const ModelSpec& s);
// Bytes of state one decode step touches in layer `st.layer` at context `ctx`: the attention rows it attends (on a
// layer with a DSA indexer, own or shared, at most index_topk of them), every indexer key (pooled: one per
// completed pool) and the fixed state, read and written back.
uint64_t step_state_bytes(const ModelSpec& s, const StateSpec& st, int64_t ctx, int kv_bytes, int fixed_bytes = 4,
                          int index_bytes = -1);
// Sum over layers [begin, end) (end < 0: all) of StateSpec::bytes.
uint64_t state_bytes(const ModelSpec& s, int64_t tokens, int kv_bytes, int fixed_bytes = 4, int64_t begin = 0,
                     int64_t end = -1, int index_bytes = -1);

}  // namespace moesrv
