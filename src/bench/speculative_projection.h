// MTP speculative decoding projected from measured step costs (the benches' "mtp" rows): a step drafts k tokens with
// the MTP block (draft_s each) and verifies k + 1 tokens in one model forward (verify_s); drafts are accepted
// independently with probability a until the first rejection, so a step commits (1 - a^(k+1)) / (1 - a) tokens
// against one per decode step (decode_s).
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <vector>

#include "serving/draft_policy.h"

namespace moesrv {

double mtp_tokens_per_step(int k, double acceptance);
double mtp_projected_speedup(int k, double acceptance, double decode_s, double verify_s, double draft_s);
// {"k", "decode_s", "verify_s", "draft_s", "verify_over_decode", "draft_over_decode", "projected_speedup_at_0",
//  "projected_speedup_at_0.5", "projected_speedup_at_0.7", "projected_speedup_at_0.9"}
nlohmann::json mtp_projection_json(int k, double decode_s, double verify_s, double draft_s);

// `steps` steps chosen by `policy` (the server's adaptive draft length): a step of k drafts costs cost(k) seconds and
// its drafts are accepted one after another with probability `acceptance` (draws from a fixed pseudo-random stream).
struct DraftSimulation {
  double seconds = 0;
  int64_t tokens = 0, steps = 0, drafting_steps = 0;
  double tokens_per_second() const { return double(tokens) / seconds; }
};
DraftSimulation simulate_draft_policy(DraftPolicy& policy, int64_t steps, const std::function<double(int)>& cost,
                                      double acceptance);
// The adaptive draft length's speed-up over plain decoding from measured step costs (cost_s[k], k = 0..K; cost_s[0]:
// a decode step; a step of k drafts = the verify of k + 1 tokens + k drafts), 2,000 simulated steps:
// {"max_k", "speedup_at_0", "speedup_at_0.5", "speedup_at_0.7", "speedup_at_0.9"}.
nlohmann::json mtp_adaptive_json(const std::vector<double>& cost_s);

}  // namespace moesrv
