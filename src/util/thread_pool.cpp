#include "util/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

namespace moesrv {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// Polls `done` for up to `us` microseconds; true once it holds. After the first ~100 polls it yields between
// polls: a thread it waits for may have been woken onto this core (the scheduler's wake-affine placement) and must
// get to run.
template <class Done>
bool spin_until(Done&& done, int us) {
  if (us <= 0) return done();
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (int i = 1;; ++i) {
    if (done()) return true;
    if (i < 128) {
      cpu_relax();
      continue;
    }
    if (std::chrono::steady_clock::now() >= end) return done();
    std::this_thread::yield();
  }
}

}  // namespace

ThreadPool::ThreadPool(int threads, int spin_us) {
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  if (spin_us < 0) {
    // Polling costs the other threads of a crowded machine their turns (2-core VM, two test processes at once:
    // a server test 20% slower, 3x in CI), so small machines sleep at once unless told otherwise.
    const char* env = std::getenv("MOESRV_POOL_SPIN_US");
    spin_us = env ? std::max(0, std::atoi(env)) : std::thread::hardware_concurrency() >= 8 ? 200 : 0;
  }
  spin_us_ = spin_us;
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool([] {
    const char* env = std::getenv("MOESRV_THREADS");
    return env ? std::atoi(env) : 0;
  }());
  return pool;
}

void ThreadPool::run_chunks() {
  for (;;) {
    const int64_t b = next_.fetch_add(chunk_, std::memory_order_relaxed);
    if (b >= n_) return;
    (*job_)(b, std::min(n_, b + chunk_));
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t min_chunk) {
  if (n <= 0) return;
  const int64_t chunk = std::max<int64_t>(min_chunk, (n + size() * 4 - 1) / (size() * 4));
  if (workers_.empty() || n <= chunk) {
    fn(0, n);
    return;
  }
  std::lock_guard run_lk(run_mu_);
  job_ = &fn;
  n_ = n;
  chunk_ = chunk;
  next_.store(0, std::memory_order_relaxed);
  active_.store(int(workers_.size()), std::memory_order_relaxed);
  bool woke = false;  // some worker slept: it takes a wake-up, so this thread sleeps too instead of polling
  {
    // Under the lock: a worker going to sleep either sees the new generation in its wait predicate or is already
    // waiting when the notify comes.
    std::lock_guard lk(mu_);
    generation_.fetch_add(1, std::memory_order_release);
    woke = sleepers_ > 0;
  }
  if (woke) cv_.notify_all();
  run_chunks();
  auto all_done = [&] { return active_.load(std::memory_order_acquire) == 0; };
  if (!spin_until(all_done, woke ? 0 : spin_us_)) {
    std::unique_lock lk(mu_);
    done_cv_.wait(lk, all_done);
  }
  job_ = nullptr;
}

bool ThreadPool::wait_for_job(uint64_t& seen) {
  auto moved = [&] {
    return stop_.load(std::memory_order_relaxed) || generation_.load(std::memory_order_acquire) != seen;
  };
  if (!spin_until(moved, spin_us_)) {
    std::unique_lock lk(mu_);
    ++sleepers_;
    cv_.wait(lk, moved);
    --sleepers_;
  }
  if (stop_.load(std::memory_order_relaxed)) return false;
  seen = generation_.load(std::memory_order_acquire);
  return true;
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  while (wait_for_job(seen)) {
    run_chunks();
    if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard lk(mu_);  // the caller checks active_ under it before it sleeps
      done_cv_.notify_one();
    }
  }
}

}  // namespace moesrv
