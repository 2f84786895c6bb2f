// Per-layer timing of the CPU engine for `bench_glm5_next_cpu`: CpuEngine::forward replayed through its public
// steps with a timer around each layer, its self-check against forward, layer kinds and the weight bytes a decode
// token reads per layer.
#pragma once
#include <string>
#include <vector>

#include "backend/cpu/cpu_engine.h"

namespace moesrv::bench {

const char* mixer_name(Mixer m);
// "KDA+MoE", "MLA+dense", ...
std::string layer_kind(const LayerSpec& L);

struct StepTimes {
  std::vector<double> layer_s;  // per layer
  double embed_s = 0, head_s = 0;
  double total() const {
    double t = embed_s + head_s;
    for (double x : layer_s) t += x;
    return t;
  }
  void add(const StepTimes& o) {
    layer_s.resize(o.layer_s.size(), 0.0);
    for (size_t i = 0; i < o.layer_s.size(); ++i) layer_s[i] += o.layer_s[i];
    embed_s += o.embed_s;
    head_s += o.head_s;
  }
};

// CpuEngine::forward with each step timed into `t` (adds to it); the logits of the last row.
std::vector<float> timed_forward(CpuEngine& engine, CpuSequence& seq, const std::vector<int32_t>& tokens, StepTimes& t);

// Checks on a tiny model that timed_forward gives CpuEngine::forward's logits exactly (throws if not); returns the
// largest difference (0).
double self_check();

// Bytes of weights one decode token reads in layer L.
double decode_weight_bytes(const LayerWeights& L, const ModelSpec& c);

}  // namespace moesrv::bench
