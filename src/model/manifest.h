// Every tensor a model needs: name, shape, role. One list serves the loader's missing-tensor check, the
// synthetic models, the EXL3 converter (which matrices to quantize) and footprint counts.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/spec.h"

namespace moesrv {

// Matrix: a linear layer's weight (quantizable; EXL3 stores it as <base>.trellis + scales). Expert: a routed
// expert's matrix. Norm: a norm weight or bias. Param: any other tensor kept as stored (convs, decay
// parameters, mHC and k-pool tensors, router).
enum class TensorRole { Matrix, Expert, Norm, Param };
enum class TensorInit { Random, Ones, Zeros };  // for synthetic models

struct TensorEntry {
  std::string name;  // full name, e.g. model.layers.3.self_attn.q_a_proj.weight
  std::vector<int64_t> shape;
  TensorRole role = TensorRole::Matrix;
  int64_t layer = -1, expert = -1;
  TensorInit init = TensorInit::Random;
  bool optional = false;  // the loader has a default when absent (e.g. a zero router correction bias)
  int64_t numel() const;
  bool quantizable() const { return role == TensorRole::Matrix || role == TensorRole::Expert; }
};

// `root`: "model." (text-only layout) or "model.language_model." (multimodal layout).
std::vector<TensorEntry> manifest(const ModelSpec& s, const std::string& root = "model.");
// The MTP block at layer num_layers (DeepSeek-V3 layout): enorm, hnorm, eh_proj, shared_head (its head optional),
// then the tensors of one decoder layer of kind s.mtp_layer without mHC weights.
std::vector<TensorEntry> mtp_manifest(const ModelSpec& s, const std::string& root = "model.");

}  // namespace moesrv
