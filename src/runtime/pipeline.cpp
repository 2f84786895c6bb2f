#include "runtime/pipeline.h"

#include "util/error.h"

namespace moesrv {

void PipelineSequence::truncate(int64_t n) {
  for (auto& s : stages) s->truncate(n);
}

std::unique_ptr<SequenceState> PipelineSequence::clone() const {
  auto c = std::make_unique<PipelineSequence>();
  c->owner = owner;
  for (const auto& s : stages) c->stages.push_back(s->clone());
  return c;
}

size_t PipelineSequence::bytes() const {
  size_t b = 0;
  for (const auto& s : stages) b += s->bytes();
  return b;
}

int64_t PipelineSequence::resume_point(int64_t n) const {
  for (bool moved = true; moved;) {  // the longest point every stage can resume from
    moved = false;
    for (const auto& s : stages) {
      const int64_t m = s->resume_point(n);
      moved |= m != n;
      n = m;
    }
  }
  return n;
}

void PipelineSequence::checkpoint() {
  for (auto& s : stages) s->checkpoint();
}

bool PipelineSequence::has_fixed_state() const {
  for (const auto& s : stages)
    if (s->has_fixed_state()) return true;
  return false;
}

PipelineEngine::PipelineEngine(std::vector<PipelineStageSpec> stages, PipelineModelInfo info)
    : stages_(std::move(stages)), info_(std::move(info)) {
  if (stages_.empty()) fail("pipeline: no stages");
  int64_t next = 0;
  for (size_t i = 0; i < stages_.size(); ++i) {
    const auto& s = stages_[i];
    if (!s.stage) fail("pipeline: stage {} is missing", i);
    if (s.layer_begin != next || s.layer_end <= s.layer_begin)
      fail("pipeline: stage {} has layers [{}, {}), expected a non-empty range starting at {}", i, s.layer_begin,
           s.layer_end, next);
    next = s.layer_end;
  }
  if (next != info_.num_layers) fail("pipeline: stages cover {} of {} layers", next, info_.num_layers);
}

std::unique_ptr<SequenceState> PipelineEngine::new_sequence() const {
  auto s = std::make_unique<PipelineSequence>();
  s->owner = this;
  for (const auto& st : stages_) s->stages.push_back(st.stage->new_sequence());
  return s;
}

std::vector<float> PipelineEngine::forward(SequenceState& seq_base, const std::vector<int32_t>& tokens, bool all_logits) {
  auto* seq = dynamic_cast<PipelineSequence*>(&seq_base);
  if (!seq || seq->owner != this) fail("forward: sequence state was not created by this engine");
  const int64_t S = int64_t(tokens.size()), pos0 = seq->length();
  if (S == 0) fail("forward: no tokens");
  if (pos0 + S > info_.max_context) fail("context length exceeded: {} + {} tokens > {}", pos0, S, info_.max_context);
  StageActivations a;
  a.tokens = S;
  a.pos0 = pos0;
  stages_.front().stage->embed(tokens, a);
  // Hand-off between stages is the activations object itself (host memory); a device stage copies in and out.
  try {
    for (size_t i = 0; i < stages_.size(); ++i)
      stages_[i].stage->forward_layers(*seq->stages[i], a, stages_[i].layer_begin, stages_[i].layer_end);
  } catch (...) {
    // A failed pass leaves every stage as it was, not some stages ahead of others (where the state can be
    // rewound: recurrent state without a checkpoint at pos0 cannot, and such a sequence must be dropped).
    if (seq->resume_point(pos0) == pos0) seq->truncate(pos0);
    throw;
  }
  return stages_.back().stage->logits(a, all_logits ? S : 1);
}

}  // namespace moesrv
