#include "model/weights.h"

#include <fmt/format.h>

#include <initializer_list>

#include "model/manifest.h"
#include "util/error.h"

namespace moesrv {

namespace {

std::vector<float> load_f32(const ModelPackage& pkg, const std::string& name, int64_t numel) {
  const TensorView& t = pkg.require(name);
  if (t.numel() != numel) fail("{}: tensor {} is {}, expected {} elements", pkg.dir(), name, t.shape_str(), numel);
  return t.to_f32();
}

// `offset` is added to the weight (zero-centred RMSNorm weights scale by 1 + w).
NormWeights load_norm(const ModelPackage& pkg, const std::string& prefix, int64_t dim, bool with_bias = false,
                      double offset = 0) {
  NormWeights n;
  n.weight = load_f32(pkg, prefix + ".weight", dim);
  for (float& w : n.weight) w += float(offset);
  if (with_bias) n.bias = load_f32(pkg, prefix + ".bias", dim);
  return n;
}

std::unique_ptr<Linear> linear(const LinearLoader& make, const ModelPackage& pkg, const std::string& prefix, int64_t in,
                               int64_t out) {
  auto l = make(pkg, prefix);
  if (l->in_features() != in || l->out_features() != out)
    fail("{}: {} is {}x{} (out x in), config expects {}x{}", pkg.dir(), prefix, l->out_features(), l->in_features(), out, in);
  return l;
}

MlpWeights load_mlp(const LinearLoader& make, const ModelPackage& pkg, const std::string& prefix, int64_t hidden,
                    int64_t inter, double limit) {
  MlpWeights m;
  m.limit = float(limit);
  m.gate = linear(make, pkg, prefix + ".gate_proj", hidden, inter);
  m.up = linear(make, pkg, prefix + ".up_proj", hidden, inter);
  m.down = linear(make, pkg, prefix + ".down_proj", inter, hidden);
  return m;
}

MlaWeights load_mla(const LinearLoader& make, const ModelPackage& pkg, const ModelSpec& c, const std::string& p,
                    const LayerSpec& spec) {
  MlaWeights a;
  int64_t H = c.num_heads, qk = c.qk_head_dim(), r = c.kv_lora_rank, dn = c.qk_nope_dim, dv = c.v_head_dim;
  if (c.q_lora_rank > 0) {
    a.q_a = linear(make, pkg, p + ".q_a_proj", c.hidden_size, c.q_lora_rank);
    a.q_a_norm = load_norm(pkg, p + ".q_a_layernorm", c.q_lora_rank);
    a.q_b = linear(make, pkg, p + ".q_b_proj", c.q_lora_rank, H * qk);
  } else {
    a.q = linear(make, pkg, p + ".q_proj", c.hidden_size, H * qk);
  }
  a.kv_a = linear(make, pkg, p + ".kv_a_proj_with_mqa", c.hidden_size, r + c.qk_rope_dim);
  a.kv_a_norm = load_norm(pkg, p + ".kv_a_layernorm", r);
  a.kv_b = linear(make, pkg, p + ".kv_b_proj", r, H * (dn + dv));
  a.o = linear(make, pkg, p + ".o_proj", H * dv, c.hidden_size);
  std::vector<float> kvb(size_t(H * (dn + dv) * r));
  a.kv_b->dequant_rows(0, H * (dn + dv), kvb.data());
  a.w_uk.resize(size_t(H * dn * r));
  a.w_uv.resize(size_t(H * dv * r));
  for (int64_t h = 0; h < H; ++h) {
    const float* base = kvb.data() + h * (dn + dv) * r;
    std::copy(base, base + dn * r, a.w_uk.begin() + h * dn * r);
    std::copy(base + dn * r, base + (dn + dv) * r, a.w_uv.begin() + h * dv * r);
  }
  if (spec.indexer == IndexerKind::Own) {
    IndexerWeights ix;
    std::string ip = p + ".indexer";
    ix.wq_b = linear(make, pkg, ip + ".wq_b", c.q_lora_rank, c.index_n_heads * c.index_head_dim);
    ix.wk = linear(make, pkg, ip + ".wk", c.hidden_size, c.index_head_dim);
    ix.weights_proj = linear(make, pkg, ip + ".weights_proj", c.hidden_size, c.index_n_heads);
    ix.k_norm = load_norm(pkg, ip + ".k_norm", c.index_head_dim, true);
    if (c.index_kpool > 1) {
      pkg.require(ip + ".index_kpool_compress_gate");  // a bare matrix (no .weight suffix), kept unquantized
      ix.pool_gate = linear(make, pkg, ip + ".index_kpool_compress_gate", c.hidden_size, c.index_head_dim);
      ix.pool_ape = load_f32(pkg, ip + ".index_kpool_compress_ape", c.index_kpool * c.index_head_dim);
    }
    a.indexer = std::move(ix);
  }
  return a;
}

GqaWeights load_gqa(const LinearLoader& make, const ModelPackage& pkg, const ModelSpec& c, const std::string& p) {
  GqaWeights g;
  int64_t hd = c.head_dim;
  g.q = linear(make, pkg, p + ".q_proj", c.hidden_size, c.num_heads * hd * (c.attn_output_gate ? 2 : 1));
  g.k = linear(make, pkg, p + ".k_proj", c.hidden_size, c.num_kv_heads * hd);
  g.v = linear(make, pkg, p + ".v_proj", c.hidden_size, c.num_kv_heads * hd);
  g.o = linear(make, pkg, p + ".o_proj", c.num_heads * hd, c.hidden_size);
  if (c.attention_bias)
    for (auto* l : {g.q.get(), g.k.get(), g.v.get()})
      if (l->bias().empty()) fail("{}: attention_bias is set but a q/k/v bias is missing in {}", pkg.dir(), p);
  if (c.qk_norm) {
    g.q_norm = load_norm(pkg, p + ".q_norm", hd, false, c.norm_weight_offset);
    g.k_norm = load_norm(pkg, p + ".k_norm", hd, false, c.norm_weight_offset);
  }
  return g;
}

MoeWeights load_moe(const LinearLoader& make, const ModelPackage& pkg, const ModelSpec& c, const std::string& p) {
  MoeWeights m;
  const TensorView& gate = pkg.require(p + ".gate.weight");
  if (gate.numel() != c.n_routed_experts * c.hidden_size)
    fail("{}: {}.gate.weight is {}, expected [{}, {}]", pkg.dir(), p, gate.shape_str(), c.n_routed_experts, c.hidden_size);
  m.router = gate.to_f32();
  const double lim = c.swiglu_limit;
  if (const TensorView* b = pkg.find(p + ".gate.e_score_correction_bias")) m.router_bias = b->to_f32();
  else m.router_bias.assign(size_t(c.n_routed_experts), 0.0f);
  for (int64_t e = 0; e < c.n_routed_experts; ++e)
    m.experts.push_back(
        load_mlp(make, pkg, fmt::format("{}.experts.{}", p, e), c.hidden_size, c.moe_intermediate_size, lim));
  if (c.n_shared_experts > 0) {
    const std::string sp = pkg.has(p + ".shared_expert.gate_proj.weight") || pkg.has(p + ".shared_expert.gate_proj.trellis")
                               ? p + ".shared_expert" : p + ".shared_experts";
    m.shared = load_mlp(make, pkg, sp, c.hidden_size, c.shared_intermediate_size, lim);
  }
  if (c.shared_expert_gate) m.shared_gate = load_f32(pkg, p + ".shared_expert_gate.weight", c.hidden_size);
  return m;
}

// A depthwise conv weight [C, 1, K] as [C, K] fp32; KDA stores q/k/v convs apart or as one conv1d.
std::vector<float> load_conv(const ModelPackage& pkg, const std::string& p, const std::vector<std::string>& parts,
                             int64_t channels, int64_t kernel) {
  if (pkg.has(p + ".conv1d.weight")) return load_f32(pkg, p + ".conv1d.weight", channels * kernel);
  std::vector<float> w;
  for (const std::string& part : parts) {
    auto x = load_f32(pkg, p + "." + part + "_conv1d.weight", channels / int64_t(parts.size()) * kernel);
    w.insert(w.end(), x.begin(), x.end());
  }
  return w;
}

KdaWeights load_kda(const LinearLoader& make, const ModelPackage& pkg, const ModelSpec& c, const std::string& p) {
  const LinearAttnDims& la = c.linear;
  const int64_t D = c.hidden_size, H = la.v_heads, d = la.dk, Hd = H * d;
  KdaWeights w;
  w.q = linear(make, pkg, p + ".q_proj", D, Hd);
  w.k = linear(make, pkg, p + ".k_proj", D, Hd);
  w.v = linear(make, pkg, p + ".v_proj", D, Hd);
  w.conv = load_conv(pkg, p, {"q", "k", "v"}, 3 * Hd, la.conv_kernel);
  w.f_a = linear(make, pkg, p + ".f_a_proj", D, d);
  w.f_b = linear(make, pkg, p + ".f_b_proj", d, Hd);
  w.dt_bias = load_f32(pkg, p + ".dt_bias", Hd);
  w.a_log = load_f32(pkg, p + ".A_log", H);
  w.b = linear(make, pkg, p + ".b_proj", D, H);
  w.g_a = linear(make, pkg, p + ".g_a_proj", D, d);
  w.g_b = linear(make, pkg, p + ".g_b_proj", d, Hd);
  w.o_norm = load_norm(pkg, p + ".o_norm", d);
  w.o = linear(make, pkg, p + ".o_proj", Hd, D);
  return w;
}

GatedDeltaWeights load_gated_delta(const LinearLoader& make, const ModelPackage& pkg, const ModelSpec& c,
                                   const std::string& p) {
  const LinearAttnDims& la = c.linear;
  const int64_t D = c.hidden_size;
  GatedDeltaWeights w;
  w.qkvz = linear(make, pkg, p + ".in_proj_qkvz", D, 2 * la.k_heads * la.dk + 2 * la.v_heads * la.dv);
  w.ba = linear(make, pkg, p + ".in_proj_ba", D, 2 * la.v_heads);
  w.conv = load_conv(pkg, p, {}, la.conv_channels(), la.conv_kernel);
  w.dt_bias = load_f32(pkg, p + ".dt_bias", la.v_heads);
  w.a_log = load_f32(pkg, p + ".A_log", la.v_heads);
  w.norm = load_norm(pkg, p + ".norm", la.dv);
  w.out = linear(make, pkg, p + ".out_proj", la.v_heads * la.dv, D);
  return w;
}

HyperWeights load_hyper(const ModelPackage& pkg, const ModelSpec& c, const std::string& p) {
  const int64_t hc = c.residual.streams, mix = (2 + hc) * hc;
  return {load_f32(pkg, p + "_fn", mix * hc * c.hidden_size), load_f32(pkg, p + "_base", mix), load_f32(pkg, p + "_scale", 3)};
}

LayerWeights load_layer(const LinearLoader& make, const ModelPackage& pkg, const ModelSpec& c, const LayerSpec& spec,
                        const std::string& p, bool hyper) {
  LayerWeights L;
  L.input_norm = load_norm(pkg, p + ".input_layernorm", c.hidden_size, false, c.norm_weight_offset);
  L.post_attention_norm = load_norm(pkg, p + ".post_attention_layernorm", c.hidden_size, false, c.norm_weight_offset);
  switch (spec.mixer) {
    case Mixer::Mla: L.mla = load_mla(make, pkg, c, p + ".self_attn", spec); break;
    case Mixer::Gqa: L.gqa = load_gqa(make, pkg, c, p + ".self_attn"); break;
    case Mixer::Kda: L.kda = load_kda(make, pkg, c, p + ".self_attn"); break;
    case Mixer::GatedDelta: L.gated_delta = load_gated_delta(make, pkg, c, p + ".linear_attn"); break;
  }
  if (spec.ffn == FfnKind::Moe) L.moe = load_moe(make, pkg, c, p + ".mlp");
  else L.mlp = load_mlp(make, pkg, p + ".mlp", c.hidden_size, c.intermediate_size, c.swiglu_limit);
  if (hyper) {
    L.attn_hc = load_hyper(pkg, c, p + ".hc_attn");
    L.ffn_hc = load_hyper(pkg, c, p + ".hc_ffn");
  }
  return L;
}

// `p` ends with "layers.<num_layers>.". The block's layer never has mHC weights (GLM-5.3-Flash ships none).
std::unique_ptr<MtpWeights> load_mtp(const LinearLoader& make, const ModelPackage& pkg, const ModelSpec& c,
                                     const std::string& p) {
  const int64_t D = c.hidden_size;
  auto m = std::make_unique<MtpWeights>();
  m->enorm = load_norm(pkg, p + "enorm", D, false, c.norm_weight_offset);
  m->hnorm = load_norm(pkg, p + "hnorm", D, false, c.norm_weight_offset);
  m->head_norm = load_norm(pkg, p + "shared_head.norm", D, false, c.norm_weight_offset);
  m->eh_proj = linear(make, pkg, p + "eh_proj", 2 * D, D);
  if (pkg.has(p + "shared_head.head.weight") || pkg.has(p + "shared_head.head.trellis"))
    m->head = linear(make, pkg, p + "shared_head.head", D, c.vocab_size);
  m->layer = load_layer(make, pkg, c, c.mtp_layer, p.substr(0, p.size() - 1), false);
  return m;
}

// One name per line, at most 24 (then a count of the rest).
std::string name_list(const std::vector<std::string>& names) {
  std::string list;
  for (size_t i = 0; i < names.size() && i < 24; ++i) list += "\n  " + names[i];
  if (names.size() > 24) list += fmt::format("\n  ... and {} more", names.size() - 24);
  return list;
}

// Tensors the model needs that a shard holds but the index omits (e.g. the k-pool tensors of the upstream
// GLM-5.3-Flash package): refuse with all their names rather than the first one.
void refuse_unindexed(const ModelPackage& pkg, const std::string& root) {
  std::vector<std::string> missing;
  for (const auto& [name, shard] : pkg.unindexed())
    if (name.rfind(root + "layers.", 0) == 0 || name.rfind(root + "embed", 0) == 0 || name.rfind("lm_head", 0) == 0)
      missing.push_back(name + " (in " + shard + ")");
  if (missing.empty()) return;
  fail("{}: {} tensor(s) the model needs are in a shard but missing from model.safetensors.index.json; run "
       "`moesrv repair-index --model {}`:{}", pkg.dir(), missing.size(), pkg.dir(), name_list(missing));
}

// Every tensor of the manifest must be present (a matrix as .weight or EXL3 .trellis; KDA's q/k/v convs apart or
// merged): a layer with missing tensors is refused with all their names.
void refuse_missing(const ModelPackage& pkg, const ModelSpec& c, const std::string& root) {
  std::vector<std::string> missing;
  for (const TensorEntry& t : manifest(c, root)) {
    if (t.optional || pkg.has(t.name)) continue;
    const std::string base = t.name.size() > 7 ? t.name.substr(0, t.name.size() - 7) : t.name;  // minus ".weight"
    if (t.quantizable() && pkg.has(base + ".trellis")) continue;
    const size_t conv = t.name.find("_conv1d.weight");
    if (conv != std::string::npos && pkg.has(t.name.substr(0, conv - 1) + "conv1d.weight")) continue;
    missing.push_back(t.layer >= 0 ? fmt::format("{} (layer {})", t.name, t.layer) : t.name);
  }
  if (missing.empty()) return;
  fail("{}: {} tensor(s) the {} model needs are missing:{}", pkg.dir(), missing.size(), c.model_type, name_list(missing));
}

}  // namespace

std::unique_ptr<ModelWeights> ModelWeights::load(std::shared_ptr<ModelPackage> pkg, const LinearLoader& make) {
  ModelSpec spec = ModelSpec::from_json(pkg->config());
  return load(std::move(pkg), std::move(spec), make);
}

std::unique_ptr<ModelWeights> ModelWeights::load(std::shared_ptr<ModelPackage> pkg, ModelSpec spec,
                                                 const LinearLoader& make) {
  auto w = std::make_unique<ModelWeights>();
  w->package = pkg;
  w->config = std::move(spec);
  const ModelSpec& c = w->config;
  const bool nested = pkg->has("model.language_model.embed_tokens.weight") ||
                      pkg->unindexed().count("model.language_model.embed_tokens.weight");
  w->root = nested ? "model.language_model." : "model.";
  refuse_unindexed(*pkg, w->root);
  refuse_missing(*pkg, c, w->root);
  const std::string& R = w->root;
  w->embed = &pkg->require(R + "embed_tokens.weight");
  if (w->embed->numel() != c.vocab_size * c.hidden_size)
    fail("{}: {}embed_tokens.weight is {}, expected [{}, {}]", pkg->dir(), R, w->embed->shape_str(), c.vocab_size, c.hidden_size);
  w->final_norm = load_norm(*pkg, R + "norm", c.hidden_size, false, c.norm_weight_offset);
  if (pkg->has("lm_head.weight") || pkg->has("lm_head.trellis"))
    w->lm_head = linear(make, *pkg, "lm_head", c.hidden_size, c.vocab_size);
  else if (c.tie_embeddings)
    w->lm_head = linear(make, *pkg, R + "embed_tokens", c.hidden_size, c.vocab_size);  // the embedding, tied
  else
    pkg->require("lm_head.weight");
  for (int64_t i = 0; i < c.num_layers; ++i)
    w->layers.push_back(
        load_layer(make, *pkg, c, c.layers[size_t(i)], fmt::format("{}layers.{}", R, i), c.residual.hyper));
  const std::string mtp = fmt::format("{}layers.{}.", R, c.num_layers);
  for (const std::string& name : pkg->names())
    if (name.rfind(mtp, 0) == 0) w->mtp.push_back(pkg->find(name));
  if (c.mtp_layers > 0 && pkg->has(mtp + "eh_proj.weight")) w->mtp_block = load_mtp(make, *pkg, c, mtp);
  return w;
}

std::vector<const Linear*> mixer_linears(const LayerWeights& L) {
  std::vector<const Linear*> out;
  auto add = [&out](std::initializer_list<const std::unique_ptr<Linear>*> ls) {
    for (const std::unique_ptr<Linear>* l : ls)
      if (*l) out.push_back(l->get());
  };
  if (L.mla) add({&L.mla->q_a, &L.mla->q_b, &L.mla->q, &L.mla->kv_a, &L.mla->o});
  if (L.gqa) add({&L.gqa->q, &L.gqa->k, &L.gqa->v, &L.gqa->o});
  if (L.kda)
    add({&L.kda->q, &L.kda->k, &L.kda->v, &L.kda->f_a, &L.kda->f_b, &L.kda->b, &L.kda->g_a, &L.kda->g_b, &L.kda->o});
  if (L.gated_delta) add({&L.gated_delta->qkvz, &L.gated_delta->ba, &L.gated_delta->out});
  return out;
}

std::vector<const Linear*> indexer_linears(const LayerWeights& L) {
  std::vector<const Linear*> out;
  if (!L.mla || !L.mla->indexer) return out;
  const IndexerWeights& ix = *L.mla->indexer;
  for (const std::unique_ptr<Linear>* l : {&ix.wq_b, &ix.wk, &ix.weights_proj, &ix.pool_gate})
    if (*l) out.push_back(l->get());
  return out;
}

size_t mixer_floats(const LayerWeights& L) {
  size_t n = 0;
  if (L.mla) n += L.mla->w_uk.size() + L.mla->w_uv.size();
  if (L.kda) n += L.kda->conv.size();
  if (L.gated_delta) n += L.gated_delta->conv.size();
  return n;
}

}  // namespace moesrv
