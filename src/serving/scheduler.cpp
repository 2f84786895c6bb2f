#include "serving/scheduler.h"

namespace moesrv {

Scheduler::Admission Scheduler::acquire(std::unique_ptr<Slot>& slot, const std::function<bool()>& abandoned,
                                        std::chrono::milliseconds poll) {
  std::unique_lock lock(mu_);
  if (!running_ && waiting_ == 0) {
    running_ = true;
    slot = std::make_unique<Slot>(this);
    return Admission::kGranted;
  }
  if (waiting_ >= queue_max_) return Admission::kQueueFull;
  uint64_t ticket = next_ticket_++;
  ++waiting_;
  auto deadline = std::chrono::steady_clock::now() + queue_timeout_;
  // A ticket is servable once every earlier ticket was served or abandoned.
  auto my_turn = [&] { return !running_ && serving_ == ticket; };
  bool ok = false, gone = false;
  while (!ok) {
    auto until = abandoned ? std::min(deadline, std::chrono::steady_clock::now() + poll) : deadline;
    ok = cv_.wait_until(lock, until, my_turn);
    if (ok || std::chrono::steady_clock::now() >= deadline) break;
    if (abandoned) {
      lock.unlock();
      gone = abandoned();
      lock.lock();
      if (gone) break;  // abandoning below passes the turn on, even if it was ours
    }
  }
  --waiting_;
  if (!ok) {
    abandoned_.insert(ticket);
    skip_abandoned_locked();
    cv_.notify_all();
    return gone ? Admission::kAbandoned : Admission::kTimedOut;
  }
  ++serving_;
  skip_abandoned_locked();
  running_ = true;
  slot = std::make_unique<Slot>(this);
  return Admission::kGranted;
}

void Scheduler::skip_abandoned_locked() {
  while (abandoned_.erase(serving_)) ++serving_;
}

void Scheduler::release() {
  {
    std::lock_guard lock(mu_);
    running_ = false;
  }
  cv_.notify_all();
}

size_t Scheduler::waiting() const {
  std::lock_guard lock(mu_);
  return waiting_;
}

bool Scheduler::busy() const {
  std::lock_guard lock(mu_);
  return running_;
}

}  // namespace moesrv
