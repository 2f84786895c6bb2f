// Server counters, rendered in the Prometheus text exposition format on /metrics.
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

namespace moesrv {

struct ServerMetrics {
  std::atomic<uint64_t> requests{0}, errors{0}, rejected_queue_full{0}, rejected_timeout{0}, cancelled{0};
  std::atomic<uint64_t> prompt_tokens{0}, completion_tokens{0}, cached_tokens{0}, reasoning_tokens{0};
  std::atomic<uint64_t> reasoning_budget_forced{0}, reasoning_reattached{0};
  std::atomic<uint64_t> speculative_steps{0}, speculative_drafted{0}, speculative_accepted{0};  // MTP drafting
  std::atomic<uint64_t> speculative_plain{0};     // steps the draft policy ran without drafts
  std::atomic<int> speculative_draft_choice{-1};  // the draft policy's current choice (-1: none)

  void record_timing(uint64_t prefill_tokens, double prefill_s, uint64_t decode_tokens, double decode_s);

  struct Gauges {
    size_t queue_depth = 0;
    bool busy = false;
    size_t prefix_cache_bytes = 0, prefix_cache_entries = 0;
    size_t running = 0, max_running = 1;       // sequences generating now (continuous batching: up to --max-batch)
    uint64_t reserved_state_bytes = 0;         // sequence state the running requests reserved at admission
    uint64_t batch_steps = 0, batch_rows = 0;  // batched decode steps and the rows they ran (--max-batch > 1)
  };
  std::string render(const Gauges& g) const;

 private:
  mutable std::mutex mu_;
  double prefill_seconds_ = 0, decode_seconds_ = 0;
  uint64_t prefill_tokens_ = 0, decode_tokens_ = 0;
  double last_prefill_tps_ = 0, last_decode_tps_ = 0;
};

}  // namespace moesrv
