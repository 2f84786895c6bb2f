#include "serving/batch_runner.h"

#include <algorithm>

#include "util/error.h"

namespace moesrv {

BatchRunner::BatchRunner(Engine& engine, size_t max_batch, std::chrono::microseconds gather)
    : engine_(engine), max_batch_(std::max<size_t>(1, max_batch)), gather_(gather) {
  thread_ = std::thread([this] { loop(); });
}

BatchRunner::~BatchRunner() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  thread_.join();
}

std::unique_ptr<BatchRunner::Member> BatchRunner::join() {
  {
    std::lock_guard lock(mu_);
    ++members_;
  }
  return std::make_unique<Member>(*this);
}

void BatchRunner::leave() {
  {
    std::lock_guard lock(mu_);
    --members_;
  }
  work_.notify_all();  // the remaining members may all be waiting now
}

BatchRunner::Stats BatchRunner::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

size_t BatchRunner::members() const {
  std::lock_guard lock(mu_);
  return members_;
}

std::vector<float> BatchRunner::Member::forward(SequenceState& seq, const std::vector<int32_t>& tokens,
                                                bool all_logits) {
  Call call{.seq = &seq, .tokens = &tokens, .all_logits = all_logits, .decode = tokens.size() == 1 && !all_logits};
  return runner_.run(call);
}

std::vector<float> BatchRunner::run(Call& call) {
  std::unique_lock lock(mu_);
  MOESRV_CHECK(!stop_, "the batch runner has stopped");
  call.since = std::chrono::steady_clock::now();
  pending_.push_back(&call);
  work_.notify_all();
  done_.wait(lock, [&] { return call.done; });
  if (call.error) std::rethrow_exception(call.error);
  return std::move(call.logits);
}

void BatchRunner::finish(const std::vector<Call*>& calls) {
  {
    std::lock_guard lock(mu_);
    for (Call* c : calls) c->done = true;
  }
  done_.notify_all();
}

void BatchRunner::loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    work_.wait(lock, [&] { return stop_ || !pending_.empty(); });
    if (pending_.empty()) return;  // stopping
    // Gather: every member's call, or as many as arrive within `gather` of the oldest.
    work_.wait_until(lock, pending_.front()->since + gather_, [&] { return stop_ || pending_.size() >= members_; });
    std::vector<Call*> decode;
    Call* prefill = nullptr;
    for (auto it = pending_.begin(); it != pending_.end();) {  // in arrival order
      Call* c = *it;
      if (c->decode && decode.size() < max_batch_) {
        decode.push_back(c);
      } else if (!c->decode && !prefill) {
        prefill = c;
      } else {
        ++it;
        continue;
      }
      it = pending_.erase(it);
    }
    if (!decode.empty()) ++stats_.decode_steps, stats_.decode_rows += decode.size();
    if (prefill) ++stats_.prefill_calls;
    lock.unlock();
    if (!decode.empty()) {
      std::vector<SequenceState*> seqs;
      std::vector<int32_t> tokens;
      for (Call* c : decode) seqs.push_back(c->seq), tokens.push_back(c->tokens->front());
      try {
        auto rows = engine_.forward_batch(seqs, tokens);
        MOESRV_CHECK(rows.size() == decode.size(), "forward_batch returned {} rows for {}", rows.size(), decode.size());
        for (size_t i = 0; i < decode.size(); ++i) decode[i]->logits = std::move(rows[i]);
      } catch (...) {
        for (Call* c : decode) c->error = std::current_exception();
      }
      finish(decode);  // the decoding members sample while the prompt chunk runs
    }
    if (prefill) {
      try {
        prefill->logits = engine_.forward(*prefill->seq, *prefill->tokens, prefill->all_logits);
      } catch (...) {
        prefill->error = std::current_exception();
      }
      finish({prefill});
    }
    lock.lock();
  }
}

}  // namespace moesrv
