#include "model/synthetic_model.h"

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "model/config.h"
#include "model/manifest.h"
#include "util/numeric.h"
#include "util/thread_pool.h"

namespace moesrv {

using json = nlohmann::json;

json glm5_config(int64_t layers, int64_t vocab) {
  return json{{"model_type", "glm_moe_dsa"},
              {"vocab_size", vocab},
              {"hidden_size", 6144},
              {"num_hidden_layers", layers},
              {"max_position_embeddings", 202752},
              {"num_attention_heads", 64},
              {"num_key_value_heads", 64},
              {"q_lora_rank", 2048},
              {"kv_lora_rank", 512},
              {"qk_rope_head_dim", 64},
              {"qk_nope_head_dim", 192},
              {"v_head_dim", 256},
              {"index_n_heads", 32},
              {"index_head_dim", 128},
              {"index_topk", 2048},
              {"intermediate_size", 12288},
              {"moe_intermediate_size", 2048},
              {"n_routed_experts", 256},
              {"num_experts_per_tok", 8},
              {"n_shared_experts", 1},
              {"n_group", 1},
              {"topk_group", 1},
              {"first_k_dense_replace", 0},
              {"routed_scaling_factor", 2.5},
              {"norm_topk_prob", true},
              {"rms_norm_eps", 1e-5},
              {"rope_theta", 1000000.0}};
}

json tiny_moe_config(int64_t layers) {
  json j = glm5_config(layers, 512);
  j.update(json{{"hidden_size", 256},
                {"num_attention_heads", 4},
                {"num_key_value_heads", 4},
                {"q_lora_rank", 64},
                {"kv_lora_rank", 32},
                {"qk_rope_head_dim", 16},
                {"qk_nope_head_dim", 32},
                {"v_head_dim", 32},
                {"index_n_heads", 4},
                {"index_head_dim", 32},
                {"index_topk", 64},
                {"intermediate_size", 512},
                {"moe_intermediate_size", 64},
                {"n_routed_experts", 32},
                {"num_experts_per_tok", 4},
                {"max_position_embeddings", 8192}});
  return j;
}

json glm5_next_config(int64_t layers, int64_t vocab) {
  std::vector<std::string> types, mlp, indexer;
  for (int64_t i = 0; i < layers; ++i) {  // the published pattern: every 4th layer MLA (i % 4 == 3), all MoE
    types.push_back(i % 4 == 3 ? "deepseek_sparse_attention" : "linear_attention");
    mlp.push_back("sparse");
    indexer.push_back("full");
  }
  return json{{"model_type", "glm5_next"},
              {"vocab_size", vocab},
              {"hidden_size", 4096},
              {"num_hidden_layers", layers},
              {"max_position_embeddings", 262144},
              {"num_attention_heads", 64},
              {"num_key_value_heads", 64},
              {"rms_norm_eps", 1e-6},
              {"intermediate_size", 12288},
              {"q_lora_rank", 1536},
              {"kv_lora_rank", 512},
              {"qk_nope_head_dim", 256},
              {"qk_rope_head_dim", 0},
              {"v_head_dim", 256},
              {"moe_intermediate_size", 2048},
              {"n_routed_experts", 288},
              {"n_shared_experts", 1},
              {"num_experts_per_tok", 8},
              {"n_group", 1},
              {"topk_group", 1},
              {"norm_topk_prob", true},
              {"routed_scaling_factor", 2.5},
              {"swiglu_limit", 10.0},
              {"linear_num_heads", 64},
              {"linear_head_dim", 128},
              {"linear_conv_kernel_dim", 4},
              {"linear_lower_bound", -5.0},
              {"hc_mult", 4},
              {"hc_sinkhorn_iters", 20},
              {"hc_eps", 1e-6},
              {"index_n_heads", 32},
              {"index_head_dim", 128},
              {"index_topk", 2048},
              {"index_kpool", 4},
              {"index_kpool_always_select_tail", true},
              {"layer_types", types},
              {"mlp_layer_types", mlp},
              {"indexer_types", indexer},
              {"tie_word_embeddings", false}};
}

json tiny_glm5_next_config(int64_t layers) {
  json j = glm5_next_config(layers, 512);
  j.update(json{{"hidden_size", 64},
                {"num_attention_heads", 4},
                {"num_key_value_heads", 4},
                {"q_lora_rank", 32},
                {"kv_lora_rank", 16},
                {"qk_nope_head_dim", 16},
                {"v_head_dim", 16},
                {"intermediate_size", 128},
                {"moe_intermediate_size", 16},
                {"n_routed_experts", 16},
                {"num_experts_per_tok", 4},
                {"linear_num_heads", 4},
                {"linear_head_dim", 16},
                {"index_n_heads", 8},
                {"index_head_dim", 16},
                {"index_topk", 16},
                {"max_position_embeddings", 8192}});
  return j;
}

namespace {

enum class Fill { Random, Ones, Zeros };

struct Storage {
  std::vector<std::vector<uint16_t>> buffers;  // bf16
};

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// ~N(0, stddev): Irwin-Hall sum of four 16-bit uniforms, rescaled to unit variance. Deterministic per (seed, key).
void fill_random(uint16_t* dst, int64_t n, uint64_t key, float stddev) {
  constexpr int64_t kChunk = 1 << 18;
  const float scale = stddev * std::sqrt(3.0f) / 65536.0f;
  ThreadPool::global().parallel_for((n + kChunk - 1) / kChunk, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      uint64_t s = key ^ (uint64_t(c) * 0xd1b54a32d192ed03ull);
      for (int64_t i = c * kChunk, end = std::min(n, (c + 1) * kChunk); i < end; ++i) {
        uint64_t r = splitmix(s);
        float sum = float((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48)) - 131070.0f;
        dst[i] = f32_to_bf16(sum * scale);
      }
    }
  });
}

