#include "backend/cpu/cpu_engine.h"

#include <algorithm>
#include <filesystem>

#include "backend/cpu/ops.h"
#include "util/error.h"

namespace moesrv {

void CpuSequence::truncate(int64_t n) {
  if (n < 0 || n > length_) fail("truncate({}) outside sequence of length {}", n, length_);
  for (auto& L : layers) {
    auto cut = [n](std::vector<float>& v, int64_t per_token) {
      if (per_token > 0 && !v.empty()) v.resize(size_t(n * per_token));
    };
    if (!L.latent.empty() || !L.k_rope.empty()) {
      cut(L.latent, kv_dims[0]);
      cut(L.k_rope, kv_dims[1]);
    } else {
      cut(L.k, kv_dims[0]);
      cut(L.v, kv_dims[1]);
    }
    cut(L.index_k, kv_dims[2]);
  }
  length_ = n;
}

size_t CpuSequence::bytes() const {
  size_t b = 0;
  for (const auto& L : layers) b += L.bytes();
  return b;
}

CpuEngine::CpuEngine(std::shared_ptr<ModelPackage> pkg, std::string served_name)
    : weights_(ModelWeights::load(pkg)),
      rope_(weights_->config.rope),
      name_(std::move(served_name)),
      usage_(weights_->config.num_layers, std::max<int64_t>(1, weights_->config.n_routed_experts),
             std::max<int64_t>(1, weights_->config.experts_per_token)) {
  if (name_.empty()) name_ = std::filesystem::path(pkg->dir()).filename().string();
}

std::unique_ptr<CpuEngine> CpuEngine::open(const std::string& model_dir, std::string served_name) {
  return std::make_unique<CpuEngine>(ModelPackage::open(model_dir), std::move(served_name));
}

std::unique_ptr<SequenceState> CpuEngine::new_sequence() const {
  const ModelConfig& c = weights_->config;
  auto s = std::make_unique<CpuSequence>(c.num_layers);
  s->owner = this;
  if (c.attention == AttentionKind::MLA) {
    s->kv_dims[0] = c.kv_lora_rank;
    s->kv_dims[1] = c.qk_rope_dim;
  } else {
    s->kv_dims[0] = s->kv_dims[1] = c.num_kv_heads * c.head_dim;
  }
  s->kv_dims[2] = c.index_head_dim;
  return s;
}

CpuSequence& CpuEngine::own_sequence(SequenceState& seq_base) const {
  auto* seq = dynamic_cast<CpuSequence*>(&seq_base);
  if (!seq || seq->owner != this) fail("forward: sequence state was not created by this engine");
  return *seq;
}

void CpuEngine::embed(const std::vector<int32_t>& tokens, float* x) const {
  const ModelConfig& c = weights_->config;
  const int64_t D = c.hidden_size;
  for (size_t s = 0; s < tokens.size(); ++s) {
    int32_t t = tokens[s];
    if (t < 0 || t >= c.vocab_size) fail("token id {} outside vocabulary [0, {})", t, c.vocab_size);
    weights_->embed->rows_to_f32(t, t + 1, x + int64_t(s) * D);
  }
}

void CpuEngine::forward_layers(CpuSequence& seq, float* x, int64_t S, int64_t pos0, int64_t begin, int64_t end,
                               cpu::TokenSelection& selection, std::vector<uint8_t>* ambiguous) {
  const ModelConfig& c = weights_->config;
  if (begin < 0 || end > c.num_layers || begin > end) fail("forward_layers: range [{}, {}) outside {} layers", begin, end, c.num_layers);
  const int64_t D = c.hidden_size, n = S * D;
  std::vector<float> h(static_cast<size_t>(n)), y(static_cast<size_t>(n));
  for (int64_t l = begin; l < end; ++l) {
    const LayerWeights& L = weights_->layers[size_t(l)];
    cpu::LayerCache& cache = seq.layers[size_t(l)];
    cpu::rms_norm(x, L.input_norm.weight.data(), S, D, c.rms_eps, h.data());
    if (L.mla) {
      if (c.dsa && L.mla->indexer) selection.clear();  // recomputed by this layer; shared layers reuse it
      cpu::mla_forward(*L.mla, c, rope_, h.data(), S, pos0, cache, selection, y.data(), ambiguous);
    } else {
      cpu::gqa_forward(*L.gqa, c, rope_, h.data(), S, pos0, cache, y.data());
    }
    for (int64_t i = 0; i < n; ++i) x[i] += y[size_t(i)];
    cpu::rms_norm(x, L.post_attention_norm.weight.data(), S, D, c.rms_eps, h.data());
    if (L.moe) cpu::moe_forward(*L.moe, c, h.data(), S, y.data(), &usage_, l);
    else cpu::mlp_forward(*L.mlp, h.data(), S, y.data());
    for (int64_t i = 0; i < n; ++i) x[i] += y[size_t(i)];
  }
}

std::vector<float> CpuEngine::logits(const float* x, int64_t S, int64_t rows) const {
  const ModelConfig& c = weights_->config;
  const int64_t D = c.hidden_size;
  std::vector<float> h(size_t(rows * D)), out(size_t(rows * c.vocab_size));
  cpu::rms_norm(x + (S - rows) * D, weights_->final_norm.weight.data(), rows, D, c.rms_eps, h.data());
  weights_->lm_head->forward(h.data(), rows, out.data());
  return out;
}

std::vector<float> CpuEngine::forward(SequenceState& seq_base, const std::vector<int32_t>& tokens, bool all_logits) {
  CpuSequence& seq = own_sequence(seq_base);
  const ModelConfig& c = weights_->config;
  const int64_t S = int64_t(tokens.size()), pos0 = seq.length();
  if (S == 0) fail("forward: no tokens");
  if (pos0 + S > c.max_position) fail("context length exceeded: {} + {} tokens > {}", pos0, S, c.max_position);
  std::vector<float> x(size_t(S * c.hidden_size));
  embed(tokens, x.data());
  cpu::TokenSelection selection;
  ambiguous_.assign(size_t(S), 0);
  forward_layers(seq, x.data(), S, pos0, 0, c.num_layers, selection, &ambiguous_);
  seq.length_ = pos0 + S;
  return logits(x.data(), S, all_logits ? S : 1);
}

}  // namespace moesrv
