#include "backend/cpu/batch_blocks.h"

#include "backend/cpu/linear.h"

namespace moesrv::cpu {

bool rows_independent(const Linear& lin) { return dynamic_cast<const DenseLinear*>(&lin) != nullptr; }

bool rows_independent(const MlpWeights& w) {
  return rows_independent(*w.gate) && rows_independent(*w.up) && rows_independent(*w.down);
}

bool rows_independent(const MoeWeights& w) {
  if (w.shared && !rows_independent(*w.shared)) return false;
  for (const MlpWeights& e : w.experts)
    if (!rows_independent(e)) return false;
  return true;
}

BatchBlocks::BatchBlocks(const ModelSpec& c, const LayerWeights* layers, const Rope& rope,
                         std::vector<LayerState*> states, std::vector<int64_t> pos, float* x,
                         const std::vector<bool>& batch_ffn, UsageStats* usage)
    : c_(c),
      layers_(layers),
      rope_(rope),
      states_(std::move(states)),
      pos_(std::move(pos)),
      x_(x),
      B_(int64_t(states_.size())),
      batch_ffn_(batch_ffn),
      usage_(usage),
      selection_(states_.size()),
      h_(size_t(B_ * c.hidden_size)),
      y_(size_t(B_ * c.hidden_size)),
      residual_(c) {}

void BatchBlocks::enter(int64_t l, Site site) {
  const LayerWeights& L = layers_[l];
  if (site == Site::Attention) residual_.enter(x_, B_, L.input_norm, L.attn_hc, h_.data());
  else residual_.enter(x_, B_, L.post_attention_norm, L.ffn_hc, h_.data());
}

void BatchBlocks::mla(int64_t l, IndexerKind indexer) {
  for (int64_t b = 0; b < B_; ++b) {
    TokenSelection dense;
    TokenSelection& sel = selection_[size_t(b)];
    if (indexer == IndexerKind::Own) sel.clear();  // recomputed by the layer's indexer
    mla_forward(*layers_[l].mla, c_, rope_, h(b), 1, pos_[size_t(b)], states_[size_t(b)][l],
                indexer == IndexerKind::None ? dense : sel, y(b));
  }
}

void BatchBlocks::gqa(int64_t l) {
  for (int64_t b = 0; b < B_; ++b)
    gqa_forward(*layers_[l].gqa, c_, rope_, h(b), 1, pos_[size_t(b)], states_[size_t(b)][l], y(b));
}

void BatchBlocks::kda(int64_t l) {
  for (int64_t b = 0; b < B_; ++b) kda_forward(*layers_[l].kda, c_, h(b), 1, states_[size_t(b)][l], y(b));
}

void BatchBlocks::gated_delta(int64_t l) {
  for (int64_t b = 0; b < B_; ++b)
    gated_delta_forward(*layers_[l].gated_delta, c_, h(b), 1, states_[size_t(b)][l], y(b));
}

void BatchBlocks::mlp(int64_t l) {
  if (batch_ffn_[size_t(l)]) return mlp_forward(*layers_[l].mlp, h_.data(), B_, y_.data());
  for (int64_t b = 0; b < B_; ++b) mlp_forward(*layers_[l].mlp, h(b), 1, y(b));
}

void BatchBlocks::moe(int64_t l) {
  if (batch_ffn_[size_t(l)]) return moe_forward(*layers_[l].moe, c_, h_.data(), B_, y_.data(), usage_, l);
  for (int64_t b = 0; b < B_; ++b) moe_forward(*layers_[l].moe, c_, h(b), 1, y(b), usage_, l);
}

}  // namespace moesrv::cpu
