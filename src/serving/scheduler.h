// Admission control: up to `max_running` requests run at once (1: a single-stream engine; more: continuous
// batching, batch_runner.h), the rest wait in a bounded FIFO queue. A full queue rejects at once (HTTP 429);
// waiting longer than the timeout gives up (HTTP 503). With a state budget, each request reserves the bytes of
// its sequence state while it runs and waits until they fit; a request larger than the whole budget is refused.
#pragma once
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>

namespace moesrv {

class Scheduler {
 public:
  Scheduler(size_t queue_max, std::chrono::milliseconds queue_timeout, size_t max_running = 1,
            uint64_t state_budget = 0)
      : queue_max_(queue_max),
        queue_timeout_(queue_timeout),
        max_running_(std::max<size_t>(1, max_running)),
        state_budget_(state_budget) {}

  enum class Admission { kGranted, kQueueFull, kTimedOut, kAbandoned, kTooLarge };

  // Held while a request uses the engine; destroying it lets the next queued request run.
  class Slot {
   public:
    Slot(Scheduler* s, uint64_t bytes) : sched_(s), bytes_(bytes) {}
    ~Slot() { sched_->release(bytes_); }
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;

   private:
    Scheduler* sched_;
    uint64_t bytes_;
  };

  // Blocks until a running place is free and `state_bytes` fit the state budget (FIFO order). On success `slot`
  // is set. `abandoned` (optional) is polled every `poll` while waiting: true gives up the place in the queue (the
  // client went away).
  Admission acquire(std::unique_ptr<Slot>& slot, const std::function<bool()>& abandoned = nullptr,
                    std::chrono::milliseconds poll = std::chrono::milliseconds(50), uint64_t state_bytes = 0);

  size_t waiting() const;
  size_t running() const;
  bool busy() const { return running() > 0; }
  uint64_t reserved_bytes() const;  // state bytes the running requests reserved
  size_t max_running() const { return max_running_; }
  uint64_t state_budget() const { return state_budget_; }  // 0: unlimited

 private:
  bool fits_locked(uint64_t bytes) const;
  void release(uint64_t bytes);
  void skip_abandoned_locked();
  const size_t queue_max_;
  const std::chrono::milliseconds queue_timeout_;
  const size_t max_running_;
  const uint64_t state_budget_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  size_t running_ = 0;
  uint64_t reserved_ = 0;
  uint64_t next_ticket_ = 0, serving_ = 0;  // FIFO: tickets are served in order
  size_t waiting_ = 0;
  std::set<uint64_t> abandoned_;  // timed-out tickets not yet reached
};

}  // namespace moesrv
