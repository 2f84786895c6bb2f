// ThreadPool: every index exactly once, whether the workers are polling for the next job or asleep, with several
// callers at once, and pools torn down in either state.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "util/thread_pool.h"

using namespace moesrv;

namespace {

// Runs parallel_for(n) and checks that each index in [0, n) was handed out exactly once, in chunks of at least
// min_chunk (but the last).
void expect_each_index_once(ThreadPool& pool, int64_t n, int64_t min_chunk) {
  std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
  std::atomic<bool> short_chunk{false};
  pool.parallel_for(
      n,
      [&](int64_t b, int64_t e) {
        if (e - b < min_chunk && e != n) short_chunk = true;
        for (int64_t i = b; i < e; ++i) hits[size_t(i)].fetch_add(1);
      },
      min_chunk);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << "index " << i << " of " << n;
  EXPECT_FALSE(short_chunk.load()) << "n " << n << " min_chunk " << min_chunk;
}

}  // namespace

TEST(ThreadPool, EveryIndexOnceForEverySizeAndSpin) {
  for (int threads : {1, 2, 3, 5})
    for (int spin_us : {0, 200}) {
      ThreadPool pool(threads, spin_us);
      EXPECT_EQ(pool.size(), threads);
      for (int64_t n = 0; n <= 130; ++n)
        for (int64_t min_chunk : {1, 7}) expect_each_index_once(pool, n, min_chunk);
    }
}

TEST(ThreadPool, WorkersThatFellAsleepStillTakeTheNextJob) {
  ThreadPool pool(3, 50);  // idle for longer than 50 us: the workers sleep between these calls
  for (int i = 0; i < 20; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(i % 2 ? 500 : 10));
    expect_each_index_once(pool, 1000, 1);
  }
}

TEST(ThreadPool, EveryThreadWorksOnALongJob) {
  ThreadPool pool(3, 200);
  std::mutex mu;
  std::vector<std::thread::id> ids;
  pool.parallel_for(300, [&](int64_t, int64_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::lock_guard lk(mu);
    if (std::find(ids.begin(), ids.end(), std::this_thread::get_id()) == ids.end())
      ids.push_back(std::this_thread::get_id());
  });
  EXPECT_EQ(ids.size(), 3u);  // 300 chunks of >= 1 ms each: every worker and the caller take some
}

TEST(ThreadPool, ConcurrentCallersTakeTurns) {
  ThreadPool pool(3, 100);
  std::atomic<int64_t> total{0};
  auto caller = [&] {
    for (int i = 0; i < 200; ++i) pool.parallel_for(97, [&](int64_t b, int64_t e) { total.fetch_add(e - b); });
  };
  std::thread a(caller), b(caller);
  caller();
  a.join();
  b.join();
  EXPECT_EQ(total.load(), 3 * 200 * 97);
}

TEST(ThreadPool, TearsDownWhilePollingOrAsleep) {
  for (int sleep_us : {0, 2000}) {
    ThreadPool pool(4, 500);
    expect_each_index_once(pool, 64, 1);
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));  // 0: workers still poll at teardown
  }
  ThreadPool never_used(4, 100);
}
