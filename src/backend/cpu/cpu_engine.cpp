#include "backend/cpu/cpu_engine.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "backend/cpu/cpu_blocks.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/residual.h"
#include "model/decoder.h"
#include "model/state.h"
#include "util/error.h"
#include "util/timing.h"

namespace moesrv {

CpuSequence::CpuSequence(const ModelSpec& c, const void* engine)
    : layers(size_t(c.num_layers)), owner(engine), c_(&c), layout_(state_layout(c, StateStore::Host)) {
  resume_.pool = std::max<int64_t>(1, c.index_kpool);
  for (const StateSpec& st : state_specs(c)) {
    resume_.recurrent |= st.recurrent;
    resume_.fixed_state |= st.recurrent || st.pool > 1;
  }
}

bool CpuSequence::resumable(int64_t n) const {
  return resume_.resumable(n, length_, steps_from_, steps_from_ >= 0 ? length_ : -1, checkpoints_);
}

int64_t CpuSequence::resume_point(int64_t n) const {
  return resume_.point(n, length_, steps_from_, steps_from_ >= 0 ? length_ : -1, checkpoints_);
}

void CpuSequence::checkpoint() {
  if (!resume_.fixed_state || !checkpoints_.wants(length_)) return;
  auto cp = std::make_shared<FixedState>(layers.size());
  for (size_t l = 0; l < layers.size(); ++l) (*cp)[l] = save_fixed(cpu::HostStore{}, layout_[l], layers[l]);
  checkpoints_.push(length_, std::move(cp));
}

void CpuSequence::record_steps() {
  drop_steps();
  for (auto& L : layers) L.record_steps = true;
  steps_from_ = length_;
}

void CpuSequence::stop_recording() {
  for (auto& L : layers) L.record_steps = false;
}

void CpuSequence::drop_steps() {
  for (auto& L : layers) L.steps.clear();
  steps_from_ = -1;
}

void CpuSequence::truncate(int64_t n) {
  if (n < 0 || n > length_) fail("truncate({}) outside sequence of length {}", n, length_);
  if (n == length_) return drop_steps();
  if (!resumable(n)) fail("truncate({}): the recurrent state can only resume at a checkpoint (nearest: {})", n, resume_point(n));
  const FixedState* cp = checkpoints_.at(n);
  const int64_t step = steps_from_ >= 0 && n > steps_from_ ? n - steps_from_ - 1 : -1;  // a rollback point
  for (size_t l = 0; l < layers.size(); ++l) {
    cpu::LayerState& L = layers[l];
    const cpu::StateBuffers* from = cp ? &(*cp)[l] : nullptr;  // nullptr: n == 0, or a pool boundary of a k-pool model
    if (step >= 0) from = L.steps.empty() ? &L : &L.steps[size_t(step)];  // a rollback point
    cut_to(cpu::HostStore{}, layout_[l], L, n, from);
  }
  checkpoints_.drop_after(n);
  length_ = n;
  drop_steps();
}

size_t CpuSequence::bytes() const {
  size_t b = 0;
  for (const auto& L : layers) b += L.bytes();
  checkpoints_.for_each([&b](int64_t, const FixedState& f) {
    for (const auto& L : f) b += layer_bytes(cpu::HostStore{}, L);
  });
  return b;
}

CpuEngine::CpuEngine(std::shared_ptr<ModelPackage> pkg, std::string served_name, const ModelSpec* spec)
    : weights_(spec ? ModelWeights::load(pkg, *spec, load_linear) : ModelWeights::load(pkg, load_linear)),
      rope_(weights_->config.rope),
      name_(std::move(served_name)),
      usage_(weights_->config.num_layers, std::max<int64_t>(1, weights_->config.n_routed_experts),
             std::max<int64_t>(1, weights_->config.experts_per_token)) {
  if (name_.empty()) name_ = std::filesystem::path(pkg->dir()).filename().string();
  if (weights_->mtp_block) mtp_spec_ = weights_->config.mtp_block();
  batch_plan_ = cpu::BatchPlan::of(*weights_);
}

std::unique_ptr<CpuEngine> CpuEngine::open(const std::string& model_dir, std::string served_name) {
  return std::make_unique<CpuEngine>(ModelPackage::open(model_dir), std::move(served_name));
}

std::unique_ptr<SequenceState> CpuEngine::new_sequence() const {
  return std::make_unique<CpuSequence>(weights_->config, this);
}

CpuSequence& CpuEngine::own_sequence(SequenceState& seq_base) const {
  auto* seq = dynamic_cast<CpuSequence*>(&seq_base);
  if (!seq || seq->owner != this) fail("forward: sequence state was not created by this engine");
  return *seq;
}

void CpuEngine::embed(const std::vector<int32_t>& tokens, float* x) const {
  const ModelSpec& c = weights_->config;
  const int64_t D = c.hidden_size, n = c.residual.streams;
  for (size_t s = 0; s < tokens.size(); ++s) {
    int32_t t = tokens[s];
    if (t < 0 || t >= c.vocab_size) fail("token id {} outside vocabulary [0, {})", t, c.vocab_size);
    float* row = x + int64_t(s) * n * D;
    weights_->embed->rows_to_f32(t, t + 1, row);
    for (int64_t i = 1; i < n; ++i) std::copy(row, row + D, row + i * D);
  }
}

void CpuEngine::forward_layers(CpuSequence& seq, float* x, int64_t S, int64_t pos0, int64_t begin, int64_t end,
                               cpu::TokenSelection& selection) {
  cpu::CpuBlocks blocks(weights_->config, weights_->layers.data(), rope_, seq.layers.data(), x, S, pos0, selection,
                        &usage_);
  if (!step_times_) return run_decoder_layers(weights_->config, blocks, begin, end);
  step_times_->layer_s.resize(size_t(weights_->config.num_layers), 0.0);
  for (int64_t l = begin; l < end; ++l) {
    const auto t0 = std::chrono::steady_clock::now();
    run_decoder_layers(weights_->config, blocks, l, l + 1);
    step_times_->layer_s[size_t(l)] += seconds_since(t0);
  }
}

double CpuEngine::StepTimes::total() const {
  double t = embed_s + head_s;
  for (double x : layer_s) t += x;
  return t;
}

void CpuEngine::StepTimes::add(const StepTimes& o) {
  layer_s.resize(std::max(layer_s.size(), o.layer_s.size()), 0.0);
  for (size_t i = 0; i < o.layer_s.size(); ++i) layer_s[i] += o.layer_s[i];
  embed_s += o.embed_s;
  head_s += o.head_s;
}

std::vector<float> CpuEngine::head_input(const float* x, int64_t S) const {
  const ModelSpec& c = weights_->config;
  const int64_t D = c.hidden_size, n = c.residual.streams;
  std::vector<float> h(size_t(S * D), 0.0f);
  for (int64_t r = 0; r < S; ++r) {  // mean over the residual streams
    const float* X = x + r * n * D;
    for (int64_t i = 0; i < n; ++i) cpu::axpy(1.0f, X + i * D, D, h.data() + r * D);
    if (n > 1)
      for (int64_t d = 0; d < D; ++d) h[size_t(r * D + d)] /= float(n);
  }
  cpu::rms_norm(h.data(), weights_->final_norm.weight.data(), S, D, c.rms_eps, h.data());
  return h;
}

std::vector<float> CpuEngine::logits(const float* x, int64_t S, int64_t rows) const {
  const ModelSpec& c = weights_->config;
  std::vector<float> h = head_input(x + (S - rows) * c.stream_width(), rows), out(size_t(rows * c.vocab_size));
  weights_->lm_head->forward(h.data(), rows, out.data());
  return out;
}

std::vector<float> CpuEngine::forward(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits) {
  return run(own_sequence(seq), tokens, all_logits, false, nullptr);
}

std::vector<std::vector<float>> CpuEngine::forward_batch(const std::vector<SequenceState*>& seqs,
                                                         const std::vector<int32_t>& tokens) {
  const ModelSpec& c = weights_->config;
  const int64_t B = int64_t(seqs.size()), W = c.stream_width(), V = c.vocab_size;
  MOESRV_CHECK(seqs.size() == tokens.size(), "forward_batch: {} sequences, {} tokens", seqs.size(), tokens.size());
  if (B == 0) return {};
  std::vector<CpuSequence*> own;
  std::vector<cpu::LayerState*> states;
  std::vector<int64_t> pos;
  for (SequenceState* s : seqs) {
    CpuSequence& seq = own_sequence(*s);
    MOESRV_CHECK(std::find(own.begin(), own.end(), &seq) == own.end(), "forward_batch: a sequence appears twice");
    if (seq.length() + 1 > c.max_position)
      fail("context length exceeded: {} + 1 tokens > {}", seq.length(), c.max_position);
    own.push_back(&seq);
    states.push_back(seq.layers.data());
    pos.push_back(seq.length());
  }
  for (CpuSequence* seq : own) seq->drop_steps();
  std::vector<float> x(size_t(B * W));
  embed(tokens, x.data());
  cpu::BatchBlocks blocks(c, weights_->layers.data(), rope_, std::move(states), std::move(pos), x.data(), batch_plan_,
                          &usage_);
  run_decoder_layers(c, blocks, 0, c.num_layers);
  for (CpuSequence* seq : own) ++seq->length_, seq->stop_recording();
  std::vector<float> h = head_input(x.data(), B), all(size_t(B * V));
  if (batch_plan_.head) weights_->lm_head->forward(h.data(), B, all.data());
  else
    for (int64_t b = 0; b < B; ++b) weights_->lm_head->forward(h.data() + b * c.hidden_size, 1, all.data() + b * V);
  std::vector<std::vector<float>> out(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) out[size_t(b)].assign(all.begin() + b * V, all.begin() + (b + 1) * V);
  return out;
}

uint64_t CpuEngine::sequence_bytes(int64_t tokens) const {
  // fp32 state, plus the host checkpoints of the fixed state (one per kCheckpointInterval prompt tokens and the
  // prompt's end, at most kMaxCheckpoints).
  const ModelSpec& c = weights_->config;
  const uint64_t checkpoints =
      std::min<uint64_t>(CpuSequence::kMaxCheckpoints, uint64_t(tokens / kCheckpointInterval) + 2);
  return state_bytes(c, tokens, 4) + checkpoints * state_bytes(c, 0, 4);
}

PassPolicy CpuEngine::pass_policy() const {
  return pass_policy_for(weights_->config.has_recurrent_layers(), 0, int64_t(CpuSequence::kMaxCheckpoints));
}

std::vector<float> CpuEngine::forward_hidden(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits,
                                             bool rollback, std::vector<float>& hidden) {
  hidden.clear();
  return run(own_sequence(seq), tokens, all_logits, rollback, &hidden);
}

std::vector<float> CpuEngine::run(CpuSequence& seq, const std::vector<int32_t>& tokens, bool all_logits, bool rollback,
                                  std::vector<float>* hidden) {
  const ModelSpec& c = weights_->config;
  const int64_t S = int64_t(tokens.size()), pos0 = seq.length(), W = c.stream_width();
  if (S == 0) fail("forward: no tokens");
  if (pos0 + S > c.max_position) fail("context length exceeded: {} + {} tokens > {}", pos0, S, c.max_position);
  std::vector<float> out;
  if (all_logits) out.reserve(size_t(S * c.vocab_size));
  if (rollback) seq.record_steps();
  else seq.drop_steps();
  for_each_pass(pass_policy(), seq, pos0, S, rollback, [&](const Pass& p) {
    std::vector<int32_t> piece(tokens.begin() + p.offset, tokens.begin() + p.offset + p.rows);
    std::vector<float> x(size_t(p.rows * W));
    auto t0 = std::chrono::steady_clock::now();
    embed(piece, x.data());
    if (step_times_) step_times_->embed_s += seconds_since(t0);
    cpu::TokenSelection selection;
    forward_layers(seq, x.data(), p.rows, p.pos0, 0, c.num_layers, selection);
    if (hidden) {
      auto h = head_input(x.data(), p.rows);
      hidden->insert(hidden->end(), h.begin(), h.end());
    }
    if (all_logits || p.last) {
      t0 = std::chrono::steady_clock::now();
      auto part = logits(x.data(), p.rows, all_logits ? p.rows : 1);
      if (step_times_) step_times_->head_s += seconds_since(t0);
      out.insert(out.end(), part.begin(), part.end());
    }
  });
  seq.stop_recording();
  return out;
}

void CpuSequence::repeat_rows_to(int64_t tokens) {
  const int64_t t0 = length_, pool = std::max<int64_t>(1, c_->index_kpool);
  if (t0 <= 0 || tokens < t0 || t0 % pool || tokens % pool)
    fail("repeat_rows_to: {} -> {} tokens (pool {})", t0, tokens, pool);
  for (size_t l = 0; l < layers.size(); ++l)
    for_each_slot(layout_[l], [&](size_t i, const SlotShape& s) {
      std::vector<float>& v = layers[l].buf[i];
      if (s.growth == Growth::Fixed || v.empty()) return;
      const int64_t rows0 = layout_[l].rows(s.growth, t0), rows = layout_[l].rows(s.growth, tokens);
      v.resize(size_t(rows * s.width));
      for (int64_t r = rows0; r < rows; ++r)
        std::copy_n(v.begin() + (r % rows0) * s.width, s.width, v.begin() + r * s.width);
    });
  length_ = tokens;
}

}  // namespace moesrv
