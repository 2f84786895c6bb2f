// Typed reads of a Hugging Face config.json and the pieces every architecture description shares.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/spec.h"
#include "util/error.h"

namespace moesrv::hf {

using json = nlohmann::json;

// The text model's fields: `text_config` of a multimodal config, else the config itself.
const json& text_fields(const json& config);

template <typename T>
T get_or(const json& j, const char* key, T dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    fail("config.json: field {} has the wrong type ({})", key, it->dump());
  }
}

template <typename T>
T require(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) fail("config.json: required field {} is missing", key);
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    fail("config.json: field {} has the wrong type ({})", key, it->dump());
  }
}

// A per-layer string list of n entries (e.g. layer_types), empty when absent.
std::vector<std::string> layer_list(const json& j, const char* key, int64_t n);

// vocab, hidden, layers, heads, norms, embeddings tie, max position.
void read_common(const json& j, ModelSpec& s);
// MoE sizes and router fields; layer_is_moe from mlp_layer_types or first_k_dense_replace/moe_layer_freq.
void read_moe(const json& j, ModelSpec& s);
// MLA dims (q/kv LoRA ranks, nope/rope/v head dims) and the MLA softmax scale.
void read_mla(const json& j, ModelSpec& s);
// Rotary embedding (default or YaRN) over `rope_head_dim` dims (times partial_rotary_factor).
void read_rope(const json& j, ModelSpec& s, int64_t rope_head_dim);
// DSA indexer dims and which layers own an indexer (indexer_types / index_topk_freq).
void read_indexer(const json& j, ModelSpec& s);
// Fills layers[] for softmax-attention models from layer_is_moe / layer_has_indexer; checks consistency.
void finish(ModelSpec& s, Mixer mixer);

}  // namespace moesrv::hf
