// Converts a bf16/fp16/fp32 HF model folder into an EXL3 package with the test encoder (exl3_encode.h):
// linear projections (attention, dense MLP, experts, shared experts, lm_head at head_bits) become
// trellis/suh/svh(/mcg|mul1); embeddings, norms, router gates, e_score_correction_bias, MLA kv_b_proj,
// DSA indexers and everything not 2-D stay as they are. Padded tensors record their logical shape in the
// shard metadata ("exl3.shape.<prefix>" = "<out>,<in>"); config.json gains quantization_config.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "format/exl3_codebook.h"
#include "format/tensor_view.h"

namespace moesrv {

struct Exl3ConvertOptions {
  int bits = 4;
  int head_bits = 6;
  Exl3Codebook codebook = Exl3Codebook::Mul1;
  uint64_t seed = 1;
  bool scale_search = false;                          // slower, slightly better
  std::function<bool(const std::string&)> filter;     // optional: quantize only tensors it accepts
  std::function<void(const std::string&)> on_tensor;  // progress: called with each tensor name
};

struct Exl3ConvertStats {
  int quantized = 0, kept = 0;
  double mean_rel_mse = 0;  // mean over quantized tensors, rotated basis
};

// True for `<...>.weight` tensors that the converter quantizes (see above).
bool exl3_should_quantize(const std::string& name, const TensorView& t);

Exl3ConvertStats exl3_convert_model(const std::string& in_dir, const std::string& out_dir, const Exl3ConvertOptions& opt);

}  // namespace moesrv
