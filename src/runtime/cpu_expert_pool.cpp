#include "runtime/cpu_expert_pool.h"

#include "util/error.h"

namespace moesrv {

CpuExpertPool::CpuExpertPool() : worker_([this] { loop(); }) {}

CpuExpertPool::~CpuExpertPool() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

std::future<void> CpuExpertPool::submit(std::vector<CpuExpertJob> jobs, const float* x, int64_t hidden, float* out) {
  Batch b{std::move(jobs), x, hidden, out, {}};
  std::future<void> f = b.done.get_future();
  {
    std::lock_guard lk(mu_);
    if (stop_) fail("cpu expert pool: submit after shutdown");
    queue_.push_back(std::move(b));
  }
  cv_.notify_one();
  return f;
}

void CpuExpertPool::loop() {
  for (;;) {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and drained
    Batch b = std::move(queue_.front());
    queue_.pop_front();
    lk.unlock();
    try {
      run(b.jobs, b.x, b.hidden, b.out);
      b.done.set_value();
    } catch (...) {
      b.done.set_exception(std::current_exception());
    }
  }
}

void CpuExpertPool::run(const std::vector<CpuExpertJob>& jobs, const float* x, int64_t D, float* out) {
  cpu::add_routed_experts(jobs, x, D, out);
}

std::vector<CpuExpertJob> CpuExpertPool::group(const std::vector<std::vector<int32_t>>& ids,
                                               const std::vector<std::vector<float>>& weights, const MoeWeights& moe) {
  if (ids.size() != weights.size()) fail("cpu expert pool: {} id rows, {} weight rows", ids.size(), weights.size());
  std::vector<CpuExpertJob> by_expert(moe.experts.size());
  for (size_t t = 0; t < ids.size(); ++t) {
    if (ids[t].size() != weights[t].size()) fail("cpu expert pool: token {} has {} ids, {} weights", t, ids[t].size(), weights[t].size());
    for (size_t i = 0; i < ids[t].size(); ++i) {
      const int32_t e = ids[t][i];
      if (e < 0 || size_t(e) >= moe.experts.size()) fail("cpu expert pool: expert {} out of range", e);
      by_expert[size_t(e)].expert = &moe.experts[size_t(e)];
      by_expert[size_t(e)].tokens.push_back(int32_t(t));
      by_expert[size_t(e)].weights.push_back(weights[t][i]);
    }
  }
  std::vector<CpuExpertJob> jobs;
  for (auto& j : by_expert)
    if (j.expert) jobs.push_back(std::move(j));
  return jobs;
}

}  // namespace moesrv
