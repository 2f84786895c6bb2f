// One forward call as passes: where a multi-token forward is cut and after which passes the fixed-size state
// (recurrent, conv, open k-pool) is checkpointed as a resume point. Every engine and pipeline stage (CPU and CUDA)
// and the CPU bench run their passes from this plan, so chunking and the checkpoint policy are written once.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace moesrv {

struct PassPolicy {
  int64_t max_rows = 0;             // rows of one pass (the engine's activations); 0: no limit
  int64_t checkpoint_interval = 0;  // resume points at multiples of this position (0: only a call's end)
  int64_t max_checkpoints = 1;      // checkpoints a sequence keeps, the oldest dropped first
  bool cut_at_checkpoints = false;  // passes also end at those multiples (models with recurrent state)
};

// The one checkpoint policy: passes of at most max_rows (0: no limit); a model with a recurrence cuts and
// checkpoints every checkpoint_interval(max_rows) positions; a sequence keeps `keep` checkpoints (the CPU many host
// copies, a GPU few device ones).
constexpr int64_t kDefaultCheckpointInterval = 2048;  // for engines whose passes have no row limit
constexpr int64_t checkpoint_interval(int64_t max_rows) { return max_rows > 0 ? max_rows : kDefaultCheckpointInterval; }
constexpr PassPolicy pass_policy_for(bool recurrent, int64_t max_rows, int64_t keep) {
  return {max_rows, checkpoint_interval(max_rows), keep, recurrent};
}

struct Pass {
  int64_t offset = 0;  // first row of the call's tokens
  int64_t rows = 0;
  int64_t pos0 = 0;  // position of the first row
  bool last = false;
  bool checkpoint = false;  // checkpoint the fixed state after this pass
};

// The passes of a forward of S tokens at positions [pos0, pos0 + S). A multi-token forward checkpoints after every
// pass that ends at a multiple of the interval (when cut there) and after its last pass, but never more than the
// sequence keeps (earlier ones would be dropped within the same call); a single token and a rollback forward
// (speculative verify: one pass, rollback points instead) checkpoint nothing.
std::vector<Pass> plan_passes(const PassPolicy& policy, int64_t pos0, int64_t S, bool rollback = false);

// The one pass loop: body(pass) for every pass of the plan, then the sequence's length moves to the pass's end and
// its fixed-size state is checkpointed where the plan says. Every engine, pipeline stage and the MTP block run their
// forwards through it; `Seq` has length_ and checkpoint().
template <class Seq, class Body>
void for_each_pass(const PassPolicy& policy, Seq& seq, int64_t pos0, int64_t S, bool rollback, Body&& body) {
  for (const Pass& p : plan_passes(policy, pos0, S, rollback)) {
    body(p);
    seq.length_ = p.pos0 + p.rows;
    if (p.checkpoint) seq.checkpoint();
  }
}

// Prefill groups (an engine that runs several passes layer by layer, CudaEngineOptions::prefill_group): the plan's
// passes become groups of up to group_rows tokens, checkpointed and cut by the policy at that granularity; each
// group runs as the passes of policy.max_rows that group_parts gives, (first row within the group, rows).
PassPolicy grouped_policy(PassPolicy policy, int64_t group_rows);
std::vector<std::pair<int64_t, int64_t>> group_parts(const Pass& group, int64_t rows);

}  // namespace moesrv
