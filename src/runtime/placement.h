// What goes in VRAM: dense/attention weights, KV cache and workspace first, then per-layer expert cache slots
// (the hottest experts pinned), and for cold experts whether a miss is fetched over PCIe or computed on the CPU.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/config.h"

namespace moesrv {

struct ModelWeights;
class ModelPackage;
class UsageStats;

enum class ExpertHome : uint8_t {
  Pinned,  // resident in VRAM for good
  Cached,  // starts in the layer's LRU slots; may be evicted by fetched experts
  Fetch,   // cold: on a miss, copied over PCIe into an LRU slot
  Cpu,     // cold: on a miss, computed on the CPU from host RAM (never admitted)
};
const char* home_name(ExpertHome h);

constexpr uint64_t kGiB = uint64_t(1) << 30;

// Bytes (and parameter counts, for FLOPs) of what a model needs, per layer.
struct ModelFootprint {
  std::vector<uint64_t> expert_bytes;   // [layers] one routed expert (gate+up+down); 0 on dense layers
  std::vector<double> expert_params;    // [layers]
  std::vector<uint64_t> dense_bytes;    // [layers] attention (+indexer), norms, router, shared experts / dense MLP
  std::vector<double> dense_params;     // [layers]
  uint64_t head_bytes = 0;              // lm_head + final norm
  double head_params = 0;
  uint64_t embed_bytes = 0;             // embedding table (kept in host RAM: only looked-up rows are read)
  // Layers [begin, end) (-1: to the last), + the head when the range ends the model; every routed expert of them.
  uint64_t dense_total(int64_t begin = 0, int64_t end = -1) const;
  uint64_t experts_total(const ModelSpec& c, int64_t begin = 0, int64_t end = -1) const;
};
// From the config's shapes at the given storage precision (16 = bf16; EXL3: its bits per weight).
ModelFootprint footprint_from_config(const ModelSpec& c, double expert_bits = 16, double dense_bits = 16);
// From loaded weights (stored bytes of every Linear).
ModelFootprint footprint_from_weights(const ModelWeights& w);
// What the CUDA engine keeps on the device for a package, from tensor headers only: EXL3 linears as stored
// (trellis + fp16 suh/svh), every other weight as footprint_from_config at bf16. MLA kv_b_proj is bf16 on the
// device whatever its format (absorbed per head); expert layers count EXL3 only when all 3E projections are.
ModelFootprint footprint_from_package(const ModelSpec& c, const ModelPackage& pkg);

// KV cache bytes for `context` tokens: MLA (kv_lora_rank + qk_rope_dim) or GQA 2*kv_heads*head_dim elements per
// token per layer, plus DSA indexer keys (index_head_dim) on layers with their own indexer.
// Layers [begin, end) only (-1: to the last) for a pipeline stage.
uint64_t kv_cache_bytes(const ModelSpec& c, int64_t context, int kv_elem_bytes = 2, int index_elem_bytes = 2,
                        int64_t begin = 0, int64_t end = -1);

// Throughputs the split decisions and estimates use (GB/s = 1e9 bytes/s).
struct CostModel {
  double pcie_gbps = 25, host_mem_gbps = 60, hbm_gbps = 1000;
  double cpu_gflops = 300, gpu_tflops = 150;
  double fetch_s(uint64_t bytes) const { return double(bytes) / (pcie_gbps * 1e9); }
  // Memory-bound GEMV for one token, compute-bound once enough tokens share the weight read.
  double cpu_s(uint64_t bytes, double params, double tokens) const;
  double gpu_s(uint64_t bytes, double params, double tokens) const;
  nlohmann::json to_json() const;
};

enum class SlotPolicy { Equal, Entropy };  // Entropy: slots proportional to exp(per-layer routing entropy)

struct PlacementRequest {
  uint64_t vram_budget = 24 * kGiB;
  int64_t context = 8192;
  int64_t step_tokens = 1;             // tokens per forward step the CPU/PCIe split is tuned for (decode batch)
  uint64_t workspace_bytes = kGiB;     // activations, attention scratch, staging buffers
  int kv_elem_bytes = 2, index_elem_bytes = 2;
  double pin_fraction = 0.5;           // share of each layer's slots pinned to its hottest experts (needs usage)
  // >= 0: every slot but this many is pinned, with or without usage (then the lowest ids): decode that reads cold
  // experts in place (--cold-experts read) uses no LRU, which only prefill's streaming needs (a few slots).
  int64_t lru_slots = -1;
  SlotPolicy slot_policy = SlotPolicy::Equal;
  CostModel cost;
  // A pipeline stage's layers [layer_begin, layer_end) (-1: to the last): only their dense weights, caches and
  // experts count (the head on the stage that ends the model, the embedding's host bytes on the first).
  int64_t layer_begin = 0, layer_end = -1;
};

struct LayerPlacement {
  std::vector<ExpertHome> home;  // [experts]; empty on dense layers
  int64_t slots = 0, pinned = 0;
  double hit_rate = 0;           // expected share of routed selections served from VRAM (static approximation)
  double cold_fetch_s = 0, cold_cpu_s = 0;  // expected seconds per step on each cold path (they overlap)
  int64_t fetch_min_tokens = 0;  // a cold expert routed this many tokens in one step is cheaper to fetch
  int64_t count(ExpertHome h) const;
};

struct PlacementPlan {
  bool fits = true;              // false: dense + KV + workspace alone exceed the budget
  std::string note;
  int64_t context = 0, step_tokens = 0;
  uint64_t vram_budget = 0, vram_dense = 0, vram_kv = 0, vram_workspace = 0, vram_experts = 0;
  uint64_t host_bytes = 0;       // routed experts (all, in RAM) + embedding
  bool all_experts_in_vram = false;
  std::vector<LayerPlacement> layers;

  uint64_t vram_total() const { return vram_dense + vram_kv + vram_workspace + vram_experts; }
  std::vector<int32_t> slots_per_layer() const;
  // Should a cold expert routed `tokens` tokens this step be fetched (else computed on the CPU)?
  bool prefer_fetch(int64_t layer, int64_t tokens) const;
  std::string summary() const;
  nlohmann::json to_json() const;
};

PlacementPlan plan_placement(const ModelSpec& c, const ModelFootprint& fp, const PlacementRequest& req,
                             const UsageStats* usage = nullptr);

// Expected seconds of one forward step (`tokens` new tokens at `context`) under a plan: GPU dense + KV reads,
// GPU expert hits, and the slower of the two overlapping cold paths, summed over layers. Plus the bytes each
// device must move (the physical floor).
struct StepEstimate {
  double seconds = 0, gpu_s = 0, cold_s = 0;
  double hbm_bytes = 0, pcie_bytes = 0, host_bytes = 0;
  nlohmann::json to_json() const;
};
StepEstimate estimate_step(const ModelSpec& c, const ModelFootprint& fp, const PlacementPlan& plan,
                           const CostModel& cost, int64_t tokens, int64_t context, const UsageStats* usage = nullptr);

}  // namespace moesrv
