// The CPU's blocks for one decode step of B sequences (model/decoder.h): row b is sequence b's next token at its own
// position. The blocks whose kernels compute every row alone with the same arithmetic (norms, mHC mixing, dense
// linears: the mixers' input and output projections, the MLP, the MoE's router and its experts grouped per expert)
// run over all B rows, so each weight is read once per step; the attention and the recurrences (per-sequence cache,
// state and position) and any block with an EXL3 linear (its kernels sum differently for several rows) run row by
// row. Every row's result is bit-identical to its sequence's own step.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/residual.h"
#include "model/decoder.h"

namespace moesrv::cpu {

// True when every row of lin.forward(x, n, y) is computed as that row alone would be (dense weights).
bool rows_independent(const Linear& lin);
bool rows_independent(const MlpWeights& w);
bool rows_independent(const MoeWeights& w);

// Which of a model's blocks may run over all rows of a batch (from rows_independent of their linears).
struct BatchPlan {
  std::vector<bool> mixer, ffn;  // per layer: the mixer's projections; the MLP or MoE
  bool head = false;             // lm_head
  static BatchPlan of(const ModelWeights& w);
};

class BatchBlocks final : public BlockExecutor {
 public:
  // states[b]: sequence b's per-layer states; pos[b]: its position; x [B, stream_width].
  BatchBlocks(const ModelSpec& c, const LayerWeights* layers, const Rope& rope, std::vector<LayerState*> states,
              std::vector<int64_t> pos, float* x, const BatchPlan& plan, UsageStats* usage);

  void enter(int64_t l, Site site) override;
  void leave(int64_t, Site) override { residual_.leave(x_, B_, y_.data()); }
  void mla(int64_t l, IndexerKind indexer) override;
  void gqa(int64_t l) override;
  void kda(int64_t l) override;
  void gated_delta(int64_t l) override;
  void mlp(int64_t l) override;
  void moe(int64_t l) override;

 private:
  const float* h(int64_t b) const { return h_.data() + b * c_.hidden_size; }
  float* y(int64_t b) { return y_.data() + b * c_.hidden_size; }
  // kda() and gated_delta(): the B rows' input projections at once, each sequence's conv and delta rule over its
  // row (`width` values), the output projection `out` over all rows; per row whole when the plan says so.
  template <class Weights, class Forward, class Project, class Mix>
  void recurrent(int64_t l, const Weights& w, const Linear& out, int64_t width, Forward forward, Project project,
                 Mix mix);
  const ModelSpec& c_;
  const LayerWeights* layers_;
  const Rope& rope_;
  std::vector<LayerState*> states_;  // [B] -> that sequence's layer array
  std::vector<int64_t> pos_;
  float* x_;
  const int64_t B_;
  const BatchPlan& plan_;
  UsageStats* usage_;
  std::vector<TokenSelection> selection_;  // per sequence: the DSA selection of its last own-indexer layer
  std::vector<float> h_, y_;
  Residual residual_;
};

}  // namespace moesrv::cpu
