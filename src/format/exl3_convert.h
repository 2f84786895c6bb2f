// Converts a bf16/fp16/fp32 HF model folder into an EXL3 package with the test encoder (exl3_encode.h):
// the tensors `select` accepts (lm_head.weight at head_bits, the rest at bits) become trellis/suh/svh(/mcg|mul1);
// every other tensor is copied as stored. Padded tensors record their logical shape in the shard metadata
// ("exl3.shape.<prefix>" = "<out>,<in>"); config.json gains quantization_config.
//
// Which tensors to quantize is a model question: model/exl3_selection.h decides from the tensor manifest for
// every architecture with a ModelSpec (what apps/exl3_convert uses). Without `select`, the name rule below.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "format/exl3_codebook.h"
#include "format/tensor_view.h"

namespace moesrv {

// Whether the converter quantizes tensor `name` (its view `t`).
using Exl3Select = std::function<bool(const std::string& name, const TensorView& t)>;

struct Exl3ConvertOptions {
  int bits = 4;
  int head_bits = 6;
  Exl3Codebook codebook = Exl3Codebook::Mul1;
  uint64_t seed = 1;
  bool scale_search = false;                          // slower, slightly better
  Exl3Select select;                                  // empty: exl3_should_quantize (the name rule)
  std::string select_name;                            // how `select` decides, for reports ("names" when empty)
  std::function<bool(const std::string&)> filter;     // optional: quantize only selected tensors it accepts
  std::function<void(const std::string&)> on_tensor;  // progress: called with each tensor name
};

struct Exl3ConvertStats {
  int quantized = 0, kept = 0;
  double mean_rel_mse = 0;  // mean over quantized tensors, rotated basis
  std::string selection;    // Exl3ConvertOptions::select_name ("custom" if unnamed), or "names" without select
};

// The name rule: 2-D `<...>.weight` tensors whose last module name contains "proj" (q_proj, in_proj_qkvz,
// gate_proj, ...) and lm_head.weight; never MLA kv_b_proj or anything under `.indexer.`. Embeddings, norms,
// router gates, e_score_correction_bias and everything not 2-D stay as they are.
bool exl3_should_quantize(const std::string& name, const TensorView& t);

Exl3ConvertStats exl3_convert_model(const std::string& in_dir, const std::string& out_dir, const Exl3ConvertOptions& opt);

}  // namespace moesrv
