#include "model/manifest.h"

#include <fmt/format.h>

namespace moesrv {

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

class List {
 public:
  List(std::vector<TensorEntry>& out, int64_t layer) : out_(out), layer_(layer) {}
  void matrix(const std::string& name, int64_t out, int64_t in) { add(name + ".weight", {out, in}, TensorRole::Matrix); }
  void norm(const std::string& name, int64_t n, bool bias = false) {
    add(name + ".weight", {n}, TensorRole::Norm, TensorInit::Ones);
    if (bias) add(name + ".bias", {n}, TensorRole::Norm, TensorInit::Zeros);
  }
  void param(const std::string& name, std::vector<int64_t> shape, TensorInit init = TensorInit::Random) {
    add(name, std::move(shape), TensorRole::Param, init);
  }
  void optional_param(const std::string& name, std::vector<int64_t> shape) {
    add(name, std::move(shape), TensorRole::Param, TensorInit::Zeros);
    out_.back().optional = true;
  }
  void mlp(const std::string& p, int64_t hidden, int64_t inter, int64_t expert = -1) {
    const TensorRole role = expert >= 0 ? TensorRole::Expert : TensorRole::Matrix;
    add(p + ".gate_proj.weight", {inter, hidden}, role, TensorInit::Random, expert);
    add(p + ".up_proj.weight", {inter, hidden}, role, TensorInit::Random, expert);
    add(p + ".down_proj.weight", {hidden, inter}, role, TensorInit::Random, expert);
  }

