#include "runtime/synthetic_model.h"

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "model/config.h"
#include "util/numeric.h"
#include "util/thread_pool.h"

namespace moesrv {

using json = nlohmann::json;

json glm5_config(int64_t layers, int64_t vocab) {
  return json{{"model_type", "glm_moe_dsa"}, {"vocab_size", vocab}, {"hidden_size", 6144},
              {"num_hidden_layers", layers}, {"max_position_embeddings", 202752}, {"num_attention_heads", 64},
              {"num_key_value_heads", 64}, {"q_lora_rank", 2048}, {"kv_lora_rank", 512}, {"qk_rope_head_dim", 64},
              {"qk_nope_head_dim", 192}, {"v_head_dim", 256}, {"index_n_heads", 32}, {"index_head_dim", 128},
              {"index_topk", 2048}, {"intermediate_size", 12288}, {"moe_intermediate_size", 2048},
              {"n_routed_experts", 256}, {"num_experts_per_tok", 8}, {"n_shared_experts", 1}, {"n_group", 1},
              {"topk_group", 1}, {"first_k_dense_replace", 0}, {"routed_scaling_factor", 2.5},
              {"norm_topk_prob", true}, {"rms_norm_eps", 1e-5}, {"rope_theta", 1000000.0}};
}

json tiny_moe_config(int64_t layers) {
  json j = glm5_config(layers, 512);
  j.update(json{{"hidden_size", 256}, {"num_attention_heads", 4}, {"num_key_value_heads", 4}, {"q_lora_rank", 64},
                {"kv_lora_rank", 32}, {"qk_rope_head_dim", 16}, {"qk_nope_head_dim", 32}, {"v_head_dim", 32},
                {"index_n_heads", 4}, {"index_head_dim", 32}, {"index_topk", 64}, {"intermediate_size", 512},
                {"moe_intermediate_size", 64}, {"n_routed_experts", 32}, {"num_experts_per_tok", 4},
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
    if (fill == Fill::Random) fill_random(buf.data(), n, opt_.seed * 0x2545f4914f6cdd1dull ^ std::hash<std::string>{}(name), opt_.stddev);
    else std::fill(buf.begin(), buf.end(), fill == Fill::Ones ? f32_to_bf16(1.0f) : uint16_t(0));
    alias(name, std::move(shape), buf.data());
    return buf.data();
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

void add_mlp(Builder& b, const std::string& p, int64_t hidden, int64_t inter) {
  b.add(p + ".gate_proj.weight", {inter, hidden});
  b.add(p + ".up_proj.weight", {inter, hidden});
  b.add(p + ".down_proj.weight", {hidden, inter});
}

}  // namespace

std::shared_ptr<ModelPackage> make_synthetic_model(const json& config, const SyntheticOptions& opt) {
  const ModelConfig c = ModelConfig::from_json(config);
  const int64_t D = c.hidden_size, H = c.num_heads;
  Builder b(opt);
  b.add("model.embed_tokens.weight", {c.vocab_size, D});
  b.add("model.norm.weight", {D}, Fill::Ones);
  if (!c.tie_embeddings) b.add("lm_head.weight", {c.vocab_size, D});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}", l), a = p + ".self_attn", m = p + ".mlp";
    b.add(p + ".input_layernorm.weight", {D}, Fill::Ones);
    b.add(p + ".post_attention_layernorm.weight", {D}, Fill::Ones);
    if (c.attention == AttentionKind::MLA) {
      if (c.q_lora_rank > 0) {
        b.add(a + ".q_a_proj.weight", {c.q_lora_rank, D});
        b.add(a + ".q_a_layernorm.weight", {c.q_lora_rank}, Fill::Ones);
        b.add(a + ".q_b_proj.weight", {H * c.qk_head_dim(), c.q_lora_rank});
      } else {
        b.add(a + ".q_proj.weight", {H * c.qk_head_dim(), D});
      }
      b.add(a + ".kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_dim, D});
      b.add(a + ".kv_a_layernorm.weight", {c.kv_lora_rank}, Fill::Ones);
      b.add(a + ".kv_b_proj.weight", {H * (c.qk_nope_dim + c.v_head_dim), c.kv_lora_rank});
      b.add(a + ".o_proj.weight", {D, H * c.v_head_dim});
      if (c.dsa && c.layer_has_indexer[size_t(l)]) {
        const std::string ix = a + ".indexer";
        b.add(ix + ".wq_b.weight", {c.index_n_heads * c.index_head_dim, c.q_lora_rank});
        b.add(ix + ".wk.weight", {c.index_head_dim, D});
        b.add(ix + ".weights_proj.weight", {c.index_n_heads, D});
        b.add(ix + ".k_norm.weight", {c.index_head_dim}, Fill::Ones);
        b.add(ix + ".k_norm.bias", {c.index_head_dim}, Fill::Zeros);
      }
    } else {
      const int64_t hd = c.head_dim;
      b.add(a + ".q_proj.weight", {H * hd, D});
      b.add(a + ".k_proj.weight", {c.num_kv_heads * hd, D});
      b.add(a + ".v_proj.weight", {c.num_kv_heads * hd, D});
      b.add(a + ".o_proj.weight", {D, H * hd});
    }
    if (!c.layer_is_moe[size_t(l)]) {
      add_mlp(b, m, D, c.intermediate_size);
      continue;
    }
    const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size;
    b.add(m + ".gate.weight", {E, D});
    b.add(m + ".gate.e_score_correction_bias", {E}, Fill::Zeros);
    const int64_t distinct = opt.distinct_experts > 0 ? std::min(opt.distinct_experts, E) : E;
    std::vector<const uint16_t*> owned;  // [distinct][gate, up, down]
    for (int64_t e = 0; e < E; ++e) {
      const std::string ep = fmt::format("{}.experts.{}", m, e);
      if (e < distinct) {
        owned.push_back(b.add(ep + ".gate_proj.weight", {I, D}));
        owned.push_back(b.add(ep + ".up_proj.weight", {I, D}));
        owned.push_back(b.add(ep + ".down_proj.weight", {D, I}));
      } else {
        const size_t k = size_t(e % distinct) * 3;
        b.alias(ep + ".gate_proj.weight", {I, D}, owned[k]);
        b.alias(ep + ".up_proj.weight", {I, D}, owned[k + 1]);
        b.alias(ep + ".down_proj.weight", {D, I}, owned[k + 2]);
      }
    }
    if (c.n_shared_experts > 0) add_mlp(b, m + ".shared_experts", D, I * c.n_shared_experts);
  }
  return b.finish(config);
}

}  // namespace moesrv
