// Typed reads of a Hugging Face config.json and the pieces every architecture description shares.
#pragma once
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "model/spec.h"
#include "util/error.h"

namespace moesrv::hf {

using json = nlohmann::json;

// The text model's fields: `text_config` of a multimodal config, else the config itself.
const json& text_fields(const json& config);

// A field's value as T. Integer fields (sizes, counts, ids) take JSON integers or integral floats (2048.0) of at
// most 2^31 in magnitude, so products of a few of them cannot overflow; any other number (2.5, 4e126, 2^40) is an
// error naming the field, never a silent conversion. Floating fields must be finite.
template <typename T>
T field_value(const json& v, const char* key) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    if (v.is_number()) {
      const double d = v.get<double>();
      constexpr double kMax = 2147483648.0;  // 2^31
      if (!(d == std::floor(d)) || d < -kMax || d > kMax || (std::is_unsigned_v<T> && d < 0))
        fail("config.json: field {} = {} is not an integer in [{}, 2^31]", key, v.dump(),
             std::is_unsigned_v<T> ? "0" : "-2^31");
      if (v.is_number_float()) return T(d);
    }
  }
  if constexpr (std::is_floating_point_v<T>) {
    if (v.is_number() && !std::isfinite(v.get<double>()))
      fail("config.json: field {} = {} is not finite", key, v.dump());
  }
  try {
    return v.get<T>();
  } catch (const json::exception&) {
    fail("config.json: field {} has the wrong type ({})", key, v.dump());
  }
}

template <typename T>
T get_or(const json& j, const char* key, T dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  return field_value<T>(*it, key);
}

template <typename T>
T require(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) fail("config.json: required field {} is missing", key);
  return field_value<T>(*it, key);
}

constexpr int64_t kMaxLayers = 4096;  // num_hidden_layers above this is a corrupt config

// Sizes a real model can have (hidden 2^20, heads 2^12, head dims 2^14, experts 2^16, ...): beyond them the config is
// corrupt, and the byte counts derived from it (weights, KV cache, state) could overflow. Throws naming the field.
void check_ranges(const ModelSpec& s);

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
