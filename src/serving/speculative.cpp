#include "serving/speculative.h"

#include <algorithm>

#include "backend/pass_plan.h"
#include "util/error.h"

namespace moesrv {

namespace {
MtpEngine& require_mtp(Engine& e) {
  MtpEngine* m = e.mtp();
  if (!m)
    fail(
        "speculative decoding: {} has no MTP block on this engine (num_nextn_predict_layers and the layer's "
        "tensors in the package; the CPU engine and the one-GPU CUDA engine run it)",
        e.name());
  return *m;
}
}  // namespace

SpeculativeDecoder::SpeculativeDecoder(Engine& engine, int k, DraftPicker picker, std::shared_ptr<DraftPolicy> policy)
    : engine_(engine),
      mtp_(require_mtp(engine)),
      k_(k),
      picker_(std::move(picker)),
      policy_(std::move(policy)),
      D_(mtp_.hidden_size()) {
  if (k < 1) fail("speculative decoding: {} draft tokens (at least 1)", k);
  if (policy_ && policy_->max_k() != k)
    fail("speculative decoding: a draft policy of up to {} tokens for {} per step", policy_->max_k(), k);
  if (!picker_) picker_ = [](int64_t, std::span<const float> l) { return argmax(l); };
  mtp_seq_ = mtp_.new_mtp_sequence();
}

std::vector<float> SpeculativeDecoder::prefill(SequenceState& seq, const std::vector<int32_t>& tokens) {
  if (seq.length() != mtp_seq_->length() + int64_t(pending_hidden_.size()) / D_)
    fail("speculative prefill: the sequence holds {} tokens the MTP block has not seen", seq.length());
  std::vector<float> hidden;
  auto logits = mtp_.forward_hidden(seq, tokens, false, false, hidden);
  pending_next_.insert(pending_next_.end(), tokens.begin() + (pending_hidden_.empty() ? 1 : 0), tokens.end());
  pending_hidden_.insert(pending_hidden_.end(), hidden.begin(), hidden.end());
  const int64_t rows = int64_t(pending_hidden_.size()) / D_;
  if (rows > 1) {  // every row but the last knows its next token: run them through the MTP block now
    std::vector<float> out;
    mtp_.mtp_forward(*mtp_seq_, pending_next_, std::vector<float>(pending_hidden_.begin(), pending_hidden_.end() - D_),
                     out);
    pending_hidden_.erase(pending_hidden_.begin(), pending_hidden_.end() - D_);
    pending_next_.clear();
  }
  return logits;
}

SpeculativeDecoder::Step SpeculativeDecoder::step(SequenceState& seq, int32_t last, int64_t max_draft) {
  if (pending_hidden_.empty()) fail("speculative step before prefill");
  using clock = std::chrono::steady_clock;
  step_start_ = clock::now();
  step_catchup_s_ = 0;
  const int64_t n = seq.length();
  const int64_t want = policy_ ? policy_->next() : k_;
  const int64_t k = std::max<int64_t>(0, std::min({want, max_draft, engine_.max_context() - n - 1}));
  Step st;
  // The MTP block catches up on the model (positions up to n - 1, the last one with `last` as its next token);
  // its guess there is the first draft, and each draft feeds the next MTP step with that step's hidden state. A
  // step without drafts leaves that to a later step (every pending row knows its next token then).
  pending_next_.push_back(last);
  const int64_t pending_rows = int64_t(pending_hidden_.size()) / D_;
  mtp_len_ = mtp_seq_->length();
  if (k > 0 || pending_rows >= kMaxDeferredRows) {
    std::vector<float> g, g_next;
    const auto t = clock::now();
    auto l = mtp_.mtp_forward(*mtp_seq_, pending_next_, pending_hidden_, g);
    if (deferred_ || k == 0)  // rows plain steps left: their cost, not this step's
      step_catchup_s_ = std::chrono::duration<double>(clock::now() - t).count();
    deferred_ = false;
    pending_hidden_.clear();
    pending_next_.clear();
    mtp_len_ = mtp_seq_->length();
    if (k > 1) mtp_seq_->checkpoint();  // the chained positions are drafts: cut back to here at commit
    for (int64_t j = 0; j < k; ++j) {
      st.draft.push_back(picker_(n + 1 + j, l));
      if (j + 1 < k) {
        l = mtp_.mtp_forward(*mtp_seq_, {st.draft.back()}, g, g_next);
        g.swap(g_next);
      }
    }
  }
  if (k == 0) deferred_ = !pending_hidden_.empty();
  std::vector<int32_t> tokens{last};
  tokens.insert(tokens.end(), st.draft.begin(), st.draft.end());
  st.logits = mtp_.forward_hidden(seq, tokens, true, k > 0, step_hidden_);
  step_len_ = n;
  step_draft_ = st.draft;
  ++stats_.steps;
  stats_.plain += k == 0;
  stats_.drafted += k;
  return st;
}

void SpeculativeDecoder::commit(SequenceState& seq, int64_t accepted) {
  if (step_len_ < 0 || accepted < 0 || accepted > int64_t(step_draft_.size()))
    fail("speculative commit without a step");
  seq.truncate(step_len_ + 1 + accepted);
  if (mtp_seq_->length() > mtp_len_) mtp_seq_->truncate(mtp_len_);
  // (a step that drafted caught up first: these rows follow nothing pending)
  pending_hidden_.insert(pending_hidden_.end(), step_hidden_.begin(), step_hidden_.begin() + (accepted + 1) * D_);
  pending_next_.insert(pending_next_.end(), step_draft_.begin(), step_draft_.begin() + accepted);
  stats_.accepted += accepted;
  step_len_ = -1;
  if (policy_) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start_).count();
    policy_->record(int(step_draft_.size()), accepted, std::max(0.0, s - step_catchup_s_));
  }
}

