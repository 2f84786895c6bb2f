#include "backend/pass_plan.h"

#include <algorithm>

#include "util/error.h"

namespace moesrv {

std::vector<Pass> plan_passes(const PassPolicy& policy, int64_t pos0, int64_t S, bool rollback) {
  MOESRV_CHECK(S > 0 && pos0 >= 0, "plan_passes: {} tokens at {}", S, pos0);
  const int64_t step = policy.checkpoint_interval;
  const bool multi = S > 1 && !rollback;
  std::vector<Pass> passes;
  for (int64_t done = 0; done < S;) {
    int64_t n = S - done;
    if (policy.max_rows > 0) n = std::min(n, policy.max_rows);
    const int64_t p = pos0 + done;
    if (multi && policy.cut_at_checkpoints && step > 0) n = std::min(n, step - p % step);
    Pass pass{done, n, p, done + n == S, false};
    pass.checkpoint = multi && (pass.last || (policy.cut_at_checkpoints && step > 0 && (p + n) % step == 0));
    passes.push_back(pass);
    done += n;
  }
  // Only the last max_checkpoints survive the call.
  int64_t keep = std::max<int64_t>(policy.max_checkpoints, 1);
  for (auto it = passes.rbegin(); it != passes.rend(); ++it)
    if (it->checkpoint && keep-- <= 0) it->checkpoint = false;
  return passes;
}

PassPolicy grouped_policy(PassPolicy policy, int64_t group_rows) {
  if (group_rows > policy.max_rows && policy.max_rows > 0) policy.max_rows = policy.checkpoint_interval = group_rows;
  return policy;
}

std::vector<std::pair<int64_t, int64_t>> group_parts(const Pass& group, int64_t rows) {
  MOESRV_CHECK(rows > 0, "group_parts: passes of {} rows", rows);
  std::vector<std::pair<int64_t, int64_t>> parts;
  for (int64_t r0 = 0; r0 < group.rows; r0 += rows) parts.emplace_back(r0, std::min(rows, group.rows - r0));
  return parts;
}

}  // namespace moesrv
