// Cold routed experts (not in VRAM) either travel over PCIe and run on the GPU, or run on the CPU from host RAM;
// the two paths work at the same time, so a step is as slow as the slower one. One rule for the planner (expected
// costs per step) and the CUDA engine (this step's tokens and measured rates).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace moesrv {

struct ColdCost {
  int32_t id = 0;
  double fetch_s = 0, cpu_s = 0;  // seconds on each path
};

// Orders `cold` for fetching (highest CPU/fetch cost ratio first: more tokens per expert favour the GPU; entries
// with no fetch cost last) and returns how many leading entries to fetch: the prefix minimising max(fetch time,
// CPU time), ties to the smaller sum. can_fetch = false (no slot to fetch into): 0.
size_t split_cold(std::vector<ColdCost>& cold, bool can_fetch = true);

// Seconds one cold expert costs on each path, from measured rates.
struct ColdRates {
  double pcie_bytes_s = 0;  // host -> device copy rate of expert blocks
  double cpu_first_s = 0;   // one expert, one token, on the CPU pool
  double cpu_token_s = 0;   // each further token of the same expert
  double fetch_s(double bytes) const { return pcie_bytes_s > 0 ? bytes / pcie_bytes_s : 1e30; }
  double cpu_s(int64_t tokens) const { return cpu_first_s + double(tokens > 1 ? tokens - 1 : 0) * cpu_token_s; }
};

}  // namespace moesrv
