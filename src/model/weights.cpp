#include "model/weights.h"

#include <fmt/format.h>

#include "util/error.h"

namespace moesrv {

namespace {

NormWeights load_norm(const ModelPackage& pkg, const std::string& prefix, int64_t dim, bool with_bias = false) {
  NormWeights n;
  const TensorView& w = pkg.require(prefix + ".weight");
  if (w.numel() != dim) fail("{}: tensor {}.weight has {} elements, expected {}", pkg.dir(), prefix, w.numel(), dim);
  n.weight = w.to_f32();
  if (with_bias) n.bias = pkg.require(prefix + ".bias").to_f32();
  return n;
}

std::unique_ptr<Linear> linear(const ModelPackage& pkg, const std::string& prefix, int64_t in, int64_t out) {
  auto l = load_linear(pkg, prefix);
  if (l->in_features() != in || l->out_features() != out)
    fail("{}: {} is {}x{} (out x in), config expects {}x{}", pkg.dir(), prefix, l->out_features(), l->in_features(), out, in);
  return l;
}

MlpWeights load_mlp(const ModelPackage& pkg, const std::string& prefix, int64_t hidden, int64_t inter) {
  MlpWeights m;
  m.gate = linear(pkg, prefix + ".gate_proj", hidden, inter);
  m.up = linear(pkg, prefix + ".up_proj", hidden, inter);
  m.down = linear(pkg, prefix + ".down_proj", inter, hidden);
  return m;
}

MlaWeights load_mla(const ModelPackage& pkg, const ModelConfig& c, const std::string& p, int64_t layer) {
  MlaWeights a;
  int64_t H = c.num_heads, qk = c.qk_head_dim(), r = c.kv_lora_rank, dn = c.qk_nope_dim, dv = c.v_head_dim;
  if (c.q_lora_rank > 0) {
    a.q_a = linear(pkg, p + ".q_a_proj", c.hidden_size, c.q_lora_rank);
    a.q_a_norm = load_norm(pkg, p + ".q_a_layernorm", c.q_lora_rank);
    a.q_b = linear(pkg, p + ".q_b_proj", c.q_lora_rank, H * qk);
  } else {
    a.q = linear(pkg, p + ".q_proj", c.hidden_size, H * qk);
  }
  a.kv_a = linear(pkg, p + ".kv_a_proj_with_mqa", c.hidden_size, r + c.qk_rope_dim);
  a.kv_a_norm = load_norm(pkg, p + ".kv_a_layernorm", r);
  a.kv_b = linear(pkg, p + ".kv_b_proj", r, H * (dn + dv));
  a.o = linear(pkg, p + ".o_proj", H * dv, c.hidden_size);
  std::vector<float> kvb(size_t(H * (dn + dv) * r));
  a.kv_b->dequant_rows(0, H * (dn + dv), kvb.data());
  a.w_uk.resize(size_t(H * dn * r));
  a.w_uv.resize(size_t(H * dv * r));
  for (int64_t h = 0; h < H; ++h) {
    const float* base = kvb.data() + h * (dn + dv) * r;
    std::copy(base, base + dn * r, a.w_uk.begin() + h * dn * r);
    std::copy(base + dn * r, base + (dn + dv) * r, a.w_uv.begin() + h * dv * r);
  }
  if (c.dsa && c.layer_has_indexer[size_t(layer)]) {
    if (c.q_lora_rank == 0) fail("config.json: DSA indexer needs q_lora_rank");
    IndexerWeights ix;
    std::string ip = p + ".indexer";
    ix.wq_b = linear(pkg, ip + ".wq_b", c.q_lora_rank, c.index_n_heads * c.index_head_dim);
    ix.wk = linear(pkg, ip + ".wk", c.hidden_size, c.index_head_dim);
    ix.weights_proj = linear(pkg, ip + ".weights_proj", c.hidden_size, c.index_n_heads);
    ix.k_norm = load_norm(pkg, ip + ".k_norm", c.index_head_dim, true);
    a.indexer = std::move(ix);
  }
  return a;
}

GqaWeights load_gqa(const ModelPackage& pkg, const ModelConfig& c, const std::string& p) {
  GqaWeights g;
  int64_t hd = c.head_dim;
  g.q = linear(pkg, p + ".q_proj", c.hidden_size, c.num_heads * hd);
  g.k = linear(pkg, p + ".k_proj", c.hidden_size, c.num_kv_heads * hd);
  g.v = linear(pkg, p + ".v_proj", c.hidden_size, c.num_kv_heads * hd);
  g.o = linear(pkg, p + ".o_proj", c.num_heads * hd, c.hidden_size);
  if (c.attention_bias)
    for (auto* l : {g.q.get(), g.k.get(), g.v.get()})
      if (l->bias().empty()) fail("{}: attention_bias is set but a q/k/v bias is missing in {}", pkg.dir(), p);
  if (c.qk_norm) {
    g.q_norm = load_norm(pkg, p + ".q_norm", hd);
    g.k_norm = load_norm(pkg, p + ".k_norm", hd);
  }
  return g;
}

MoeWeights load_moe(const ModelPackage& pkg, const ModelConfig& c, const std::string& p) {
  MoeWeights m;
  const TensorView& gate = pkg.require(p + ".gate.weight");
  if (gate.numel() != c.n_routed_experts * c.hidden_size)
    fail("{}: {}.gate.weight is {}, expected [{}, {}]", pkg.dir(), p, gate.shape_str(), c.n_routed_experts, c.hidden_size);
  m.router = gate.to_f32();
  if (const TensorView* b = pkg.find(p + ".gate.e_score_correction_bias")) m.router_bias = b->to_f32();
  else m.router_bias.assign(size_t(c.n_routed_experts), 0.0f);
  for (int64_t e = 0; e < c.n_routed_experts; ++e)
    m.experts.push_back(load_mlp(pkg, fmt::format("{}.experts.{}", p, e), c.hidden_size, c.moe_intermediate_size));
  if (c.n_shared_experts > 0)
    m.shared = load_mlp(pkg, p + ".shared_experts", c.hidden_size, c.moe_intermediate_size * c.n_shared_experts);
  return m;
}

}  // namespace

std::unique_ptr<ModelWeights> ModelWeights::load(std::shared_ptr<ModelPackage> pkg) {
  auto w = std::make_unique<ModelWeights>();
  w->package = pkg;
  w->config = ModelConfig::from_json(pkg->config());
  const ModelConfig& c = w->config;
  w->embed = &pkg->require("model.embed_tokens.weight");
  if (w->embed->numel() != c.vocab_size * c.hidden_size)
    fail("{}: model.embed_tokens.weight is {}, expected [{}, {}]", pkg->dir(), w->embed->shape_str(), c.vocab_size, c.hidden_size);
  w->final_norm = load_norm(*pkg, "model.norm", c.hidden_size);
  if (pkg->has("lm_head.weight") || pkg->has("lm_head.trellis"))
    w->lm_head = linear(*pkg, "lm_head", c.hidden_size, c.vocab_size);
  else if (c.tie_embeddings)
    w->lm_head = std::make_unique<DenseLinear>(*w->embed, nullptr, nullptr);
  else
    pkg->require("lm_head.weight");
  for (int64_t i = 0; i < c.num_layers; ++i) {
    std::string p = fmt::format("model.layers.{}", i);
    LayerWeights L;
    L.input_norm = load_norm(*pkg, p + ".input_layernorm", c.hidden_size);
    L.post_attention_norm = load_norm(*pkg, p + ".post_attention_layernorm", c.hidden_size);
    if (c.attention == AttentionKind::MLA) L.mla = load_mla(*pkg, c, p + ".self_attn", i);
    else L.gqa = load_gqa(*pkg, c, p + ".self_attn");
    if (c.layer_is_moe[size_t(i)]) L.moe = load_moe(*pkg, c, p + ".mlp");
    else L.mlp = load_mlp(*pkg, p + ".mlp", c.hidden_size, c.intermediate_size);
    w->layers.push_back(std::move(L));
  }
  return w;
}

}  // namespace moesrv
