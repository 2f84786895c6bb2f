// The CPU's blocks for the decoder loop (model/decoder.h): fp32 activations on the host, one state per layer. Used
// by the engine for the model's layers and for the MTP block (a one-layer model of its own).
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/residual.h"
#include "model/decoder.h"

namespace moesrv::cpu {

class CpuBlocks final : public BlockExecutor {
 public:
  // layers[l], states[l]: layer l's weights and state; x [S, stream_width] at positions [pos0, pos0 + S). `usage`
  // (may be null) records the routed experts.
  CpuBlocks(const ModelSpec& c, const LayerWeights* layers, const Rope& rope, LayerState* states, float* x, int64_t S,
            int64_t pos0, TokenSelection& selection, UsageStats* usage)
      : c_(c),
        layers_(layers),
        rope_(rope),
        states_(states),
        x_(x),
        S_(S),
        pos0_(pos0),
        selection_(selection),
        usage_(usage),
        h_(size_t(S * c_.hidden_size)),
        y_(size_t(S * c_.hidden_size)),
        residual_(c_) {}

  void enter(int64_t l, Site site) override {
    const LayerWeights& L = layers_[l];
    if (site == Site::Attention) residual_.enter(x_, S_, L.input_norm, L.attn_hc, h_.data());
    else residual_.enter(x_, S_, L.post_attention_norm, L.ffn_hc, h_.data());
  }
  void leave(int64_t, Site) override { residual_.leave(x_, S_, y_.data()); }
  void mla(int64_t l, IndexerKind indexer) override {
    TokenSelection dense;
    if (indexer == IndexerKind::Own) selection_.clear();  // recomputed by the layer's indexer
    mla_forward(*layers_[l].mla, c_, rope_, h_.data(), S_, pos0_, states_[l],
                indexer == IndexerKind::None ? dense : selection_, y_.data());
  }
  void gqa(int64_t l) override { gqa_forward(*layers_[l].gqa, c_, rope_, h_.data(), S_, pos0_, states_[l], y_.data()); }
  void kda(int64_t l) override { kda_forward(*layers_[l].kda, c_, h_.data(), S_, states_[l], y_.data()); }
  void gated_delta(int64_t l) override {
    gated_delta_forward(*layers_[l].gated_delta, c_, h_.data(), S_, states_[l], y_.data());
  }
  void mlp(int64_t l) override { mlp_forward(*layers_[l].mlp, h_.data(), S_, y_.data()); }
  void moe(int64_t l) override { moe_forward(*layers_[l].moe, c_, h_.data(), S_, y_.data(), usage_, l); }

 private:
  const ModelSpec& c_;
  const LayerWeights* layers_;
  const Rope& rope_;
  LayerState* states_;
  float* x_;
  const int64_t S_, pos0_;
  TokenSelection& selection_;
  UsageStats* usage_;
  std::vector<float> h_, y_;
  Residual residual_;
};

}  // namespace moesrv::cpu
