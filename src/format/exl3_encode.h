// EXL3 encoder, for tests and tiny models: fp32 W (out x in) -> trellis + suh/svh, the way exllamav3 lays
// them out (random signs x channel RMS scales, 128-point Hadamard on both sides, one global scale), but
// without Hessian/LDLQ error feedback: each 16x16 tile is quantized alone by a Viterbi search over the
// tail-biting trellis (2^16 states, 256 steps; a short free-start pass over the last 64 steps guesses the
// end state, then a full pass pinned to it closes the path into a cycle).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "format/exl3_weights.h"
#include "format/tensor_view.h"

namespace moesrv {

struct Exl3EncodeOptions {
  int K = 4;
  Exl3Codebook codebook = Exl3Codebook::Mul1;
  uint64_t seed = 0x5eed;
  bool out_scales = true;    // fold per-output-channel RMS into svh (exllamav3 "out_scales")
  bool scale_search = true;  // pick the global scale by test-quantizing a few tiles
};

struct Exl3Encoded {
  int64_t in_features = 0, out_features = 0;  // logical shape (W is out x in)
  Exl3Weights weights;                        // trellis owned by `trellis` below; suh/svh as fp16 values
  std::shared_ptr<std::vector<uint16_t>> trellis;
  std::vector<uint16_t> suh_f16, svh_f16;
  uint32_t marker = 0;                        // .mcg / .mul1 scalar
  double rotated_rel_mse = 0;                 // tile quantization error / energy, in the rotated basis

  // Views for write_safetensors: <prefix>.trellis, .suh, .svh and .mcg/.mul1 (pointing into this object).
  std::vector<TensorView> tensor_views(const std::string& prefix) const;
};

Exl3Encoded exl3_encode(const float* w, int64_t out_features, int64_t in_features, const Exl3EncodeOptions& opt);

// Best cyclic state sequence for 256 targets given in stream order; returns the summed squared error.
double exl3_quantize_tile(const float* target, int K, Exl3Codebook cb, uint16_t states[256]);

}  // namespace moesrv
