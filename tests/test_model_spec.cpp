// The model description of every hf-tiny config: per-layer kinds, residual form and state, read from
// config.json alone (never from a layer-index pattern).
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <set>

#include "backend/cpu/linear.h"
#include "format/package.h"
#include "model/manifest.h"
#include "model/state.h"
#include "model/weights.h"
#include "reference_util.h"
#include "util/error.h"

namespace moesrv {
namespace {

using namespace moesrv::testing;

ModelSpec spec_of(const std::string& model) { return ModelSpec::from_json(read_json_file(hf_tiny(model) + "/config.json")); }

std::string kinds(const ModelSpec& s) {
  std::string out;
  for (const LayerSpec& L : s.layers) {
    out += L.mixer == Mixer::Mla ? "M" : L.mixer == Mixer::Gqa ? "G" : L.mixer == Mixer::Kda ? "K" : "D";
    out += L.indexer == IndexerKind::Own ? "i" : L.indexer == IndexerKind::Shared ? "s" : "";
    out += L.ffn == FfnKind::Moe ? "e " : "d ";
  }
  return out;
}

TEST(ModelSpec, LayerKindsOfEveryTinyModel) {
  EXPECT_EQ(kinds(spec_of("deepseek_v3")), "Md Me Me Me ");
  EXPECT_EQ(kinds(spec_of("glm4_moe")).substr(0, 2), "Gd");
  EXPECT_EQ(kinds(spec_of("glm5_next")), "Kd Kd Kd Mie Ke Ke Ke Mie ");
  EXPECT_EQ(kinds(spec_of("glm5_next_clamp")), "Kd Mie Ke Mie ");
  EXPECT_EQ(kinds(spec_of("qwen3_next")), "De De De Ge ");
  for (const char* m : {"glm_moe_dsa", "glm_moe_dsa_h16"})
    for (const LayerSpec& L : spec_of(m).layers) EXPECT_EQ(L.mixer, Mixer::Mla) << m;
}

TEST(ModelSpec, Glm5NextDims) {
  ModelSpec s = spec_of("glm5_next");
  EXPECT_EQ(s.residual.streams, 4);
  EXPECT_EQ(s.residual.sinkhorn_iters, 20);
  EXPECT_EQ(s.stream_width(), 4 * 128);
  EXPECT_EQ(s.rope.dim, 0);  // NoPE
  EXPECT_EQ(s.index_kpool, 4);
  EXPECT_TRUE(s.index_select_tail);
  EXPECT_EQ(s.linear.v_heads, 4);
  EXPECT_EQ(s.linear.dk, 32);
  EXPECT_TRUE(s.linear.lower_bound_set);
  EXPECT_DOUBLE_EQ(s.swiglu_limit, 10.0);
  EXPECT_DOUBLE_EQ(spec_of("glm5_next_clamp").swiglu_limit, 0.25);
  EXPECT_TRUE(s.has_recurrent_layers());
}

// Nested (text_config) and flat configs describe the same model.
TEST(ModelSpec, NestedAndFlatConfigsAgree) {
  nlohmann::json nested = read_json_file(hf_tiny("glm5_next") + "/config.json");
  nlohmann::json flat = nested["text_config"];
  flat["model_type"] = "glm5_next";
  ModelSpec a = ModelSpec::from_json(nested), b = ModelSpec::from_json(flat);
  EXPECT_EQ(kinds(a), kinds(b));
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(state_bytes(a, 1000, 2), state_bytes(b, 1000, 2));
}

// The state formula: KV only on attention layers; KDA state fixed in context; pooled indexer keys.
TEST(ModelSpec, StateBytesByLayerKind) {
  ModelSpec s = spec_of("glm5_next");
  const auto specs = state_specs(s);
  ASSERT_EQ(specs.size(), 8u);
  EXPECT_TRUE(specs[0].recurrent);
  EXPECT_EQ(specs[0].bytes(10, 2), specs[0].bytes(100000, 2));  // KDA: flat in context
  // MLA layer 3: latent 32 per token + one pooled 16-dim key per 4 tokens (kv bytes), open pool fixed (fp32).
  EXPECT_EQ(specs[3].bytes(100, 2) - specs[3].bytes(0, 2), uint64_t(100 * 32 * 2 + 25 * 16 * 2));
  ModelSpec g = spec_of("glm4_moe");
  EXPECT_EQ(state_bytes(g, 10, 2), uint64_t(g.num_layers * 10 * 2 * g.num_kv_heads * g.head_dim * 2));
  // int8 caches (--kv-q8): one fp32 scale per token row of the MLA latent, of the GQA K and of the V cache.
  EXPECT_EQ(specs[3].bytes(100, 1) - specs[3].bytes(0, 1), uint64_t(100 * (32 + 4) + 25 * 16));
  EXPECT_EQ(state_bytes(g, 10, 1), uint64_t(g.num_layers * 10 * 2 * (g.num_kv_heads * g.head_dim + 4)));
  EXPECT_EQ(specs[0].bytes(10, 1), specs[0].bytes(10, 2));  // fixed state keeps its fp32
}

// The manifest names exactly the tensors the checkpoint holds (visual tensors aside).
TEST(ModelSpec, ManifestMatchesCheckpointTensors) {
  for (const char* m : {"deepseek_v3", "glm4_moe", "glm_moe_dsa", "glm5_next", "qwen3_next"}) {
    auto pkg = ModelPackage::open(hf_tiny(m));
    const std::string root = pkg->has("model.language_model.embed_tokens.weight") ? "model.language_model." : "model.";
    std::set<std::string> want, have;
    for (const TensorEntry& t : manifest(ModelSpec::from_json(pkg->config()), root))
      if (!t.optional || pkg->has(t.name)) want.insert(t.name);
    for (const std::string& n : pkg->names())
      if (n.rfind("model.visual.", 0) != 0 && (n.rfind("model.", 0) == 0 || n == "lm_head.weight")) have.insert(n);  // not reference_layers
    std::vector<std::string> only_want, only_have;
    std::set_difference(want.begin(), want.end(), have.begin(), have.end(), std::back_inserter(only_want));
    std::set_difference(have.begin(), have.end(), want.begin(), want.end(), std::back_inserter(only_have));
    EXPECT_TRUE(only_want.empty()) << m << ": manifest only: " << ::testing::PrintToString(only_want);
    EXPECT_TRUE(only_have.empty()) << m << ": checkpoint only: " << ::testing::PrintToString(only_have);
  }
}

// mixer_linears / indexer_linears (what the batch plan and the bench walk) name every matrix of a layer's mixer that
// the manifest lists (MLA's kv_b_proj aside: it runs absorbed), on every tiny model.
TEST(ModelSpec, MixerLinearsCoverTheManifestsMatrices) {
  for (const char* m : {"deepseek_v3", "glm4_moe", "glm_moe_dsa", "glm5_next", "qwen3_next"}) {
    auto pkg = ModelPackage::open(hf_tiny(m));
    auto w = ModelWeights::load(pkg, load_linear);
    std::vector<size_t> mixer(size_t(w->config.num_layers)), indexer(mixer.size());
    for (const TensorEntry& t : manifest(w->config, w->root)) {
      // (the k-pool gate is a 2-D parameter in the manifest that the loader reads as a linear)
      const bool gate = t.name.find("index_kpool_compress_gate") != std::string::npos;
      if ((t.role != TensorRole::Matrix && !gate) || t.layer < 0 || t.layer >= w->config.num_layers) continue;
      if (t.name.find("_attn.") == std::string::npos || t.name.find("kv_b_proj") != std::string::npos) continue;
      ++(t.name.find(".indexer.") != std::string::npos ? indexer : mixer)[size_t(t.layer)];
    }
    for (size_t l = 0; l < mixer.size(); ++l) {
      EXPECT_EQ(mixer_linears(w->layers[l]).size(), mixer[l]) << m << " layer " << l;
      EXPECT_EQ(indexer_linears(w->layers[l]).size(), indexer[l]) << m << " layer " << l;
    }
  }
}

TEST(ModelSpec, UnsupportedTypeNamesTheSupportedOnes) {
  try {
    ModelSpec::from_json(nlohmann::json{{"model_type", "llama"}});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model_type llama is not supported"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("glm5_next"), std::string::npos);
  }
}

// Corrupt sizes end in an error naming the field (fuzz_config found a 4e126 hidden_size converted to an integer
// with undefined behaviour, and zero frequencies dividing by zero); integral floats such as 2048.0 still read.
TEST(ModelSpec, CorruptSizesAreNamedErrors) {
  auto base = read_json_file(hf_tiny("glm_moe_dsa") + "/config.json");
  auto expect_error = [&](const char* key, const nlohmann::json& value, const std::string& needle) {
    auto j = base;
    j[key] = value;
    try {
      ModelSpec::from_json(j);
      ADD_FAILURE() << key << " = " << value.dump() << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error("hidden_size", 4.09644e126, "hidden_size");
  expect_error("hidden_size", 2.5, "not an integer");
  expect_error("num_hidden_layers", 1000000, "num_hidden_layers");
  expect_error("n_routed_experts", int64_t(1) << 40, "n_routed_experts");
  expect_error("kv_lora_rank", 1 << 20, "kv_lora_rank = 1048576 is outside");
  base.erase("mlp_layer_types");  // the layer kinds from first_k_dense_replace / moe_layer_freq
  expect_error("moe_layer_freq", 0, "moe_layer_freq");
  expect_error("rms_norm_eps", -1.0, "rms_norm_eps");
  auto j = base;
  j["hidden_size"] = double(base["hidden_size"].get<int64_t>());  // 256.0
  EXPECT_EQ(ModelSpec::from_json(j).hidden_size, base["hidden_size"].get<int64_t>());
}

}  // namespace
}  // namespace moesrv
