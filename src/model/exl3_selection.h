// Which tensors of a model package the EXL3 converter (format/exl3_convert.h) quantizes, decided from the tensor
// manifest (model/manifest.h) for every architecture with a ModelSpec:
// * quantized: every TensorEntry::quantizable() matrix (MLA / GQA / KDA / Gated DeltaNet projections, dense
//   MLPs, routed and shared experts, lm_head), except those exl3_keep_exact() names;
// * kept as stored: roles Norm and Param (embeddings, norms, router and its bias, convs, A_log, dt_bias, mHC
//   hc_*_fn/base/scale, k-pool index_kpool_compress_ape/gate, shared_expert_gate, biases);
// * tensors outside the manifest: an MTP block (layer num_hidden_layers, which the engines do not run) follows
//   the converter's name rule (exl3_should_quantize), as before; everything else, model.visual.* included, is
//   copied as stored.
#pragma once
#include <string>

#include "format/exl3_convert.h"
#include "format/package.h"
#include "model/manifest.h"

namespace moesrv {

// Quantizable matrices kept exact: MLA kv_b_proj (the loader dequantizes it into the absorbed per-head
// w_uk/w_uv in fp32, so quantizing saves nothing at run time and only adds error to every key and value) and the
// DSA indexer's wq_b/wk/weights_proj (small; their scores drive a discrete top-k selection).
bool exl3_keep_exact(const TensorEntry& t);

// Sets opt.select (and select_name "manifest (<model_type>)") for `pkg` when a ModelSpec describes its config;
// returns false and leaves opt as it was (the name rule) otherwise.
bool exl3_select_by_manifest(const ModelPackage& pkg, Exl3ConvertOptions& opt);

// exl3_convert_model with the manifest selection when the architecture has one (the name rule otherwise).
Exl3ConvertStats exl3_convert_package(const std::string& in_dir, const std::string& out_dir, Exl3ConvertOptions opt);

}  // namespace moesrv
