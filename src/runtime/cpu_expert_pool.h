// Routed experts computed on the CPU, asynchronously, so GPU work overlaps: submit a batch of jobs, get a
// future. One worker thread drains the queue in order; a batch runs through cpu::add_routed_experts (few-row experts
// together), its GEMVs spread over the cores by ThreadPool::global() (never nested inside another parallel_for).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "backend/cpu/expert_batch.h"
#include "model/weights.h"

namespace moesrv {

using CpuExpertJob = cpu::RoutedRows;  // an expert, its rows of x and their routing weights

class CpuExpertPool {
 public:
  CpuExpertPool();
  ~CpuExpertPool();  // finishes queued work
  CpuExpertPool(const CpuExpertPool&) = delete;
  CpuExpertPool& operator=(const CpuExpertPool&) = delete;

  // out[t] += w * expert(x[t]) for every job row. x [rows, hidden] and out must stay valid until the future is
  // ready; `out` must not be touched by anyone else meanwhile. Outputs are added in job order.
  std::future<void> submit(std::vector<CpuExpertJob> jobs, const float* x, int64_t hidden, float* out);
  // The same, on the calling thread.
  static void run(const std::vector<CpuExpertJob>& jobs, const float* x, int64_t hidden, float* out);

  // Groups router output (per token: ids, weights) into one job per expert, in expert order.
  static std::vector<CpuExpertJob> group(const std::vector<std::vector<int32_t>>& ids,
                                         const std::vector<std::vector<float>>& weights, const MoeWeights& moe);

 private:
  struct Batch {
    std::vector<CpuExpertJob> jobs;
    const float* x;
    int64_t hidden;
    float* out;
    std::promise<void> done;
  };
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Batch> queue_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace moesrv
