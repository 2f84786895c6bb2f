// cuda_available() for every build: false without the CUDA backend, else whether a device is visible.
#include "backend/cuda/cuda_engine.h"

#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
#include <cuda_runtime.h>
#endif

namespace moesrv {

bool cuda_available() {
#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

int cuda_device_count() {
#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
#else
  return 0;
#endif
}

}  // namespace moesrv
