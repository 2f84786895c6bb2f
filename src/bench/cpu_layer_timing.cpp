#include "bench/cpu_layer_timing.h"

#include <algorithm>
#include <cmath>

#include "bench/common.h"
#include "model/synthetic_model.h"
#include "util/error.h"

namespace moesrv::bench {

using json = nlohmann::json;

std::string layer_kind(const LayerSpec& L) {
  return std::string(mixer_name(L.mixer)) + (L.ffn == FfnKind::Moe ? "+MoE" : "+dense");
}

std::vector<float> timed_forward(CpuEngine& engine, SequenceState& seq, const std::vector<int32_t>& tokens,
                                 StepTimes& t) {
  engine.time_steps(&t);
  struct Off {
    CpuEngine& e;
    ~Off() { e.time_steps(nullptr); }
  } off{engine};
  return engine.forward(seq, tokens);
}

// Bytes of weights one decode token reads in layer L: every linear the token passes through (mixer_linears: MLA's
// absorbed fp32 w_uk/w_uv instead of kv_b; its indexer's; MoE: the shared expert and experts_per_token routed
// experts), the mixer's fp32 arrays, router, mHC.
double decode_weight_bytes(const LayerWeights& L, const ModelSpec& c) {
  double b = 4.0 * double(mixer_floats(L));
  auto lin = [&b](const Linear* l) { b += l ? double(l->stored_bytes()) : 0.0; };
  auto mlp = [&](const MlpWeights& m) { lin(m.gate.get()), lin(m.up.get()), lin(m.down.get()); };
  auto floats = [&b](const std::vector<float>& v) { b += 4.0 * double(v.size()); };
  for (const Linear* l : mixer_linears(L)) lin(l);
  for (const Linear* l : indexer_linears(L)) lin(l);
  if (L.mlp) mlp(*L.mlp);
  if (L.moe) {
    floats(L.moe->router);
    if (L.moe->shared) mlp(*L.moe->shared);
    for (int64_t e = 0; e < c.experts_per_token && e < int64_t(L.moe->experts.size()); ++e)
      mlp(L.moe->experts[size_t(e)]);
  }
  floats(L.attn_hc.fn), floats(L.ffn_hc.fn);
  return b;
}

// Timing the steps leaves CpuEngine::forward's results as they are (prefill across a checkpoint cut, then decode).
double self_check() {
  json cfg = tiny_glm5_next_config(4);
  CpuEngine engine(make_synthetic_model(cfg, {3, 0.05f, 0}), "check");
  auto a = engine.new_sequence(), b = engine.new_sequence();
  auto prompt = prompt_tokens(CpuEngine::kCheckpointInterval + 40, engine.vocab_size(), 5);
  StepTimes t;
  auto la = engine.forward(*a, prompt);
  auto lb = timed_forward(engine, *b, prompt, t);
  double diff = 0;
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < la.size(); ++i) diff = std::max(diff, double(std::abs(la[i] - lb[i])));
    const int32_t next = int32_t(std::max_element(la.begin(), la.end()) - la.begin());
    la = engine.forward(*a, {next});
    lb = timed_forward(engine, *b, {next}, t);
  }
  for (size_t i = 0; i < la.size(); ++i) diff = std::max(diff, double(std::abs(la[i] - lb[i])));
  if (la.size() != lb.size() || diff != 0)
    fail("bench self-check: the timed forward differs from CpuEngine::forward by {}", diff);
  return diff;
}

}  // namespace moesrv::bench
