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

}  // namespace moesrv
