// Layer split across GPUs (pipeline parallelism): each GPU gets one contiguous layer range. Ranges are chosen
// to balance decode time (per-layer cost ~ bytes read per token) under each GPU's VRAM budget. The embedding
// lives on GPU 0, final norm + lm_head on the last GPU.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "runtime/placement.h"

namespace moesrv {

// What each layer costs, in VRAM and in bytes read per decode token.
struct LayerSplitCosts {
  std::vector<uint64_t> vram_bytes;  // [layers] dense weights + KV cache at context + resident experts
  std::vector<double> read_bytes;    // [layers] per decode token: dense + KV + expected resident expert reads
  uint64_t embed_bytes = 0, head_bytes = 0;  // on the first / last GPU
  double head_read_bytes = 0;
  uint64_t workspace_bytes = kGiB;   // per GPU: activations, scratch
};

// From shapes: KV for `context` tokens at kv_elem_bytes; resident_experts[l] experts of layer l in VRAM
// (empty: none; the rest stay in host RAM and are not counted here).
LayerSplitCosts layer_split_costs(const ModelSpec& c, const ModelFootprint& fp, int64_t context,
                                  const std::vector<int64_t>& resident_experts = {}, int kv_elem_bytes = 2);

struct GpuShare {
  int gpu = 0;
  int64_t layer_begin = 0, layer_end = 0;  // [begin, end)
  uint64_t layer_bytes = 0, embed_bytes = 0, head_bytes = 0, workspace_bytes = 0, budget = 0;
  double read_bytes = 0;                   // per decode token (the time proxy being balanced)
  uint64_t total() const { return layer_bytes + embed_bytes + head_bytes + workspace_bytes; }
};

struct MultiGpuPlan {
  bool fits = false;
  std::string error;  // why not, when !fits
  std::vector<GpuShare> gpus;
  double max_read_bytes() const;  // the slowest stage
  std::string summary() const;
};

// budgets: bytes per GPU (its size is the GPU count).
MultiGpuPlan plan_layer_split(const LayerSplitCosts& costs, const std::vector<uint64_t>& budgets);

// "--vram-budget 22,22" in GiB: one value for every GPU or one per GPU; 0 entries are rejected.
std::vector<uint64_t> vram_budgets_for(const std::vector<double>& gib, int gpus);

}  // namespace moesrv