class Builder {
 public:
  Builder(const SyntheticOptions& opt) : opt_(opt), storage_(std::make_shared<Storage>()) {}

  // A new tensor with its own bytes.
  const uint16_t* add(const std::string& name, std::vector<int64_t> shape, Fill fill = Fill::Random) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    auto& buf = storage_->buffers.emplace_back(size_t(n));
    if (fill == Fill::Random)
      fill_random(buf.data(), n, opt_.seed * 0x2545f4914f6cdd1dull ^ std::hash<std::string>{}(name), opt_.stddev);
    else std::fill(buf.begin(), buf.end(), fill == Fill::Ones ? f32_to_bf16(1.0f) : uint16_t(0));
    alias(name, std::move(shape), buf.data());
    return buf.data();
  }
  // A tensor with the given values (rounded to bf16).
  void add_values(const std::string& name, const std::vector<float>& values) {
    auto& buf = storage_->buffers.emplace_back(values.size());
    for (size_t i = 0; i < values.size(); ++i) buf[i] = f32_to_bf16(values[i]);
    alias(name, {int64_t(values.size())}, buf.data());
  }
  // A tensor over bytes another tensor owns.
  void alias(const std::string& name, std::vector<int64_t> shape, const uint16_t* data) {
    TensorView t;
    t.name = name;
    t.dtype = DType::BF16;
    t.shape = std::move(shape);
    t.data = reinterpret_cast<const uint8_t*>(data);
    t.nbytes = size_t(t.numel()) * 2;
    views_.push_back(std::move(t));
  }
  std::shared_ptr<ModelPackage> finish(const json& config) {
    return ModelPackage::from_memory(config, std::move(views_), storage_, "<synthetic>");
  }

 private:
  SyntheticOptions opt_;
  std::shared_ptr<Storage> storage_;
  std::vector<TensorView> views_;
};

// -skew * ln(1 + rank) with the experts ranked in a random order of their own per layer.
std::vector<float> skewed_router_bias(int64_t experts, int64_t layer, double skew, uint64_t seed) {
  std::vector<int64_t> rank(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) rank[size_t(e)] = e;
  uint64_t s = seed ^ (uint64_t(layer + 1) * 0x9e3779b97f4a7c15ull);
  for (int64_t i = experts - 1; i > 0; --i) std::swap(rank[size_t(i)], rank[size_t(splitmix(s) % uint64_t(i + 1))]);
  std::vector<float> bias(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) bias[size_t(e)] = float(-skew * std::log1p(double(rank[size_t(e)])));
  return bias;
}

}  // namespace

std::shared_ptr<ModelPackage> make_synthetic_model(const json& config, const SyntheticOptions& opt) {
  const ModelSpec c = ModelSpec::from_json(config);
  const std::string root = config.contains("text_config") ? "model.language_model." : "model.";
  Builder b(opt);
  // Experts beyond `distinct` alias the weights of expert e % distinct (each keeps its own name and identity).
  const int64_t distinct =
      opt.distinct_experts > 0 ? std::min(opt.distinct_experts, c.n_routed_experts) : c.n_routed_experts;
  std::map<std::tuple<int64_t, int64_t, std::string>, const uint16_t*> owned;  // (layer, expert, matrix) -> data
  for (const TensorEntry& t : manifest(c, root)) {
    const Fill fill = t.init == TensorInit::Ones    ? Fill::Ones
                      : t.init == TensorInit::Zeros ? Fill::Zeros
                                                    : Fill::Random;
    if (opt.router_skew > 0 && t.name.ends_with(".gate.e_score_correction_bias")) {
      b.add_values(t.name, skewed_router_bias(c.n_routed_experts, t.layer, opt.router_skew, opt.seed));
      continue;
    }
    if (t.role != TensorRole::Expert) {
      b.add(t.name, t.shape, fill);
      continue;
    }
    const std::string leaf = t.name.substr(t.name.rfind('.', t.name.size() - 8));  // ".gate_proj.weight"
    if (t.expert < distinct) owned[{t.layer, t.expert, leaf}] = b.add(t.name, t.shape, fill);
    else b.alias(t.name, t.shape, owned.at({t.layer, t.expert % distinct, leaf}));
  }
  return b.finish(config);
}

}  // namespace moesrv
