// CPU forward passes of the model's layer types over a batch of S consecutive tokens.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/state_buffers.h"
#include "backend/usage_stats.h"
#include "model/rope.h"
#include "model/weights.h"

namespace moesrv::cpu {

// The host storage of backend/state_buffers.h's operations: fp32 vectors the blocks allocate (fixed state: zero on
// first use) and grow with the sequence.
struct HostStore {
  using Buffer = std::vector<float>;
  void keep(Buffer& b, size_t elems) const {
    if (!b.empty()) b.resize(elems);
  }
  void assign(Buffer& to, const Buffer& from) const { to = from; }
  void zero(Buffer& b) const { b.clear(); }
  Buffer saved(const Buffer& b) const { return b; }
  size_t bytes(const Buffer& b) const { return b.size() * sizeof(float); }
};
using StateBuffers = LayerBuffers<std::vector<float>>;

// Per-layer state, fp32, by slot (state_buffers.h's StateStore::Host): MLA keeps only the normalised latent (Kv) and
// the roped shared key (absorbed attention); GQA Kv and V; DSA IndexK; the k-pool indexer PoolK [P, d] and the open
// pool's keys and gate logits (Open, OpenG [< kpool, d]); recurrent layers Conv [kernel - 1, channels] and Recurrent
// [heads, dk, dv].
struct LayerState : StateBuffers {
  // Rollback points (speculative verify): with record_steps set, a forward of S tokens runs its recurrence token by
  // token (as S single-token steps would, bit for bit) and keeps the fixed buffers after each of its first S - 1
  // tokens in `steps` (the state after the last one is the live state).
  bool record_steps = false;
  std::vector<StateBuffers> steps;

  size_t bytes() const {
    size_t b = layer_bytes(HostStore{}, *this);
    for (const StateBuffers& f : steps) b += layer_bytes(HostStore{}, f);
    return b;
  }
};

// Key positions each query token may attend to (DSA top-k); empty = dense causal attention.
using TokenSelection = std::vector<std::vector<int32_t>>;

// MLA attention for S tokens at positions [pos0, pos0+S). Appends to `cache`. When the layer has an indexer,
// computes and returns the DSA selection in `selection`; for "shared" DSA layers `selection` is the input.
void mla_forward(const MlaWeights& w, const ModelSpec& c, const Rope& rope, const float* x, int64_t S, int64_t pos0,
                 LayerState& cache, TokenSelection& selection, float* out);

// mla_forward in steps, so that a batch of sequences can share the row-independent ones: the projections of S rows
// (mla_project), then per sequence the attention of its rows [r0, r0 + S) of p and x at positions [pos0, pos0 + S)
// (mla_attend: appends to cache, runs the indexer, writes attn [S, heads * v_head_dim]), then w.o over all rows.
struct MlaProjection {
  std::vector<float> q, q_latent, kv;  // [S, heads * qk_head_dim], [S, q_lora_rank] (empty without q_a), [S, r + dr]
};
MlaProjection mla_project(const MlaWeights& w, const ModelSpec& c, const float* x, int64_t S);
void mla_attend(const MlaWeights& w, const ModelSpec& c, const Rope& rope, const float* x, MlaProjection& p, int64_t r0,
                int64_t S, int64_t pos0, LayerState& cache, TokenSelection& selection, float* attn);

// DSA lightning indexer: top-k key positions for each of the S query tokens (appends indexer keys to cache).
TokenSelection dsa_select(const IndexerWeights& w, const ModelSpec& c, const Rope& rope, const float* x,
                          const float* q_latent, int64_t S, int64_t pos0, LayerState& cache);

// k-pool DSA indexer (GLM-5.3-Flash): scores completed pools of index_kpool tokens, keeps the best
// index_topk / kpool pools per query, expands them to positions and appends the open pool's visible tail.
TokenSelection kpool_select(const IndexerWeights& w, const ModelSpec& c, const float* x, const float* q_latent,
                            int64_t S, int64_t pos0, LayerState& state);

// KDA linear attention (GLM-5.3-Flash) and Gated DeltaNet (Qwen3-Next) over S tokens; update state's conv and
// recurrent buffers (allocated zero on first use).
void kda_forward(const KdaWeights& w, const ModelSpec& c, const float* x, int64_t S, LayerState& state, float* out);
void gated_delta_forward(const GatedDeltaWeights& w, const ModelSpec& c, const float* x, int64_t S, LayerState& state,
                         float* out);

// The recurrent mixers in steps (as MLA's): the input projections of S rows (row by row arithmetic: a batch of
// sequences shares them); then per sequence its rows [r0, r0 + S) through the conv, the delta rule (its state) and
// the gated norm into o [S, v_heads * dv]; then the output projection over all rows.
struct KdaProjection {
  std::vector<float> qkv, g, beta, gate;  // [S, 3 * H * d] conv inputs; decay [S, H * d]; beta [S, H]; gate logits
};
KdaProjection kda_project(const KdaWeights& w, const ModelSpec& c, const float* x, int64_t S);
void kda_mix(const KdaWeights& w, const ModelSpec& c, const KdaProjection& p, int64_t r0, int64_t S, LayerState& st,
             float* o);
struct GatedDeltaProjection {
  std::vector<float> qkvz, ba;  // per key head: q, k, v, z; per value head: b, a
};
GatedDeltaProjection gated_delta_project(const GatedDeltaWeights& w, const ModelSpec& c, const float* x, int64_t S);
void gated_delta_mix(const GatedDeltaWeights& w, const ModelSpec& c, const GatedDeltaProjection& p, int64_t r0,
                     int64_t S, LayerState& st, float* o);

void gqa_forward(const GqaWeights& w, const ModelSpec& c, const Rope& rope, const float* x, int64_t S, int64_t pos0,
                 LayerState& cache, float* out);

// gqa_forward in steps (as MLA's): projections and q/k norms of S rows; rope, cache append and attention of one
// sequence's rows [r0, r0 + S) into attn [S, heads * head_dim]; output gate and w.o over all rows.
struct GqaProjection {
  std::vector<float> q, k, v, gate;  // gate: attn_output_gate only
};
GqaProjection gqa_project(const GqaWeights& w, const ModelSpec& c, const float* x, int64_t S);
void gqa_attend(const ModelSpec& c, const Rope& rope, GqaProjection& p, int64_t r0, int64_t S, int64_t pos0,
                LayerState& cache, float* attn);
void gqa_finish(const GqaWeights& w, const GqaProjection& p, int64_t S, float* attn, float* out);

void mlp_forward(const MlpWeights& w, const float* x, int64_t S, float* out);
// Records each token's routed experts into `usage` (layer `layer`) when given.
void moe_forward(const MoeWeights& w, const ModelSpec& c, const float* x, int64_t S, float* out,
                 UsageStats* usage = nullptr, int64_t layer = 0);

}  // namespace moesrv::cpu
