// Programmatic dependent launch (compute capability 9.0+): a kernel launched by `launch` may start while the kernel
// before it in the stream (or CUDA graph) is still running, so its launch and prologue overlap the predecessor's
// tail. Contract for every kernel launched this way: pdl_enter() (or pdl_wait()) runs before the kernel reads
// anything an earlier kernel wrote and before it writes any global memory; only reads of weights nothing in the
// stream writes (e.g. a plain EXL3 linear's trellis) may come first. pdl_enter() then lets the next kernel launch
// as soon as every block of this one is running. Without the attribute (older GPUs, MOESRV_PDL=0) the
// instructions are no-ops and launches serialize as usual.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <utility>

namespace moesrv::cuda {

// Waits until the previous kernel in the stream has completed and its writes are visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel in the stream launch once every block of this one has called it (or exited).
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
// Trigger after the wait: the next kernel launches while this one runs, at most one kernel ahead. Triggering at
// the start instead (before the wait) let chains of waiting kernels take SM slots early: kda_decode 16.1 vs 14.0 us,
// k-pool select at 32K 52.6 vs 42.5, a KDA+MoE layer 222.7 vs 211.6 (H200, docs/perf-cuda.md).
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_trigger();
}

// Whether launches on the current device use programmatic dependent launch: compute capability >= 9 and not
// switched off by MOESRV_PDL=0 (for comparisons). Per device, read once each.
inline bool pdl_on() {
  static const bool off = [] {
    const char* v = std::getenv("MOESRV_PDL");
    return v && std::atoi(v) == 0;
  }();
  static std::atomic<int> major[64];  // 0 = not read yet, -1 = unknown
  int dev = 0;
  if (off || cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  int m = major[dev].load(std::memory_order_relaxed);
  if (m == 0) {
    if (cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess || m <= 0) m = -1;
    major[dev].store(m, std::memory_order_relaxed);
  }
  return m >= 9;
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch where pdl_on(). The kernel
// must follow the contract above. Launch errors are left for cudaGetLastError (MOESRV_CUDA_LAUNCH_CHECK).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_on() ? 1 : 0;
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace moesrv::cuda
