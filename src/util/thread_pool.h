// A fixed pool of worker threads with a blocking parallel_for over index ranges. Workers may poll for a short while
// after each job before they sleep, so back-to-back calls (a decode step's many small ones) start in ~2 us instead
// of a futex wake-up each (~25 us per call on the 2-core development VM).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moesrv {

class ThreadPool {
 public:
  // threads: 0 = hardware concurrency. spin_us: how long an idle worker polls for the next job before it sleeps
  // (< 0: MOESRV_POOL_SPIN_US, else 200 on machines with 8 or more hardware threads and 0 below).
  explicit ThreadPool(int threads = 0, int spin_us = -1);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }
  // Calls fn(begin, end) on disjoint chunks covering [0, n); the caller thread works too. One call at a time (others
  // wait); fn must not call parallel_for on the same pool.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t min_chunk = 1);

  static ThreadPool& global();

 private:
  void worker_loop();
  bool wait_for_job(uint64_t& seen);  // false: the pool stops
  void run_chunks();
  std::vector<std::thread> workers_;
  int spin_us_ = 0;
  // The current job: written before generation_ moves on (release), read after a worker sees it move (acquire);
  // rewritten only once every worker has checked out of the previous job (active_ == 0).
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t n_ = 0, chunk_ = 1;
  // Each polled or contended counter on its own cache line.
  alignas(64) std::atomic<int64_t> next_{0};  // first index not yet handed out
  alignas(64) std::atomic<int> active_{0};    // workers not done with the current job
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<bool> stop_{false};
  std::mutex mu_;     // sleeping and waking only
  int sleepers_ = 0;  // workers waiting on cv_ (under mu_)
  std::condition_variable cv_, done_cv_;
  std::mutex run_mu_;  // one parallel_for at a time
};

}  // namespace moesrv
