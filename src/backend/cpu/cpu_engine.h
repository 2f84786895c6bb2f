// The CPU inference engine: every layer on the host, fp32 activations, weights as stored (bf16/fp8/EXL3).
#pragma once
#include <memory>
#include <string>

#include "backend/cpu/cpu_layers.h"
#include "model/rope.h"
#include "model/weights.h"
#include "runtime/engine.h"

namespace moesrv {

class CpuSequence : public SequenceState {
 public:
  explicit CpuSequence(int64_t layers) : layers(size_t(layers)) {}
  int64_t length() const override { return length_; }
  void truncate(int64_t n) override;
  std::unique_ptr<SequenceState> clone() const override { return std::make_unique<CpuSequence>(*this); }
  size_t bytes() const override;

  std::vector<cpu::LayerCache> layers;
  int64_t length_ = 0;
  const void* owner = nullptr;  // the engine that created it (layout check)
  int64_t kv_dims[3] = {0, 0, 0};  // per-token floats of latent/k, rope/v, index_k (for truncate)
};

class CpuEngine : public Engine {
 public:
  explicit CpuEngine(std::shared_ptr<ModelPackage> pkg, std::string served_name = "");
  static std::unique_ptr<CpuEngine> open(const std::string& model_dir, std::string served_name = "");

  std::string name() const override { return name_; }
  int64_t vocab_size() const override { return weights_->config.vocab_size; }
  int64_t max_context() const override { return weights_->config.max_position; }
  std::unique_ptr<SequenceState> new_sequence() const override;
  std::vector<float> forward(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits = false) override;

  // The steps of forward(), public so a pipeline stage can run a layer range (forward() uses them too).
  // Token embeddings into x [S, D].
  void embed(const std::vector<int32_t>& tokens, float* x) const;
  // Layers [begin, end) over x [S, D] at positions [pos0, pos0+S); appends to seq's caches of those layers
  // (seq's length is left to the caller). `selection` is the DSA top-k in and out: a shared layer at `begin`
  // reuses the selection of layer begin-1. Marks tied DSA selections in ambiguous [S] when given.
  void forward_layers(CpuSequence& seq, float* x, int64_t S, int64_t pos0, int64_t begin, int64_t end,
                      cpu::TokenSelection& selection, std::vector<uint8_t>* ambiguous = nullptr);
  // Final norm + lm_head over the last `rows` rows of x [S, D]: [rows, vocab].
  std::vector<float> logits(const float* x, int64_t S, int64_t rows) const;
  CpuSequence& own_sequence(SequenceState& seq) const;  // checked cast: fails unless new_sequence() made it

  const ModelConfig& config() const { return weights_->config; }
  // Routed-expert selections seen so far (for pinning hot experts at the next start, see usage_placement.h).
  const UsageStats* expert_usage() const override { return &usage_; }
  // Per token of the last forward(): 1 where a DSA top-k boundary fell on tied indexer scores in some layer.
  const std::vector<uint8_t>& last_ambiguous_selection() const { return ambiguous_; }
  const ModelWeights& weights() const { return *weights_; }

 private:
  std::unique_ptr<ModelWeights> weights_;
  Rope rope_;
  std::string name_;
  std::vector<uint8_t> ambiguous_;
  UsageStats usage_;
};

}  // namespace moesrv