 private:
  void add(std::string name, std::vector<int64_t> shape, TensorRole role, TensorInit init = TensorInit::Random,
           int64_t expert = -1) {
    out_.push_back({std::move(name), std::move(shape), role, layer_, expert, init});
  }
  std::vector<TensorEntry>& out_;
  int64_t layer_;
};

void mla(List& t, const ModelSpec& s, const std::string& a, const LayerSpec& L) {
  const int64_t D = s.hidden_size, H = s.num_heads;
  if (s.q_lora_rank > 0) {
    t.matrix(a + ".q_a_proj", s.q_lora_rank, D);
    t.norm(a + ".q_a_layernorm", s.q_lora_rank);
    t.matrix(a + ".q_b_proj", H * s.qk_head_dim(), s.q_lora_rank);
  } else {
    t.matrix(a + ".q_proj", H * s.qk_head_dim(), D);
  }
  t.matrix(a + ".kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_dim, D);
  t.norm(a + ".kv_a_layernorm", s.kv_lora_rank);
  t.matrix(a + ".kv_b_proj", H * (s.qk_nope_dim + s.v_head_dim), s.kv_lora_rank);
  t.matrix(a + ".o_proj", D, H * s.v_head_dim);
  if (L.indexer != IndexerKind::Own) return;
  const std::string ix = a + ".indexer";
  t.matrix(ix + ".wq_b", s.index_n_heads * s.index_head_dim, s.q_lora_rank);
  t.matrix(ix + ".wk", s.index_head_dim, D);
  t.matrix(ix + ".weights_proj", s.index_n_heads, D);
  t.norm(ix + ".k_norm", s.index_head_dim, true);
  if (s.index_kpool > 1) {
    t.param(ix + ".index_kpool_compress_ape", {s.index_kpool, s.index_head_dim});
    t.param(ix + ".index_kpool_compress_gate", {s.index_head_dim, D});
  }
}

void gqa(List& t, const ModelSpec& s, const std::string& a) {
  const int64_t D = s.hidden_size, hd = s.head_dim, kv = s.num_kv_heads * hd;
  t.matrix(a + ".q_proj", s.num_heads * hd * (s.attn_output_gate ? 2 : 1), D);
  t.matrix(a + ".k_proj", kv, D);
  t.matrix(a + ".v_proj", kv, D);
  t.matrix(a + ".o_proj", D, s.num_heads * hd);
  if (s.attention_bias)
    for (const char* p : {".q_proj.bias", ".k_proj.bias", ".v_proj.bias"})
      t.param(a + p, {std::string(p) == ".q_proj.bias" ? s.num_heads * hd : kv}, TensorInit::Zeros);
  if (s.qk_norm) {
    t.norm(a + ".q_norm", hd);
    t.norm(a + ".k_norm", hd);
  }
}

void kda(List& t, const ModelSpec& s, const std::string& a) {
  const LinearAttnDims& la = s.linear;
  const int64_t D = s.hidden_size, H = la.v_heads, d = la.dk, Hd = H * d;
  for (const char* p : {"q", "k", "v"}) {
    t.matrix(a + "." + p + "_proj", Hd, D);
    t.param(a + "." + p + "_conv1d.weight", {Hd, 1, la.conv_kernel});
  }
  t.matrix(a + ".f_a_proj", d, D);
  t.matrix(a + ".f_b_proj", Hd, d);
  t.param(a + ".dt_bias", {Hd});
  t.param(a + ".A_log", {H}, TensorInit::Zeros);
  t.matrix(a + ".b_proj", H, D);
  t.matrix(a + ".g_a_proj", d, D);
  t.matrix(a + ".g_b_proj", Hd, d);
  t.norm(a + ".o_norm", d);
  t.matrix(a + ".o_proj", D, Hd);
}

void gated_delta(List& t, const ModelSpec& s, const std::string& a) {
  const LinearAttnDims& la = s.linear;
  const int64_t D = s.hidden_size;
  t.matrix(a + ".in_proj_qkvz", 2 * la.k_heads * la.dk + 2 * la.v_heads * la.dv, D);
  t.matrix(a + ".in_proj_ba", 2 * la.v_heads, D);
  t.param(a + ".conv1d.weight", {la.conv_channels(), 1, la.conv_kernel});
  t.param(a + ".dt_bias", {la.v_heads});
  t.param(a + ".A_log", {la.v_heads}, TensorInit::Zeros);
  t.norm(a + ".norm", la.dv);
  t.matrix(a + ".out_proj", D, la.v_heads * la.dv);
}

void moe(List& t, const ModelSpec& s, const std::string& m) {
  const int64_t D = s.hidden_size;
  t.param(m + ".gate.weight", {s.n_routed_experts, D});
  if (s.router == RouterKind::SigmoidGroup) t.optional_param(m + ".gate.e_score_correction_bias", {s.n_routed_experts});
  for (int64_t e = 0; e < s.n_routed_experts; ++e) t.mlp(fmt::format("{}.experts.{}", m, e), D, s.moe_intermediate_size, e);
  if (s.n_shared_experts > 0)
    t.mlp(m + (s.shared_expert_gate ? ".shared_expert" : ".shared_experts"), D, s.shared_intermediate_size);
  if (s.shared_expert_gate) t.param(m + ".shared_expert_gate.weight", {1, D});
}

}  // namespace

std::vector<TensorEntry> manifest(const ModelSpec& s, const std::string& root) {
  std::vector<TensorEntry> out;
  const int64_t D = s.hidden_size;
  {
    List t(out, -1);
    t.param(root + "embed_tokens.weight", {s.vocab_size, D});
    t.norm(root + "norm", D);
    if (!s.tie_embeddings) t.matrix("lm_head", s.vocab_size, D);
  }
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const LayerSpec& L = s.layers[size_t(l)];
    const std::string p = fmt::format("{}layers.{}", root, l);
    List t(out, l);
    t.norm(p + ".input_layernorm", D);
    t.norm(p + ".post_attention_layernorm", D);
    switch (L.mixer) {
      case Mixer::Mla: mla(t, s, p + ".self_attn", L); break;
      case Mixer::Gqa: gqa(t, s, p + ".self_attn"); break;
      case Mixer::Kda: kda(t, s, p + ".self_attn"); break;
      case Mixer::GatedDelta: gated_delta(t, s, p + ".linear_attn"); break;
    }
    if (L.ffn == FfnKind::Moe) moe(t, s, p + ".mlp");
    else t.mlp(p + ".mlp", D, s.intermediate_size);
    if (s.residual.hyper) {
      const int64_t hc = s.residual.streams, mix = (2 + hc) * hc;
      for (const char* site : {".hc_attn", ".hc_ffn"}) {
        t.param(p + site + "_fn", {mix, hc * D});
        t.param(p + site + "_base", {mix}, TensorInit::Zeros);
        t.param(p + site + "_scale", {3}, TensorInit::Ones);
      }
    }
  }
  return out;
}

std::vector<TensorEntry> mtp_manifest(const ModelSpec& s, const std::string& root) {
  std::vector<TensorEntry> out;
  const int64_t D = s.hidden_size, L = s.num_layers;
  const std::string p = fmt::format("{}layers.{}.", root, L), from = root + "layers.0.";
  {
    List t(out, L);
    t.norm(p + "enorm", D);
    t.norm(p + "hnorm", D);
    t.matrix(p + "eh_proj", D, 2 * D);
    t.norm(p + "shared_head.norm", D);
    t.matrix(p + "shared_head.head", s.vocab_size, D);
    out.back().optional = true;  // absent: the model's lm_head
  }
  for (TensorEntry& e : manifest(s.mtp_block(), root)) {
    if (e.layer != 0) continue;
    e.name = p + e.name.substr(from.size());
    e.layer = L;
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace moesrv
