#include "backend/cpu/batch_blocks.h"

#include <algorithm>

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

BatchPlan BatchPlan::of(const ModelWeights& w) {
  BatchPlan p;
  for (const LayerWeights& L : w.layers) {
    const std::vector<const Linear*> mixer = mixer_linears(L);
    p.mixer.push_back(
        std::all_of(mixer.begin(), mixer.end(), [](const Linear* lin) { return rows_independent(*lin); }));
    p.ffn.push_back(L.moe ? rows_independent(*L.moe) : L.mlp && rows_independent(*L.mlp));
  }
  p.head = rows_independent(*w.lm_head);
  return p;
}

BatchBlocks::BatchBlocks(const ModelSpec& c, const LayerWeights* layers, const Rope& rope,
                         std::vector<LayerState*> states, std::vector<int64_t> pos, float* x, const BatchPlan& plan,
                         UsageStats* usage)
    : c_(c),
      layers_(layers),
      rope_(rope),
      states_(std::move(states)),
      pos_(std::move(pos)),
      x_(x),
      B_(int64_t(states_.size())),
      plan_(plan),
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
  const MlaWeights& w = *layers_[l].mla;
  const bool batched = plan_.mixer[size_t(l)];
  MlaProjection p;
  std::vector<float> attn;
  if (batched) {
    p = mla_project(w, c_, h_.data(), B_);
    attn.resize(size_t(B_ * c_.num_heads * c_.v_head_dim));
  }
  for (int64_t b = 0; b < B_; ++b) {
    TokenSelection dense;
    TokenSelection& sel = indexer == IndexerKind::None ? dense : selection_[size_t(b)];
    if (indexer == IndexerKind::Own) sel.clear();  // recomputed by the layer's indexer
    LayerState& state = states_[size_t(b)][l];
    if (batched)
      mla_attend(w, c_, rope_, h_.data(), p, b, 1, pos_[size_t(b)], state, sel,
                 attn.data() + b * c_.num_heads * c_.v_head_dim);
    else mla_forward(w, c_, rope_, h(b), 1, pos_[size_t(b)], state, sel, y(b));
  }
  if (batched) w.o->forward(attn.data(), B_, y_.data());
}

void BatchBlocks::gqa(int64_t l) {
  const GqaWeights& w = *layers_[l].gqa;
  if (!plan_.mixer[size_t(l)]) {
    for (int64_t b = 0; b < B_; ++b) gqa_forward(w, c_, rope_, h(b), 1, pos_[size_t(b)], states_[size_t(b)][l], y(b));
    return;
  }
  GqaProjection p = gqa_project(w, c_, h_.data(), B_);
  std::vector<float> attn(size_t(B_ * c_.num_heads * c_.head_dim));
  for (int64_t b = 0; b < B_; ++b)
    gqa_attend(c_, rope_, p, b, 1, pos_[size_t(b)], states_[size_t(b)][l],
               attn.data() + b * c_.num_heads * c_.head_dim);
  gqa_finish(w, p, B_, attn.data(), y_.data());
}

template <class Weights, class Forward, class Project, class Mix>
void BatchBlocks::recurrent(int64_t l, const Weights& w, const Linear& out, int64_t width, Forward forward,
                            Project project, Mix mix) {
  if (!plan_.mixer[size_t(l)]) {
    for (int64_t b = 0; b < B_; ++b) forward(w, c_, h(b), 1, states_[size_t(b)][l], y(b));
    return;
  }
  const auto p = project(w, c_, h_.data(), B_);
  std::vector<float> o(size_t(B_ * width));
  for (int64_t b = 0; b < B_; ++b) mix(w, c_, p, b, 1, states_[size_t(b)][l], o.data() + b * width);
  out.forward(o.data(), B_, y_.data());
}

void BatchBlocks::kda(int64_t l) {
  const KdaWeights& w = *layers_[l].kda;
  recurrent(l, w, *w.o, c_.linear.v_heads * c_.linear.dk, kda_forward, kda_project, kda_mix);
}

void BatchBlocks::gated_delta(int64_t l) {
  const GatedDeltaWeights& w = *layers_[l].gated_delta;
  recurrent(l, w, *w.out, c_.linear.v_heads * c_.linear.dv, gated_delta_forward, gated_delta_project, gated_delta_mix);
}

void BatchBlocks::mlp(int64_t l) {
  if (plan_.ffn[size_t(l)]) return mlp_forward(*layers_[l].mlp, h_.data(), B_, y_.data());
  for (int64_t b = 0; b < B_; ++b) mlp_forward(*layers_[l].mlp, h(b), 1, y(b));
}

void BatchBlocks::moe(int64_t l) {
  if (plan_.ffn[size_t(l)]) return moe_forward(*layers_[l].moe, c_, h_.data(), B_, y_.data(), usage_, l);
  for (int64_t b = 0; b < B_; ++b) moe_forward(*layers_[l].moe, c_, h(b), 1, y(b), usage_, l);
}

}  // namespace moesrv::cpu
