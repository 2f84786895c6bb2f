// One MoE pass planned on the host (hybrid placements): the pass's token-expert selections grouped by expert, which
// experts run on the GPU (their selections as consecutive rows of the sorted buffers) and which on the CPU, with the
// cold ones (on the CPU by placement, copyable to the GPU) split between the PCIe link and the CPU by split_cold.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "backend/cold_split.h"

namespace moesrv {

enum class ExpertWhere : uint8_t {
  Gpu,   // resident in VRAM or already in a cache slot (or fetched on a miss regardless of cost: Cache placement)
  Cpu,   // computed on the CPU, no copy for the GPU
  Cold,  // on the CPU by placement but copyable to a slot: the pass's split decides
};

struct ExpertPass {
  std::vector<std::vector<int32_t>> by_expert;        // [experts] selection indices (token * k + j) routed to it
  std::vector<std::pair<int32_t, int32_t>> gpu_runs;  // (expert, first sorted row), in expert order
  std::vector<int32_t> cpu_experts;                   // in expert order
  std::vector<int32_t> streamed;                      // Cold experts the split sends over PCIe (they are in gpu_runs)
  std::vector<int32_t> rowmap;                        // [tokens * k] sorted row of each selection, -1 on the CPU
  std::vector<int32_t> sorted_tok;                    // [rows] the token of each sorted row
};

// ids: [tokens * k] expert of each selection; where[e] per expert; cold_cost(e, tokens) the two paths' costs of a
// Cold expert routed `tokens` selections this pass; can_fetch: the layer has slots to copy into.
ExpertPass plan_expert_pass(const int32_t* ids, int64_t tokens, int64_t k, const std::vector<ExpertWhere>& where,
                            const std::function<ColdCost(int32_t expert, int64_t tokens)>& cold_cost, bool can_fetch);

// Reorders a plan's GPU runs (and their sorted rows: rowmap, sorted_tok) by rank(expert) ascending, experts of one
// rank in expert order; the CPU experts and selections are unchanged.
void order_gpu_runs(ExpertPass& p, int64_t k, const std::function<int(int32_t expert)>& rank);

// Experts of the next MoE layer to start copying while this one computes (decode under a budget): `picks`
// [tokens * k] is that layer's router applied to this layer's input, each token's picks best first. At most `limit`
// distinct experts that `fetchable` accepts (not in VRAM or a slot yet, copyable), the most picked first, then by the
// best rank a token gave them, then by id.
std::vector<int32_t> plan_prefetch(const int32_t* picks, int64_t tokens, int64_t k, int64_t limit,
                                   const std::function<bool(int32_t expert)>& fetchable);

}  // namespace moesrv
