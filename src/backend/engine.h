// The inference interface the server, CLI and tools program against. Backends (CPU, CUDA, hybrid) implement it.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moesrv {

class UsageStats;

// Per-sequence state: the KV cache (and any recurrent state) after `length()` tokens.
class SequenceState {
 public:
  virtual ~SequenceState() = default;
  virtual int64_t length() const = 0;
  virtual void truncate(int64_t n) = 0;                      // keep the first n tokens (n a resume point)
  virtual std::unique_ptr<SequenceState> clone() const = 0;  // deep copy (prefix cache snapshots)
  virtual size_t bytes() const = 0;                          // memory held
  // The longest length <= n that truncate() accepts: n for KV caches; for recurrent state, a checkpoint.
  virtual int64_t resume_point(int64_t n) const { return n; }
  // Records a resume point at the current length (recurrent state; KV caches need none).
  virtual void checkpoint() {}
  // Holds fixed-size state (recurrent, conv, open k-pool) that resumes only at checkpoints.
  virtual bool has_fixed_state() const { return false; }
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual std::string name() const = 0;  // model id served on /v1/models
  virtual int64_t vocab_size() const = 0;
  virtual int64_t max_context() const = 0;
  // Prompt tokens per forward call that keep a prefill at the engine's full speed (its pass length). A caller that
  // cuts a prompt into calls (cancellation, progress) cuts at this size: shorter calls re-run per-pass work (a GPU
  // engine's expert plan, a hybrid engine's expert transfers) more often.
  virtual int64_t prefill_chunk() const { return 512; }
  virtual std::unique_ptr<SequenceState> new_sequence() const = 0;
  // Appends `tokens` to the sequence and returns logits: [vocab] for the last token, or [n, vocab] for all.
  virtual std::vector<float> forward(SequenceState& seq, const std::vector<int32_t>& tokens,
                                     bool all_logits = false) = 0;
  // Routed-expert selections recorded so far, when the engine records them (persisted for pinning).
  virtual const UsageStats* expert_usage() const { return nullptr; }
};

}  // namespace moesrv
