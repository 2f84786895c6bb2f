#include "bench/speculative_projection.h"

#include <cmath>

#include "util/error.h"

namespace moesrv {

double mtp_tokens_per_step(int k, double acceptance) {
  MOESRV_CHECK(k >= 0 && acceptance >= 0 && acceptance <= 1, "mtp projection: k {} acceptance {}", k, acceptance);
  double tokens = 0, p = 1;
  for (int i = 0; i <= k; ++i, p *= acceptance) tokens += p;  // token i + 1 needs drafts 1..i accepted
  return tokens;
}

double mtp_projected_speedup(int k, double acceptance, double decode_s, double verify_s, double draft_s) {
  MOESRV_CHECK(decode_s > 0 && verify_s > 0 && draft_s >= 0, "mtp projection: costs {} {} {}", decode_s, verify_s,
               draft_s);
  return mtp_tokens_per_step(k, acceptance) * decode_s / (verify_s + k * draft_s);
}

nlohmann::json mtp_projection_json(int k, double decode_s, double verify_s, double draft_s) {
  nlohmann::json j = {{"k", k},
                      {"decode_s", decode_s},
                      {"verify_s", verify_s},
                      {"draft_s", draft_s},
                      {"verify_over_decode", verify_s / decode_s},
                      {"draft_over_decode", draft_s / decode_s}};
  for (const char* a : {"0", "0.5", "0.7", "0.9"})
    j[std::string("projected_speedup_at_") + a] = mtp_projected_speedup(k, std::stod(a), decode_s, verify_s, draft_s);
  return j;
}

DraftSimulation simulate_draft_policy(DraftPolicy& policy, int64_t steps, const std::function<double(int)>& cost,
                                      double acceptance) {
  DraftSimulation r;
  uint32_t x = 12345;
  auto draw = [&x] {  // uniform in [0, 1)
    x = x * 1664525u + 1013904223u;
    return double(x >> 8) / double(1u << 24);
  };
  for (int64_t i = 0; i < steps; ++i) {
    const int k = policy.next();
    int64_t accepted = 0;
    while (accepted < k && draw() < acceptance) ++accepted;
    policy.record(k, accepted, cost(k));
    r.seconds += cost(k);
    r.tokens += accepted + 1;
    r.drafting_steps += k > 0;
    ++r.steps;
  }
  return r;
}

nlohmann::json mtp_adaptive_json(const std::vector<double>& cost_s) {
  MOESRV_CHECK(cost_s.size() >= 2 && cost_s[0] > 0, "mtp adaptive projection: {} step costs", cost_s.size());
  const int K = int(cost_s.size()) - 1;
  nlohmann::json j = {{"max_k", K}};
  for (const char* a : {"0", "0.5", "0.7", "0.9"}) {
    DraftPolicy policy(K);
    const DraftSimulation r = simulate_draft_policy(
        policy, 2000, [&cost_s](int k) { return cost_s[size_t(k)]; }, std::stod(a));
    j[std::string("speedup_at_") + a] = r.tokens_per_second() * cost_s[0];
  }
  return j;
}

}  // namespace moesrv