MtpResume SpeculativeDecoder::save(const SequenceState& seq, bool keep_mtp) {
  if (step_len_ >= 0) fail("speculative save inside a step");
  MtpResume r{seq.length(), nullptr, pending_hidden_, pending_next_};
  // (rows a plain step deferred stay pending: the resumed decoder catches up on them)
  if (keep_mtp) r.mtp = mtp_seq_->clone();
  else r.mtp = std::move(mtp_seq_);
  return r;
}

void SpeculativeDecoder::restore(const SequenceState& seq, const MtpResume& r) {
  if (seq.length() != r.length)
    fail("speculative restore: state of length {} for a sequence of {}", r.length, seq.length());
  mtp_seq_ = r.mtp->clone();
  pending_hidden_ = r.pending_hidden;
  pending_next_ = r.pending_next;
  deferred_ = int64_t(pending_hidden_.size()) / D_ > 1;
  step_len_ = -1;
}

void SpeculativeSequence::truncate(int64_t n) {
  if (n == length()) return;
  if (resume_point(n) != n) fail("truncate({}): speculative state resumes only at its anchors", n);
  model->truncate(n);
  anchors_.drop_after(n);
}

std::unique_ptr<SequenceState> SpeculativeSequence::clone() const {
  auto s = std::make_unique<SpeculativeSequence>(model->clone());
  s->anchors_ = anchors_;
  return s;
}

size_t SpeculativeSequence::bytes() const {
  size_t b = model->bytes();
  anchors_.for_each([&b](int64_t, const MtpResume& r) { b += r.bytes(); });
  return b;
}

int64_t SpeculativeSequence::resume_point(int64_t n) const {
  int64_t best = 0;
  anchors_.for_each([&](int64_t at, const MtpResume&) {
    if (at <= n && at <= length() && model->resume_point(at) == at) best = std::max(best, at);
  });
  return best;
}

void SpeculativeSequence::add_anchor(MtpResume r) {
  if (r.length != length()) fail("speculative anchor at {} for a sequence of {}", r.length, length());
  const int64_t at = r.length;
  if (anchors_.wants(at)) anchors_.push(at, std::make_shared<const MtpResume>(std::move(r)));
}

SpeculativeOption parse_speculative(const std::string& spec) {
  if (spec.empty() || spec == "off") return {0, true};
  const std::string prefix = "mtp:", fixed = ":fixed";
  const bool is_fixed = spec.size() == prefix.size() + 1 + fixed.size() && spec.ends_with(fixed);
  const char k = spec.size() > prefix.size() ? spec[prefix.size()] : 0;
  if (spec.starts_with(prefix) && (spec.size() == prefix.size() + 1 || is_fixed) && k >= '1' && k <= '3')
    return {k - '0', !is_fixed};
  fail(
      "--speculative {}: expected mtp:K with up to K draft tokens per step, 1 to 3, chosen each step by their "
      "measured cost and acceptance (mtp:K:fixed: always K), or off",
      spec);
}

std::vector<int32_t> generate_speculative(Engine& engine, const std::vector<int32_t>& prompt, int64_t max_new,
                                          Sampler& sampler, int k, SpeculativeStats* stats,
                                          SpeculativeDecoder::DraftPicker picker, std::shared_ptr<DraftPolicy> policy) {
  SpeculativeDecoder dec(engine, k, std::move(picker), std::move(policy));
  auto seq = engine.new_sequence();
  std::vector<int32_t> out;
  if (prompt.empty()) fail("speculative decoding: empty prompt");
  if (max_new <= 0) return out;
  // The prompt in pieces of the CPU engine's checkpoint interval (the hidden states it keeps are [piece, hidden]);
  // that engine cuts a prefill at those multiples anyway (pass_plan.h), so this is the same computation.
  constexpr size_t kPiece = size_t(kDefaultCheckpointInterval);
  std::vector<float> logits;
  for (size_t done = 0; done < prompt.size(); done += kPiece)
    logits = dec.prefill(*seq, std::vector<int32_t>(prompt.begin() + long(done),
                                                    prompt.begin() + long(std::min(prompt.size(), done + kPiece))));
  out.push_back(sampler.sample(logits));
  while (int64_t(out.size()) < max_new && seq->length() + 1 < engine.max_context()) {
    auto st = dec.step(*seq, out.back(), max_new - int64_t(out.size()) - 1);
    const int64_t V = int64_t(st.logits.size()) / int64_t(st.draft.size() + 1);
    int64_t accepted = 0;
    for (size_t j = 0; j <= st.draft.size(); ++j) {
      std::span<const float> row(st.logits.data() + int64_t(j) * V, size_t(V));
      const int32_t t = j < st.draft.size() ? sampler.accept_draft(row, st.draft[j]) : sampler.sample(row);
      out.push_back(t);
      if (j == st.draft.size() || t != st.draft[j]) break;
      ++accepted;
    }
    dec.commit(*seq, accepted);
  }
  if (stats) *stats = dec.stats();
  return out;
}

}  // namespace moesrv
