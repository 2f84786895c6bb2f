// Where a device engine's routed experts live, as arithmetic over their byte sizes: the LRU slots a layer needs, the
// fill that places experts when no plan is given (VRAM in order while the budget allows, then the CPU), and the fit
// that moves VRAM experts of a given plan (runtime/placement.h's) out until the whole fits. The CUDA engine's only
// placement rules; pure, so CPU builds test them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace moesrv {

// Where one routed expert's weights live and run.
enum class ExpertPlacement : uint8_t {
  Vram,   // resident on the GPU
  Cache,  // host memory (EXL3 as stored, page-locked), copied into a per-layer LRU VRAM cache on use
  Cpu,    // computed on the host from the stored weights, overlapped with GPU work
};

// LRU slots of a MoE layer with `cached` Cache experts and `streamable` Cpu experts that may stream through them:
// `wanted`, at least 2 with streaming (one expert's copy overlaps the previous one's compute), never more than
// those experts, and just 2 when nothing is cached.
int64_t cache_slot_count(int64_t cached, int64_t streamable, int64_t wanted);

// The experts outside VRAM that reach the GPU through a layer's LRU slots, and the slots they need.
struct SlotUse {
  int64_t cached = 0, streamable = 0;
  size_t slot_bytes = 0;  // the largest of those experts
  int64_t slots = 0;      // cache_slot_count
};

// One MoE layer of a device engine.
struct ExpertLayer {
  std::vector<size_t> bytes;               // [expert] as the device holds it; empty: not a MoE layer
  std::vector<ExpertPlacement> placement;  // [expert]; empty: fill_in_order places it
  bool streams = false;      // its Cpu experts may stream through its slots (EXL3 with CudaEngineOptions::stream_cold)
  int64_t wanted_slots = 0;  // LRU slots asked for (CudaEngineOptions::cache_slots[_per_layer])

  // Cache experts, and Cpu experts that stream.
  bool uses_slots(size_t expert) const;
  SlotUse slot_use() const;
  // VRAM experts + LRU slots + 1 MiB for tables and slack.
  size_t device_bytes() const;
};

// Places the layers without a placement, in order, expert by expert: VRAM while `planned` bytes plus the expert's
// stay within `limit`, else Cpu. When not all of their experts fit, the slots their streaming experts pass through
// (cache_slot_count with nothing cached) are set aside first. Returns `planned` plus what it set aside and placed.
size_t fill_in_order(std::vector<ExpertLayer>& layers, size_t planned, size_t limit);

// A given plan estimates the engine's own bytes before the engine exists: while `planned` plus every MoE layer's
// device_bytes exceed `limit`, VRAM experts move to host memory, one per layer in turn from the last layer's highest
// id; each joins its layer's LRU cache where the layer has Cache experts, else goes to the CPU. Returns the count.
int64_t fit_to_budget(std::vector<ExpertLayer>& layers, size_t planned, size_t limit);

// fill_in_order, then, when `given` (a caller's plan is in effect), fit_to_budget from the same `planned` bytes.
// Returns the count it moved.
int64_t place_experts(std::vector<ExpertLayer>& layers, size_t planned, size_t limit, bool given);

}  // namespace moesrv
