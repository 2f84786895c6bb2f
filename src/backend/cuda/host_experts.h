// Routed experts that live in host RAM and travel to the GPU when used (LRU cache misses; cold experts streamed
// during large passes), as stored. EXL3 experts are copied part by part straight from the host weights: the trellis
// the loader maps from the package (its pages registered with CUDA once, read-only, so the copy is a DMA and the
// host keeps one copy of the model) and the fp16 scales from one pinned table built at load. Other experts (bf16
// or fp8 models) are copied from a pinned copy of their device block made at load.
// CUDA builds only (included by engine_internal.h).
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "backend/cuda/exl3_ops.h"
#include "model/weights.h"

namespace moesrv::cuda {

class PinnedBuffer;

// Page-locks host ranges for DMA (read-only; with `mapped`, also mapped for kernels' zero-copy reads), merged to
// whole pages. A range that is already registered (another engine on the same package) is used as it is; one that
// cannot be registered stays pageable (copies still work, through the driver's staging). Unregisters what it
// registered on destruction.
class HostRegistration {
 public:
  HostRegistration() = default;
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  ~HostRegistration();
  void add(const void* p, size_t bytes);  // collected until commit()
  void commit();
  bool mapped = false;  // set before commit(): HostExperts::mapped_parts needs it
  size_t registered_bytes() const { return registered_bytes_; }

 private:
  std::vector<std::pair<uintptr_t, uintptr_t>> pending_, mine_;  // [begin, end) page ranges
  size_t registered_bytes_ = 0;
};

class HostExperts {
 public:
  // layout[e]: expert e's EXL3 parts inside its device block (offsets as expert_block gives them; exl3 only);
  // wanted[e]: experts that may be copied. Their EXL3 trellis ranges go to `reg` (commit() it afterwards).
  // aligned: every trellis 16-byte aligned for mapped_parts; those that are not in the package (its tensors are
  // only 4- or 8-byte aligned) are read from a pinned aligned copy instead (the package's pages are then not locked).
  HostExperts(const MoeWeights& w, bool exl3, const std::vector<std::array<Exl3Dev, 3>>& layout,
              const std::vector<bool>& wanted, HostRegistration& reg, bool aligned = false);
  ~HostExperts();
  HostExperts(const HostExperts&) = delete;
  HostExperts& operator=(const HostExperts&) = delete;
  bool has(int e) const { return wanted_[size_t(e)]; }
  // Queues the copy of expert e's device block into `dst` (device memory of the block's size) on `st`; returns the
  // bytes it copies. skip > 0 (EXL3; a multiple of 128 below the intermediate size): all but intermediate rows
  // [0, skip), which the CPU computes for this pass (cpu::ExpertRows slices): gate's and up's trellis columns and
  // down's trellis rows of them are not copied, and gate's and up's svh there are zeroed, so the block computes
  // exactly the rest's share (whatever stale trellis words the slot holds there decode to finite values times 0).
  // gate_up_whole: gate's and up's trellises cross whole (one contiguous copy each instead of a strided one per
  // tile row); only down's rows are skipped (their svh zeroed all the same).
  size_t copy(int e, void* dst, cudaStream_t st, int64_t skip = 0, bool gate_up_whole = false) const;
  // Completes a copy(e, dst, st, skip, gate_up_whole): the skipped rows and the true scales (after the GPU's reads of
  // this pass).
  size_t top_up(int e, void* dst, cudaStream_t st, int64_t skip, bool gate_up_whole = false) const;
  // Whether copy(e, ..., skip) takes that skip: EXL3, gate / up / down over one padded intermediate size, skip a
  // multiple of 128 inside it.
  bool can_skip(int e, int64_t skip) const;
  // EXL3: expert e's parts as kernels may read them in place over PCIe (zero copy: the trellis in the registered
  // package pages, the scales in the pinned table), after the registration's commit(). False when a part cannot be
  // read so (its pages not mapped, or a trellis not 16-byte aligned, as the GEMV's loads need: see `aligned`).
  bool mapped_parts(int e, std::array<Exl3Dev, 3>& out) const;
  size_t pinned_bytes() const { return pinned_bytes_; }

 private:
  const MoeWeights& w_;
  bool exl3_;
  std::vector<std::array<Exl3Dev, 3>> layout_;
  std::vector<bool> wanted_;
  std::vector<PinnedBuffer> blocks_;              // non-EXL3: per wanted expert, its device block
  std::vector<PinnedBuffer> scales_;              // EXL3: one buffer, suh | svh (fp16) of every wanted expert
  std::vector<std::array<size_t, 3>> scale_off_;  // [e][part] byte offset of the part's suh | svh in scales_[0]
  std::vector<std::array<const void*, 3>> trellis_;  // EXL3: [e][part] where its trellis is read (package or copy)
  std::vector<PinnedBuffer> realigned_;              // EXL3 with `aligned`: the copies of unaligned trellises
  size_t pinned_bytes_ = 0;
  size_t copy_parts(int e, void* dst, cudaStream_t st, int64_t skip, bool rest, bool gate_up_whole) const;
};

}  // namespace moesrv::cuda
