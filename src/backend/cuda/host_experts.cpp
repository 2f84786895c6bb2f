#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
#include "backend/cuda/host_experts.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "backend/cpu/exl3_linear.h"
#include "backend/cuda/engine_internal.h"
#include "util/numeric.h"

namespace moesrv::cuda {

namespace {

uintptr_t page_size() {
  static const uintptr_t p = uintptr_t(std::max<long>(4096, sysconf(_SC_PAGESIZE)));
  return p;
}

const Exl3Linear& exl3_part(const MlpWeights& m, int j) {
  const Linear* l = j == 0 ? m.gate.get() : j == 1 ? m.up.get() : m.down.get();
  const Exl3Linear* x = as_exl3(l);
  if (!x) fail("host experts: an EXL3 expert has a {} projection", l->kind());
  return *x;
}

}  // namespace

HostRegistration::~HostRegistration() {
  for (auto [b, e] : mine_) cudaHostUnregister(reinterpret_cast<void*>(b));
}

void HostRegistration::add(const void* p, size_t bytes) {
  if (!p || !bytes) return;
  const uintptr_t ps = page_size(), a = reinterpret_cast<uintptr_t>(p);
  pending_.push_back({a / ps * ps, (a + bytes + ps - 1) / ps * ps});
}

void HostRegistration::commit() {
  std::sort(pending_.begin(), pending_.end());
  std::vector<std::pair<uintptr_t, uintptr_t>> merged;
  for (auto r : pending_) {
    if (!merged.empty() && r.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, r.second);
    else merged.push_back(r);
  }
  pending_.clear();
  bool warned = false;
  for (auto [b, e] : merged) {
    const cudaError_t err =
        cudaHostRegister(reinterpret_cast<void*>(b), e - b,
                         cudaHostRegisterPortable | cudaHostRegisterReadOnly | (mapped ? cudaHostRegisterMapped : 0));
    if (err == cudaSuccess) {
      mine_.push_back({b, e});
      registered_bytes_ += e - b;
      continue;
    }
    cudaGetLastError();  // clear it: the range stays usable as pageable memory
    if (err != cudaErrorHostMemoryAlreadyRegistered && !warned) {
      std::fprintf(stderr, "moesrv: host expert weights not page-locked (%s); PCIe copies go through staging\n",
                   cudaGetErrorString(err));
      warned = true;
    }
  }
}

HostExperts::HostExperts(const MoeWeights& w, bool exl3, const std::vector<std::array<Exl3Dev, 3>>& layout,
                         const std::vector<bool>& wanted, HostRegistration& reg, bool aligned)
    : w_(w), exl3_(exl3), layout_(layout), wanted_(wanted) {
  const size_t E = w.experts.size();
  if (wanted_.size() != E || (exl3 && layout_.size() != E))
    fail("host experts: {} experts, {} flags, {} layouts", E, wanted_.size(), layout_.size());
  if (!exl3) {
    blocks_.resize(E);
    for (size_t e = 0; e < E; ++e) {
      if (!wanted_[e]) continue;
      std::array<Exl3Dev, 3> unused;
      std::vector<uint8_t> block;
      expert_block(w.experts[e], false, &unused, &block);
      blocks_[e] = PinnedBuffer(block.size());
      std::memcpy(blocks_[e].as<void>(), block.data(), block.size());
      pinned_bytes_ += block.size();
    }
    return;
  }
  // EXL3: the scales of every wanted expert in one pinned buffer (one allocation per layer, not per expert).
  scale_off_.resize(E);
  size_t bytes = 0;
  for (size_t e = 0; e < E; ++e) {
    if (!wanted_[e]) continue;
    for (int j = 0; j < 3; ++j) {
      const Exl3Dev& d = layout_[e][size_t(j)];
      // The block keeps svh right after suh (both fp16, in_pad a multiple of 128): one copy for the two.
      if (reinterpret_cast<uintptr_t>(d.svh) != reinterpret_cast<uintptr_t>(d.suh) + size_t(d.in_pad) * 2)
        fail("host experts: expert {} part {}: svh does not follow suh in the device block", e, j);
      scale_off_[e][size_t(j)] = bytes;
      bytes += size_t(d.in_pad + d.out_pad) * 2;
    }
  }
  scales_.emplace_back(bytes);
  pinned_bytes_ = bytes;
  uint8_t* base = scales_[0].as<uint8_t>();
  // With `aligned`: the unaligned trellises packed into one pinned buffer (each a multiple of 32 bytes long).
  size_t copies = 0;
  auto unaligned = [&](const Exl3Weights& x) { return aligned && reinterpret_cast<uintptr_t>(x.trellis) % 16; };
  auto copy_bytes = [](const Exl3Weights& x) { return (x.trellis_bytes() + 15) / 16 * 16; };  // keeps the next aligned
  for (size_t e = 0; e < E; ++e)
    for (int j = 0; wanted_[e] && j < 3; ++j)
      if (const Exl3Weights& x = exl3_part(w.experts[e], j).weights(); unaligned(x)) copies += copy_bytes(x);
  if (copies) realigned_.emplace_back(copies), pinned_bytes_ += copies;
  trellis_.assign(E, {nullptr, nullptr, nullptr});
  size_t at = 0;
  for (size_t e = 0; e < E; ++e) {
    if (!wanted_[e]) continue;
    for (int j = 0; j < 3; ++j) {
      const Exl3Weights& x = exl3_part(w.experts[e], j).weights();
      auto* dst = reinterpret_cast<uint16_t*>(base + scale_off_[e][size_t(j)]);
      for (size_t i = 0; i < x.suh.size(); ++i) dst[i] = f64_to_f16_rne(x.suh[i]);  // exact: they came from fp16
      for (size_t i = 0; i < x.svh.size(); ++i) dst[x.suh.size() + i] = f64_to_f16_rne(x.svh[i]);
      if (unaligned(x)) {
        uint8_t* copy = realigned_[0].as<uint8_t>() + at;
        std::memcpy(copy, x.trellis, x.trellis_bytes());
        trellis_[e][size_t(j)] = copy;
        at += copy_bytes(x);
      } else {
        trellis_[e][size_t(j)] = x.trellis;
        reg.add(x.trellis, x.trellis_bytes());
      }
    }
  }
}

HostExperts::~HostExperts() = default;

size_t HostExperts::copy(int e, void* dst, cudaStream_t st, int64_t skip, bool gate_up_whole) const {
  if (!wanted_[size_t(e)]) fail("host experts: expert {} has no host copy for the GPU", e);
  if (!exl3_) {
    if (skip) fail("host experts: expert {} is not EXL3: no rows skipped", e);
    MOESRV_CUDA_OK(
        cudaMemcpyAsync(dst, blocks_[size_t(e)].as<void>(), blocks_[size_t(e)].bytes(), cudaMemcpyHostToDevice, st));
    return blocks_[size_t(e)].bytes();
  }
  if (skip && !can_skip(e, skip)) fail("host experts: expert {}: {} intermediate rows cannot be skipped", e, skip);
  return copy_parts(e, dst, st, skip, false, gate_up_whole);
}

size_t HostExperts::top_up(int e, void* dst, cudaStream_t st, int64_t skip, bool gate_up_whole) const {
  if (!can_skip(e, skip)) fail("host experts: expert {}: {} intermediate rows cannot be skipped", e, skip);
  return copy_parts(e, dst, st, skip, true, gate_up_whole);
}

bool HostExperts::can_skip(int e, int64_t skip) const {
  if (!exl3_ || !wanted_[size_t(e)] || skip <= 0 || skip % 128) return false;
  const auto& d = layout_[size_t(e)];
  return d[0].out_pad == d[1].out_pad && d[1].out_pad == d[2].in_pad && d[0].in_pad == d[1].in_pad &&
         skip < d[2].in_pad;
}

// EXL3 parts (trellis [in/16][out/16][tile], then suh | svh). The intermediate rows [0, skip) are gate's and up's
// output tile columns [0, skip / 16) of every tile row (one strided copy each, or none: gate_up_whole copies them
// whole at first) and down's first skip / 16 tile rows. !rest: the whole block but those (gate's and up's svh there
// zeroed), rest: those and the scales.
size_t HostExperts::copy_parts(int e, void* dst, cudaStream_t st, int64_t skip, bool rest, bool gate_up_whole) const {
  auto* base = static_cast<uint8_t*>(dst);
  const MlpWeights& m = w_.experts[size_t(e)];
  size_t bytes = 0;
  for (int j = 0; j < 3; ++j) {
    const Exl3Dev& d = layout_[size_t(e)][size_t(j)];
    const Exl3Weights& x = exl3_part(m, j).weights();
    uint8_t* tr = base + reinterpret_cast<uintptr_t>(d.trellis);
    const auto* src = static_cast<const uint8_t*>(trellis_[size_t(e)][size_t(j)]);
    const size_t tile = size_t(32 * d.K), row = size_t(d.out_pad / 16) * tile, cut = size_t(skip / 16);
    if (skip == 0 || (j < 2 && gate_up_whole && !rest)) {
      MOESRV_CUDA_OK(cudaMemcpyAsync(tr, src, x.trellis_bytes(), cudaMemcpyHostToDevice, st));
      bytes += x.trellis_bytes();
    } else if (j < 2 && gate_up_whole) {  // (rest: already there)
    } else if (j < 2) {  // tile columns [0, cut) (rest) or [cut, out/16) of each of the in/16 tile rows
      const size_t off = rest ? 0 : cut * tile, width = rest ? cut * tile : row - cut * tile;
      MOESRV_CUDA_OK(
          cudaMemcpy2DAsync(tr + off, row, src + off, row, width, size_t(d.in_pad / 16), cudaMemcpyHostToDevice, st));
      bytes += width * size_t(d.in_pad / 16);
    } else {  // tile rows [0, cut) (rest) or [cut, in/16)
      const size_t off = rest ? 0 : cut * row, len = rest ? cut * row : x.trellis_bytes() - cut * row;
      MOESRV_CUDA_OK(cudaMemcpyAsync(tr + off, src + off, len, cudaMemcpyHostToDevice, st));
      bytes += len;
    }
    const size_t scale_bytes = size_t(d.in_pad + d.out_pad) * 2;
    MOESRV_CUDA_OK(cudaMemcpyAsync(base + reinterpret_cast<uintptr_t>(d.suh),
                                   scales_[0].as<uint8_t>() + scale_off_[size_t(e)][size_t(j)], scale_bytes,
                                   cudaMemcpyHostToDevice, st));
    bytes += scale_bytes;
    if (skip && !rest && j < 2)  // gate's and up's outputs [0, skip) are 0: the SwiGLU there too, down's input
      MOESRV_CUDA_OK(cudaMemsetAsync(base + reinterpret_cast<uintptr_t>(d.svh), 0, size_t(skip) * 2, st));
  }
  return bytes;
}

bool HostExperts::mapped_parts(int e, std::array<Exl3Dev, 3>& out) const {
  if (!exl3_ || !wanted_[size_t(e)]) return false;
  // The address kernels on the current device read page-locked host memory at (none: not locked or not mapped).
  auto device = [](const void* host, const void** dev) {
    cudaPointerAttributes at{};
    if (cudaPointerGetAttributes(&at, host) != cudaSuccess || at.type != cudaMemoryTypeHost || !at.devicePointer) {
      cudaGetLastError();  // the caller keeps copying
      return false;
    }
    *dev = at.devicePointer;
    return true;
  };
  for (int j = 0; j < 3; ++j) {
    Exl3Dev d = layout_[size_t(e)][size_t(j)];
    const void* scales = nullptr;
    if (!device(trellis_[size_t(e)][size_t(j)], &d.trellis) ||
        !device(scales_[0].as<uint8_t>() + scale_off_[size_t(e)][size_t(j)], &scales) ||
        reinterpret_cast<uintptr_t>(d.trellis) % 16)
      return false;
    d.suh = static_cast<const uint16_t*>(scales);
    d.svh = d.suh + d.in_pad;
    out[size_t(j)] = d;
  }
  return true;
}

}  // namespace moesrv::cuda
#endif  // MOESRV_HAS_CUDA
