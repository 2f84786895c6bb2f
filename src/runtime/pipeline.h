// Pipeline parallelism: the model's layers split into contiguous ranges, one per stage (GPU). Stage 0 embeds,
// each stage runs its layers and hands the hidden state to the next through host memory (no P2P needed),
// and the last stage computes logits. One token batch flows through the stages in order.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/engine.h"
#include "backend/stage_activations.h"

namespace moesrv {

// StageActivations (what travels from stage to stage) is in backend/stage_activations.h, so engines can fill it.

// One device's share of the model. Only the first stage embeds and only the last computes logits.
class PipelineStage {
 public:
  virtual ~PipelineStage() = default;
  virtual std::unique_ptr<SequenceState> new_sequence() const = 0;
  // Fills a.hidden from the token embeddings.
  virtual void embed(const std::vector<int32_t>& tokens, StageActivations& a) = 0;
  // Runs layers [begin, end) on a.hidden in place, appending to seq's caches; sets seq's length to pos0 + S.
  virtual void forward_layers(SequenceState& seq, StageActivations& a, int64_t begin, int64_t end) = 0;
  // Final norm + lm_head over the last `rows` tokens: [rows, vocab].
  virtual std::vector<float> logits(const StageActivations& a, int64_t rows) = 0;
};

struct PipelineStageSpec {
  std::shared_ptr<PipelineStage> stage;
  int64_t layer_begin = 0, layer_end = 0;
};

// Holds one sequence state per stage; they always have the same length.
class PipelineSequence : public SequenceState {
 public:
  std::vector<std::unique_ptr<SequenceState>> stages;
  const void* owner = nullptr;
  int64_t length() const override { return stages.empty() ? 0 : stages[0]->length(); }
  void truncate(int64_t n) override;
  std::unique_ptr<SequenceState> clone() const override;
  size_t bytes() const override;
  int64_t resume_point(int64_t n) const override;
  void checkpoint() override;
  bool has_fixed_state() const override;
};

struct PipelineModelInfo {
  std::string name;
  int64_t vocab_size = 0, max_context = 0, num_layers = 0;
  int64_t prefill_chunk = 512;  // Engine::prefill_chunk(): the stages' smallest
};

class PipelineEngine : public Engine {
 public:
  // Stages must cover [0, num_layers) with contiguous, non-empty ranges in order.
  PipelineEngine(std::vector<PipelineStageSpec> stages, PipelineModelInfo info);

  std::string name() const override { return info_.name; }
  int64_t vocab_size() const override { return info_.vocab_size; }
  int64_t max_context() const override { return info_.max_context; }
  int64_t prefill_chunk() const override { return info_.prefill_chunk; }
  std::unique_ptr<SequenceState> new_sequence() const override;
  std::vector<float> forward(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits = false) override;

  const std::vector<PipelineStageSpec>& stages() const { return stages_; }

 private:
  std::vector<PipelineStageSpec> stages_;
  PipelineModelInfo info_;
};

}  // namespace moesrv
