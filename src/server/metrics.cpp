#include "server/metrics.h"

#include <fmt/format.h>

namespace moesrv {

void ServerMetrics::record_timing(uint64_t prefill_tokens, double prefill_s, uint64_t decode_tokens, double decode_s) {
  std::lock_guard lock(mu_);
  prefill_tokens_ += prefill_tokens;
  prefill_seconds_ += prefill_s;
  decode_tokens_ += decode_tokens;
  decode_seconds_ += decode_s;
  if (prefill_tokens && prefill_s > 0) last_prefill_tps_ = double(prefill_tokens) / prefill_s;
  if (decode_tokens > 1 && decode_s > 0) last_decode_tps_ = double(decode_tokens) / decode_s;
}

std::string ServerMetrics::render(const Gauges& g) const {
  std::string out;
  auto metric = [&](const char* name, const char* type, const char* help, double v) {
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} {2}\n{0} {3}\n", name, help, type, v);
  };
  metric("moesrv_requests_total", "counter", "Completion requests received.", double(requests));
  metric("moesrv_request_errors_total", "counter", "Requests answered with an error status.", double(errors));
  out += "# HELP moesrv_requests_rejected_total Requests refused by admission control.\n"
         "# TYPE moesrv_requests_rejected_total counter\n";
  out += fmt::format("moesrv_requests_rejected_total{{reason=\"queue_full\"}} {}\n", rejected_queue_full.load());
  out += fmt::format("moesrv_requests_rejected_total{{reason=\"queue_timeout\"}} {}\n", rejected_timeout.load());
  metric("moesrv_requests_cancelled_total", "counter", "Generations stopped because the client went away.", double(cancelled));
  metric("moesrv_prompt_tokens_total", "counter", "Prompt tokens received (tokens in).", double(prompt_tokens));
  metric("moesrv_completion_tokens_total", "counter", "Tokens generated (tokens out).", double(completion_tokens));
  metric("moesrv_reasoning_tokens_total", "counter", "Generated tokens inside <think>.", double(reasoning_tokens));
  metric("moesrv_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.", double(cached_tokens));
  metric("moesrv_reasoning_budget_forced_total", "counter", "Turns whose reasoning was cut by the budget.", double(reasoning_budget_forced));
  metric("moesrv_reasoning_reattached_total", "counter", "Assistant turns whose dropped reasoning was restored.", double(reasoning_reattached));
  metric("moesrv_speculative_steps_total", "counter", "Speculative verify steps (MTP drafts).",
         double(speculative_steps));
  metric("moesrv_speculative_draft_tokens_total", "counter", "MTP draft tokens verified.", double(speculative_drafted));
  metric("moesrv_speculative_accepted_tokens_total", "counter", "MTP draft tokens accepted.",
         double(speculative_accepted));
  metric("moesrv_speculative_plain_steps_total", "counter",
         "Speculative steps run without drafts (the draft policy found drafting slower).", double(speculative_plain));
  if (speculative_draft_choice >= 0)
    metric("moesrv_speculative_draft_length", "gauge",
           "Drafts per step the policy chooses now (the most tokens per second by measured costs and acceptance).",
           double(speculative_draft_choice));
  {
    std::lock_guard lock(mu_);
    metric("moesrv_prefill_tokens_total", "counter", "Prompt tokens actually computed (cache misses).", double(prefill_tokens_));
    metric("moesrv_prefill_seconds_total", "counter", "Time spent in prefill.", prefill_seconds_);
    metric("moesrv_decode_seconds_total", "counter", "Time spent decoding.", decode_seconds_);
    metric("moesrv_prefill_tokens_per_second", "gauge", "Prefill throughput of the last request.", last_prefill_tps_);
    metric("moesrv_decode_tokens_per_second", "gauge", "Decode throughput of the last request.", last_decode_tps_);
  }
  metric("moesrv_queue_depth", "gauge", "Requests waiting for the engine.", double(g.queue_depth));
  metric("moesrv_engine_busy", "gauge", "1 while a request is running.", g.busy ? 1 : 0);
  metric("moesrv_sequences_running", "gauge", "Requests generating now (at most --max-batch).", double(g.running));
  metric("moesrv_sequences_waiting", "gauge", "Requests queued for a running place.", double(g.queue_depth));
  metric("moesrv_max_batch", "gauge", "Requests that may generate at once (--max-batch).", double(g.max_running));
  metric("moesrv_reserved_state_bytes", "gauge", "Sequence state reserved by the running requests.",
         double(g.reserved_state_bytes));
  metric("moesrv_batch_decode_steps_total", "counter", "Batched decode steps (--max-batch > 1).",
         double(g.batch_steps));
  metric("moesrv_batch_decode_rows_total", "counter",
         "Sequences decoded by the batched steps (rows / steps: mean batch).", double(g.batch_rows));
  metric("moesrv_prefix_cache_bytes", "gauge", "Memory held by prefix cache snapshots.", double(g.prefix_cache_bytes));
  metric("moesrv_prefix_cache_entries", "gauge", "Prefix cache snapshots.", double(g.prefix_cache_entries));
  return out;
}

}  // namespace moesrv
