// Admission control for a single-stream engine: one request runs at a time, the rest wait in a bounded
// FIFO queue. A full queue rejects at once (HTTP 429); waiting longer than the timeout gives up (HTTP 503).
#pragma once
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
  Scheduler(size_t queue_max, std::chrono::milliseconds queue_timeout)
      : queue_max_(queue_max), queue_timeout_(queue_timeout) {}

  enum class Admission { kGranted, kQueueFull, kTimedOut, kAbandoned };

  // Held while a request uses the engine; destroying it lets the next queued request run.
  class Slot {
   public:
    explicit Slot(Scheduler* s) : sched_(s) {}
    ~Slot() { sched_->release(); }
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;

   private:
    Scheduler* sched_;
  };

  // Blocks until the engine is free (FIFO order). On success `slot` is set. `abandoned` (optional) is polled
  // every `poll` while waiting: true gives up the place in the queue (the client went away).
  Admission acquire(std::unique_ptr<Slot>& slot, const std::function<bool()>& abandoned = nullptr,
                    std::chrono::milliseconds poll = std::chrono::milliseconds(50));

  size_t waiting() const;
  bool busy() const;

 private:
  void release();
  void skip_abandoned_locked();
  const size_t queue_max_;
  const std::chrono::milliseconds queue_timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool running_ = false;
  uint64_t next_ticket_ = 0, serving_ = 0;  // FIFO: tickets are served in order
  size_t waiting_ = 0;
  std::set<uint64_t> abandoned_;  // timed-out tickets not yet reached
};

}  // namespace moesrv
