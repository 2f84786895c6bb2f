// Continuous batching: several requests share one engine. Each request runs its own generation (generator.h) on its
// own thread against a Member, an Engine whose forward() hands the call to the runner's engine thread and waits.
// The engine thread steps: one-token forwards (decode steps) of all members run together in one
// Engine::forward_batch, and at most one longer forward (a prompt chunk) runs per step, so members that are decoding
// stall at most one chunk while a new request's prompt is prefilled. A step waits until every member has handed in
// its call, or until the oldest call has waited `gather` (a member busy elsewhere, e.g. writing to a slow client,
// then misses the step). A member's sequences stay its own: the engine thread only runs the calls it is given.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "backend/engine.h"

namespace moesrv {

class BatchRunner {
 public:
  BatchRunner(Engine& engine, size_t max_batch, std::chrono::microseconds gather = std::chrono::microseconds(10000));
  ~BatchRunner();  // every Member must be gone
  BatchRunner(const BatchRunner&) = delete;
  BatchRunner& operator=(const BatchRunner&) = delete;

  class Member;
  // A request's view of the engine while it generates; destroying it leaves the batch.
  std::unique_ptr<Member> join();

  struct Stats {
    uint64_t decode_steps = 0, decode_rows = 0, prefill_calls = 0;
  };
  Stats stats() const;
  size_t members() const;

 private:
  struct Call {
    SequenceState* seq = nullptr;
    const std::vector<int32_t>* tokens = nullptr;
    bool all_logits = false;
    bool decode = false;  // one token, last logits: batched with the other decode calls
    std::chrono::steady_clock::time_point since;
    std::vector<float> logits;
    std::exception_ptr error;
    bool done = false;
  };
  std::vector<float> run(Call& call);  // on a member's thread: queue the call, wait for its step
  void leave();
  void loop();  // the engine thread
  void finish(const std::vector<Call*>& calls);

  Engine& engine_;
  const size_t max_batch_;
  const std::chrono::microseconds gather_;
  mutable std::mutex mu_;
  std::condition_variable work_, done_;
  std::deque<Call*> pending_;
  size_t members_ = 0;
  bool stop_ = false;
  Stats stats_;
  std::thread thread_;
};

class BatchRunner::Member final : public Engine {
 public:
  explicit Member(BatchRunner& r) : runner_(r), engine_(r.engine_) {}
  ~Member() override { runner_.leave(); }
  std::string name() const override { return engine_.name(); }
  int64_t vocab_size() const override { return engine_.vocab_size(); }
  int64_t max_context() const override { return engine_.max_context(); }
  int64_t prefill_chunk() const override { return engine_.prefill_chunk(); }
  std::unique_ptr<SequenceState> new_sequence() const override { return engine_.new_sequence(); }
  uint64_t sequence_bytes(int64_t tokens) const override { return engine_.sequence_bytes(tokens); }
  bool concurrent_sequence_ops() const override { return engine_.concurrent_sequence_ops(); }
  std::vector<float> forward(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits) override;
  const UsageStats* expert_usage() const override { return engine_.expert_usage(); }

 private:
  BatchRunner& runner_;
  Engine& engine_;
};

}  // namespace moesrv
