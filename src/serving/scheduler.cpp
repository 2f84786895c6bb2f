#include "serving/scheduler.h"

namespace moesrv {

bool Scheduler::fits_locked(uint64_t bytes) const {
  return running_ < max_running_ && (state_budget_ == 0 || reserved_ + bytes <= state_budget_);
}

Scheduler::Admission Scheduler::acquire(std::unique_ptr<Slot>& slot, const std::function<bool()>& abandoned,
                                        std::chrono::milliseconds poll, uint64_t state_bytes) {
  std::unique_lock lock(mu_);
  if (state_budget_ && state_bytes > state_budget_) return Admission::kTooLarge;
  if (waiting_ == 0 && fits_locked(state_bytes)) {
    ++running_;
    reserved_ += state_bytes;
    slot = std::make_unique<Slot>(this, state_bytes);
    return Admission::kGranted;
  }
  if (waiting_ >= queue_max_) return Admission::kQueueFull;
  uint64_t ticket = next_ticket_++;
  ++waiting_;
  auto deadline = std::chrono::steady_clock::now() + queue_timeout_;
  // A ticket is servable once every earlier ticket was served or abandoned, and it fits.
  auto my_turn = [&] { return serving_ == ticket && fits_locked(state_bytes); };
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
  ++running_;
  reserved_ += state_bytes;
  slot = std::make_unique<Slot>(this, state_bytes);
  cv_.notify_all();  // the next ticket may fit too
  return Admission::kGranted;
}

void Scheduler::skip_abandoned_locked() {
  while (abandoned_.erase(serving_)) ++serving_;
}

void Scheduler::release(uint64_t bytes) {
  {
    std::lock_guard lock(mu_);
    --running_;
    reserved_ -= bytes;
  }
  cv_.notify_all();
}

size_t Scheduler::waiting() const {
  std::lock_guard lock(mu_);
  return waiting_;
}

size_t Scheduler::running() const {
  std::lock_guard lock(mu_);
  return running_;
}

uint64_t Scheduler::reserved_bytes() const {
  std::lock_guard lock(mu_);
  return reserved_;
}

}  // namespace moesrv
