// THE decoder loop: the order of blocks in a layer, written once for every architecture and backend. A backend
// implements BlockExecutor (its buffers, kernels and state); the loop decides, from the ModelSpec, which block
// runs where: residual enter/leave around each sub-layer, the layer's mixer (and whether its DSA indexer
// computes a new selection or reuses the last one), then the dense MLP or the MoE.
#pragma once
#include <cstdint>

#include "model/spec.h"

namespace moesrv {

// The two residual sites of a layer.
enum class Site : uint8_t { Attention, Ffn };

// Runs one batch of S tokens (the executor holds the batch, its positions and the sequence state).
// enter(): h = norm(collapse(x)) for the site (plain: rms_norm(x); mHC: pre-mix of the streams, then the norm).
// leave(): merges the sub-layer output y into x (plain: x += y; mHC: post/comb mix of the streams).
// A mixer reads h and writes y; so does the feed-forward block.
class BlockExecutor {
 public:
  virtual ~BlockExecutor() = default;
  virtual void enter(int64_t layer, Site site) = 0;
  virtual void leave(int64_t layer, Site site) = 0;
  // MLA. indexer None: dense causal attention; Own: the layer's indexer selects the keys (and that selection
  // becomes the current one); Shared: attend the current selection (made by spec.indexer_from).
  virtual void mla(int64_t layer, IndexerKind indexer) = 0;
  virtual void gqa(int64_t layer) = 0;
  virtual void kda(int64_t layer) = 0;
  virtual void gated_delta(int64_t layer) = 0;
  virtual void mlp(int64_t layer) = 0;
  virtual void moe(int64_t layer) = 0;
};

// Layers [begin, end) of `spec` through `ex`. A range that starts on a Shared-indexer layer needs the selection
// of its indexer_from layer (pipeline stages hand it over with the activations).
void run_decoder_layers(const ModelSpec& spec, BlockExecutor& ex, int64_t begin, int64_t end);

}  // namespace moesrv
