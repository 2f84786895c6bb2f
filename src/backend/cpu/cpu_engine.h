// The CPU inference engine: every layer on the host, fp32 activations, weights as stored (bf16/fp8/EXL3).
#pragma once
#include <memory>
#include <string>

#include "backend/checkpoint_list.h"
#include "backend/cpu/batch_blocks.h"
#include "backend/cpu/cpu_layers.h"
#include "backend/engine.h"
#include "backend/pass_plan.h"
#include "model/rope.h"
#include "model/weights.h"

namespace moesrv {

class CpuSequence : public SequenceState {
 public:
  // The fixed-size buffers of every layer's state at one length.
  using FixedState = std::vector<cpu::StateBuffers>;
  static constexpr size_t kMaxCheckpoints = 16;

  CpuSequence(const ModelSpec& c, const void* owner);
  int64_t length() const override { return length_; }
  void truncate(int64_t n) override;
  std::unique_ptr<SequenceState> clone() const override { return std::make_unique<CpuSequence>(*this); }
  size_t bytes() const override;
  int64_t resume_point(int64_t n) const override;
  void checkpoint() override;
  bool has_fixed_state() const override { return resume_.fixed_state; }
  // Rollback points: the next forward records the fixed state after each token (LayerState::steps), so truncate()
  // may cut back into it; dropped by the next forward or truncate.
  void record_steps();
  void stop_recording();
  void drop_steps();

  std::vector<cpu::LayerState> layers;
  int64_t length_ = 0;
  const void* owner = nullptr;  // the engine that created it (layout check)

 private:
  bool resumable(int64_t n) const;
  const ModelSpec* c_;
  std::vector<LayerLayout> layout_;  // state_layout(StateStore::Host)
  ResumeRule resume_;                // where its fixed-size state can resume (checkpoint_list.h)
  int64_t steps_from_ = -1;  // the length before the forward that recorded rollback points (-1: none)
  CheckpointList<FixedState> checkpoints_{kMaxCheckpoints};

 public:
  // bench: grows every per-token buffer by repeating rows, fixed state kept. The MLA latent / rope key, GQA K/V,
  // indexer and pooled keys reach `tokens` rows; recurrent, conv and open-pool state stay. Pool-aligned lengths.
  void repeat_rows_to(int64_t tokens);
};

class CpuEngine : public Engine, public MtpEngine {
 public:
  // `spec`: the package's config already parsed (else it is parsed here).
  explicit CpuEngine(std::shared_ptr<ModelPackage> pkg, std::string served_name = "", const ModelSpec* spec = nullptr);
  static std::unique_ptr<CpuEngine> open(const std::string& model_dir, std::string served_name = "");

  std::string name() const override { return name_; }
  int64_t vocab_size() const override { return weights_->config.vocab_size; }
  int64_t max_context() const override { return weights_->config.max_position; }
  std::unique_ptr<SequenceState> new_sequence() const override;
  // Prefill of a model with recurrent state is cut at multiples of kCheckpointInterval tokens, and the state
  // is checkpointed there and at the end of every multi-token forward (resume points for the prefix cache).
  std::vector<float> forward(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits = false) override;
  // Decode step of several sequences (batch_blocks.h: which blocks run over all rows); bit-identical per row to
  // forward(*seqs[i], {tokens[i]}).
  std::vector<std::vector<float>> forward_batch(const std::vector<SequenceState*>& seqs,
                                                const std::vector<int32_t>& tokens) override;
  uint64_t sequence_bytes(int64_t tokens) const override;
  bool concurrent_sequence_ops() const override { return true; }  // states are host memory, one owner each
  static constexpr int64_t kCheckpointInterval = checkpoint_interval(0);
  int64_t prefill_chunk() const override { return kCheckpointInterval; }
  // Passes of a forward (pass_plan.h's one policy): no row limit, so recurrent models cut and checkpoint every
  // kCheckpointInterval.
  PassPolicy pass_policy() const;

  // MTP speculative decoding (mtp_forward.cpp): available when the package has the MTP block.
  MtpEngine* mtp() override { return weights_->mtp_block ? this : nullptr; }
  int64_t hidden_size() const override { return weights_->config.hidden_size; }
  std::vector<float> forward_hidden(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits,
                                    bool rollback, std::vector<float>& hidden) override;
  std::unique_ptr<SequenceState> new_mtp_sequence() const override;
  std::vector<float> mtp_forward(SequenceState& mtp_seq, const std::vector<int32_t>& next,
                                 const std::vector<float>& hidden, std::vector<float>& hidden_out) override;

  // The steps of forward(), public so a pipeline stage can run a layer range (forward() uses them too).
  // Token embeddings into x [S, stream_width] (copied into every residual stream).
  void embed(const std::vector<int32_t>& tokens, float* x) const;
  // Layers [begin, end) over x [S, stream_width] at positions [pos0, pos0+S) through the decoder loop
  // (model/decoder.h) with the CPU's blocks; appends to seq's state of those layers (seq's length is left to the
  // caller). `selection` is the DSA top-k in and out:
  // a shared layer reuses the selection of the last layer that ran its own indexer.
  void forward_layers(CpuSequence& seq, float* x, int64_t S, int64_t pos0, int64_t begin, int64_t end,
                      cpu::TokenSelection& selection);
  // Collapse the streams, final norm, lm_head over the last `rows` rows of x [S, stream_width]: [rows, vocab].
  std::vector<float> logits(const float* x, int64_t S, int64_t rows) const;
  // The head's input for every row of x [S, stream_width]: mean of the streams, final norm: [S, hidden].
  std::vector<float> head_input(const float* x, int64_t S) const;
  CpuSequence& own_sequence(SequenceState& seq) const;  // checked cast: fails unless new_sequence() made it

  // Seconds spent in forward()'s steps, summed over calls while set (bench: time_steps(&t), forward, nullptr).
  struct StepTimes {
    std::vector<double> layer_s;  // per layer
    double embed_s = 0, head_s = 0;
    double total() const;
    void add(const StepTimes& o);
  };
  void time_steps(StepTimes* t) { step_times_ = t; }

  const ModelSpec& config() const { return weights_->config; }
  // Routed-expert selections seen so far (for pinning hot experts at the next start, see usage_placement.h).
  const UsageStats* expert_usage() const override { return &usage_; }
  const ModelWeights& weights() const { return *weights_; }

 private:
  // forward() and forward_hidden(): `hidden` (when given) receives every token's head input.
  std::vector<float> run(CpuSequence& seq, const std::vector<int32_t>& tokens, bool all_logits, bool rollback,
                         std::vector<float>* hidden);

  std::unique_ptr<ModelWeights> weights_;
  StepTimes* step_times_ = nullptr;
  cpu::BatchPlan batch_plan_;  // the blocks forward_batch runs over all rows
  ModelSpec mtp_spec_;  // the MTP block as a one-layer model (plain residual); set when the block is loaded
  Rope rope_;
  std::string name_;
  UsageStats usage_;
};

}  // namespace moesrv
