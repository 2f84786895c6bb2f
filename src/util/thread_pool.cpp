#include "util/thread_pool.h"

#include <algorithm>
#include <cstdlib>

namespace moesrv {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = std::max(1u, std::thread::hardware_concurrency());
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
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

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t min_chunk) {
  if (n <= 0) return;
  int64_t chunk = std::max<int64_t>(min_chunk, (n + size() * 4 - 1) / (size() * 4));
  if (workers_.empty() || n <= chunk) {
    fn(0, n);
    return;
  }
  std::lock_guard run_lk(run_mu_);
  std::unique_lock lk(mu_);
  job_ = &fn;
  n_ = n;
  chunk_ = chunk;
  next_ = 0;
  active_ = int(workers_.size());
  ++generation_;
  cv_.notify_all();
  for (;;) {
    int64_t b = next_;
    if (b >= n_) break;
    next_ = b + chunk_;
    lk.unlock();
    fn(b, std::min(n, b + chunk));
    lk.lock();
  }
  done_cv_.wait(lk, [&] { return active_ == 0; });
  job_ = nullptr;
}

void ThreadPool::worker_loop(int) {
  uint64_t seen = 0;
  std::unique_lock lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    while (next_ < n_) {
      int64_t b = next_;
      next_ = b + chunk_;
      int64_t e = std::min(n_, b + chunk_);
      auto* job = job_;
      lk.unlock();
      (*job)(b, e);
      lk.lock();
    }
    if (--active_ == 0) done_cv_.notify_all();
  }
}

}  // namespace moesrv
