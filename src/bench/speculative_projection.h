// MTP speculative decoding projected from measured step costs (the benches' "mtp" rows): a step drafts k tokens with
// the MTP block (draft_s each) and verifies k + 1 tokens in one model forward (verify_s); drafts are accepted
// independently with probability a until the first rejection, so a step commits (1 - a^(k+1)) / (1 - a) tokens
// against one per decode step (decode_s).
#pragma once
#include <nlohmann/json.hpp>

namespace moesrv {

double mtp_tokens_per_step(int k, double acceptance);
double mtp_projected_speedup(int k, double acceptance, double decode_s, double verify_s, double draft_s);
// {"k", "decode_s", "verify_s", "draft_s", "verify_over_decode", "draft_over_decode", "projected_speedup_at_0",
//  "projected_speedup_at_0.5", "projected_speedup_at_0.7", "projected_speedup_at_0.9"}
nlohmann::json mtp_projection_json(int k, double decode_s, double verify_s, double draft_s);

}  // namespace moesrv
