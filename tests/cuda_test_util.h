// Options shared by the CUDA engine tests.
#pragma once
#include <algorithm>
#include <string>
#include <vector>

#include "backend/cuda/cuda_engine.h"
#include "format/package.h"

namespace moesrv::test {

// `opt` with every routed expert of the package at `dir` in host memory behind 2 LRU slots per layer, and the pass
// arena lent to them as more slots between prompts (CudaEngineOptions::lend_pass_arena, on for tiny arenas too).
inline CudaEngineOptions with_lent_slots(const std::string& dir, CudaEngineOptions opt) {
  std::vector<std::vector<ExpertPlacement>> p = CudaEngine(ModelPackage::open(dir), opt).placement();
  for (auto& layer : p) std::fill(layer.begin(), layer.end(), ExpertPlacement::Cache);
  opt.placement = p;
  opt.cache_slots = 2;
  opt.stream_cold = false;
  opt.lend_min_gib = 0;
  return opt;
}

}  // namespace moesrv::test
