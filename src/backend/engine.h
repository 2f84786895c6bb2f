// The inference interface the server, CLI and tools program against. Backends (CPU, CUDA, hybrid) implement it.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "util/error.h"

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

// Speculative decoding with the checkpoint's multi-token-prediction (MTP) block: an optional capability of an
// engine (Engine::mtp(), nullptr when the engine or the checkpoint has none). "Hidden" is the vector the head reads
// (after the final norm; with mHC streams, their mean then the norm), [hidden_size] per token.
class MtpEngine {
 public:
  virtual ~MtpEngine() = default;
  virtual int64_t hidden_size() const = 0;
  // Engine::forward that also returns every token's hidden state in `hidden` [n, hidden_size]. With `rollback`, the
  // tokens run as n single-token forwards would (bit for bit) and the sequence keeps a rollback point after each
  // one: truncate() may cut it back to any length in (length before, length after] until its next forward.
  virtual std::vector<float> forward_hidden(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits,
                                            bool rollback, std::vector<float>& hidden) = 0;
  // The MTP block's own state (its layer's cache) for one sequence.
  virtual std::unique_ptr<SequenceState> new_mtp_sequence() const = 0;
  // Appends n positions p = length .. length + n - 1 to the MTP state: row i pairs hidden[i] (the hidden state at p,
  // from the model or from the previous MTP step) with next[i] (the token at p + 1). Returns the logits of the last
  // row [vocab] (its guess at the token at p + 2) and that row's MTP hidden state in hidden_out [hidden_size].
  virtual std::vector<float> mtp_forward(SequenceState& mtp_seq, const std::vector<int32_t>& next,
                                         const std::vector<float>& hidden, std::vector<float>& hidden_out) = 0;
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
  // True when sequence states may be created, cloned, truncated and freed on other threads while forward() or
  // forward_batch() runs on another sequence (what the server's --max-batch > 1 does: the prefix cache clones on the
  // request threads). Engines whose states live on a device say false until they synchronise that.
  virtual bool concurrent_sequence_ops() const { return false; }
  // Bytes one sequence's state holds after `tokens` tokens (what admission reserves per request); 0: unknown.
  virtual uint64_t sequence_bytes(int64_t tokens) const { return 0; }
  // Appends `tokens` to the sequence and returns logits: [vocab] for the last token, or [n, vocab] for all.
  virtual std::vector<float> forward(SequenceState& seq, const std::vector<int32_t>& tokens,
                                     bool all_logits = false) = 0;
  // Greedy decoding: appends `tokens` as forward() does and returns the id std::max_element picks from the last
  // token's logits (the lowest id among equal maxima; 0 when the first is NaN), without handing the logits over;
  // argmax_logits() returns those logits on demand, called right after it (before any other call that appends
  // tokens). An engine may pick the id where the logits are (the CUDA engine: on the device, 4 bytes back instead of
  // the row).
  virtual int32_t forward_argmax(SequenceState& seq, const std::vector<int32_t>& tokens) {
    argmax_logits_ = forward(seq, tokens);
    return int32_t(std::max_element(argmax_logits_.begin(), argmax_logits_.end()) - argmax_logits_.begin());
  }
  virtual std::vector<float> argmax_logits() { return argmax_logits_; }
  // One decode step of several sequences: tokens[i] is appended to *seqs[i] (each at its own length) and result[i]
  // is its logits [vocab], exactly what forward(*seqs[i], {tokens[i]}) returns. The sequences must be distinct. This
  // default runs them one after another; an engine may run the rows together (the CPU engine batches the
  // row-independent blocks, reading each weight once per step).
  virtual std::vector<std::vector<float>> forward_batch(const std::vector<SequenceState*>& seqs,
                                                        const std::vector<int32_t>& tokens) {
    MOESRV_CHECK(seqs.size() == tokens.size(), "forward_batch: {} sequences, {} tokens", seqs.size(), tokens.size());
    std::vector<std::vector<float>> out;
    out.reserve(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) out.push_back(forward(*seqs[i], {tokens[i]}));
    return out;
  }
  // Routed-expert selections recorded so far, when the engine records them (persisted for pinning).
  virtual const UsageStats* expert_usage() const { return nullptr; }
  // Speculative decoding with the MTP block (see MtpEngine); nullptr: not available.
  virtual MtpEngine* mtp() { return nullptr; }

 private:
  std::vector<float> argmax_logits_;  // the default forward_argmax's row
};

}  // namespace moesrv
