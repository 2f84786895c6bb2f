// Speculative decoding with the checkpoint's MTP block (Engine::mtp()): the block drafts up to k tokens, each step
// chained on the previous one's hidden state; the model runs the last chosen token and the drafts in one forward
// (logits for all, a rollback point after each); the caller accepts a prefix (Sampler::accept_draft) and commits
// it: the model's state is cut back to it (attention caches truncated, recurrent and conv state restored from the
// rollback points), and so is the MTP block's own cache, which then catches up on the model's hidden states.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/checkpoint_list.h"
#include "backend/engine.h"
#include "serving/draft_policy.h"
#include "serving/sampler.h"

namespace moesrv {

struct SpeculativeStats {
  int64_t steps = 0;     // verify forwards (plain steps of the adaptive draft length included)
  int64_t plain = 0;     // steps without drafts (DraftPolicy chose 0)
  int64_t drafted = 0;   // draft tokens verified
  int64_t accepted = 0;  // draft tokens accepted
  double acceptance_rate() const { return drafted ? double(accepted) / double(drafted) : 0.0; }
  // Tokens the model commits per verify forward: the accepted drafts plus the one each step chooses itself.
  double tokens_per_step() const { return steps ? double(steps + accepted) / double(steps) : 0.0; }
};

// The decoder's own state at one model length: the MTP block's cache and the model's hidden rows (with their next
// tokens) it has not run yet. With the model's state at that length it resumes speculative decoding there.
struct MtpResume {
  int64_t length = 0;  // the model's length
  std::shared_ptr<const SequenceState> mtp;
  std::vector<float> pending_hidden;
  std::vector<int32_t> pending_next;
  size_t bytes() const { return mtp->bytes() + pending_hidden.size() * 4 + pending_next.size() * 4; }
};

class SpeculativeDecoder {
 public:
  // Picks the draft token for sequence position `pos` from the MTP block's logits (default: the argmax).
  using DraftPicker = std::function<int32_t(int64_t pos, std::span<const float> mtp_logits)>;
  // Fails unless the engine has an MTP block. k: draft tokens per step, >= 1; with a policy (whose max_k is k), the
  // policy picks 0..k each step. A step without drafts is a plain decode step: the MTP block catches up on its
  // positions at the next step that drafts (or once kMaxDeferredRows wait), in one forward.
  SpeculativeDecoder(Engine& engine, int k, DraftPicker picker = {}, std::shared_ptr<DraftPolicy> policy = {});
  static constexpr int64_t kMaxDeferredRows = 64;

  // Runs `tokens` (a prompt, or its next chunk) through the model on `seq`, and through the MTP block every
  // position whose next token is known. Returns the last token's logits.
  std::vector<float> prefill(SequenceState& seq, const std::vector<int32_t>& tokens);

  struct Step {
    std::vector<int32_t> draft;  // up to k tokens
    std::vector<float> logits;   // [draft + 1, vocab]: row j scores the token after draft j - 1 (row 0: after last)
  };
  // `last`: the token chosen from the previous logits, not yet run. Drafts min(k, max_draft) tokens (the policy's
  // choice instead of k where there is one; fewer near the context end) and runs `last` and the drafts through the
  // model.
  Step step(SequenceState& seq, int32_t last, int64_t max_draft);
  // Keeps `last` and the first `accepted` drafts of the last step in `seq` (the token chosen after them is the next
  // step's `last`).
  void commit(SequenceState& seq, int64_t accepted);

  // The decoder's state for `seq` at its current length (between steps). `keep_mtp`: the MTP cache is copied
  // (decoding goes on); otherwise it is moved into the result and the decoder is done.
  MtpResume save(const SequenceState& seq, bool keep_mtp);
  // Continues from `r` with `seq` holding the model's state at r.length (a resumed prefix); then prefill goes on.
  void restore(const SequenceState& seq, const MtpResume& r);

  const SpeculativeStats& stats() const { return stats_; }
  const SequenceState& mtp_state() const { return *mtp_seq_; }  // the MTP block's cache

 private:
  Engine& engine_;
  MtpEngine& mtp_;
  int k_;
  DraftPicker picker_;
  std::shared_ptr<DraftPolicy> policy_;
  std::unique_ptr<SequenceState> mtp_seq_;
  int64_t D_;
  // Model hidden states whose MTP positions have not run yet, and the next tokens of all of them but the last.
  std::vector<float> pending_hidden_;
  std::vector<int32_t> pending_next_;
  // The last step: the model's and the MTP block's lengths before its drafts, its drafts and hidden states.
  int64_t step_len_ = -1, mtp_len_ = 0;
  std::vector<int32_t> step_draft_;
  std::vector<float> step_hidden_;
  // The policy's timing of the last step: its start and the seconds of a deferred catch-up inside it (not its cost).
  std::chrono::steady_clock::time_point step_start_;
  double step_catchup_s_ = 0;
  bool deferred_ = false;  // a plain step left the MTP block's catch-up to a later one
  SpeculativeStats stats_;
};

// A prefix-cache entry of speculative decoding: the model's state plus the decoder's at anchor lengths (the end of a
// prompt but its last token, the end of a generation), the only lengths it resumes at (the model's state must
// resume there too: a checkpoint for recurrent state). Anchors are immutable and shared by clones.
class SpeculativeSequence : public SequenceState {
 public:
  static constexpr size_t kMaxAnchors = 4;  // two turns
  explicit SpeculativeSequence(std::unique_ptr<SequenceState> model_state) : model(std::move(model_state)) {}
  int64_t length() const override { return model->length(); }
  void truncate(int64_t n) override;
  std::unique_ptr<SequenceState> clone() const override;
  size_t bytes() const override;
  int64_t resume_point(int64_t n) const override;
  void checkpoint() override { model->checkpoint(); }
  bool has_fixed_state() const override { return true; }
  void add_anchor(MtpResume r);
  const MtpResume* anchor(int64_t length) const { return anchors_.at(length); }

  std::unique_ptr<SequenceState> model;

 private:
  CheckpointList<MtpResume> anchors_{kMaxAnchors};
};

// --speculative: "mtp:K" (up to K draft tokens per step, 1..3, the number each step chosen by a DraftPolicy),
// "mtp:K:fixed" (always K), "" or "off" (k = 0); anything else fails naming the value.
struct SpeculativeOption {
  int k = 0;
  bool adaptive = true;
  std::shared_ptr<DraftPolicy> policy() const { return k > 0 && adaptive ? std::make_shared<DraftPolicy>(k) : nullptr; }
};
SpeculativeOption parse_speculative(const std::string& spec);

// Generates up to `max_new` tokens after `prompt` with MTP drafts of up to k tokens per step. Lossless: tokens are
// distributed as the sampler's plain decoding; at temperature 0 they are the same tokens.
std::vector<int32_t> generate_speculative(Engine& engine, const std::vector<int32_t>& prompt, int64_t max_new,
                                          Sampler& sampler, int k, SpeculativeStats* stats = nullptr,
                                          SpeculativeDecoder::DraftPicker picker = {},
                                          std::shared_ptr<DraftPolicy> policy = {});

}  // namespace moesrv
