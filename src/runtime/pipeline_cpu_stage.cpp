#include "runtime/pipeline_cpu_stage.h"

#include <algorithm>

#include "util/error.h"

namespace moesrv {

void CpuPipelineStage::embed(const std::vector<int32_t>& tokens, StageActivations& a) {
  a.hidden.assign(size_t(a.tokens * engine_->config().stream_width()), 0.0f);
  engine_->embed(tokens, a.hidden.data());
}

void CpuPipelineStage::forward_layers(SequenceState& seq_base, StageActivations& a, int64_t begin, int64_t end) {
  CpuSequence& seq = engine_->own_sequence(seq_base);
  const int64_t W = engine_->config().stream_width();
  if (seq.length() != a.pos0) fail("pipeline stage: sequence holds {} tokens, batch starts at {}", seq.length(), a.pos0);
  if (int64_t(a.hidden.size()) != a.tokens * W) fail("pipeline stage: hidden state size mismatch");
  // The engine's passes (cuts and checkpoints as CpuEngine::forward); each pass reads and writes its rows of the
  // DSA selection.
  for_each_pass(engine_->pass_policy(), seq, a.pos0, a.tokens, false, [&](const Pass& p) {
    cpu::TokenSelection sel;
    if (!a.selection.empty()) sel.assign(a.selection.begin() + p.offset, a.selection.begin() + p.offset + p.rows);
    engine_->forward_layers(seq, a.hidden.data() + p.offset * W, p.rows, p.pos0, begin, end, sel);
    if (!sel.empty()) {
      a.selection.resize(size_t(a.tokens));
      std::move(sel.begin(), sel.end(), a.selection.begin() + p.offset);
    }
  });
}

std::vector<float> CpuPipelineStage::logits(const StageActivations& a, int64_t rows) {
  return engine_->logits(a.hidden.data(), a.tokens, rows);
}

std::unique_ptr<PipelineEngine> make_cpu_pipeline(std::shared_ptr<CpuEngine> engine, const std::vector<int64_t>& splits) {
  const ModelSpec& c = engine->config();
  std::vector<PipelineStageSpec> specs;
  int64_t begin = 0;
  for (size_t i = 0; i <= splits.size(); ++i) {
    int64_t end = i < splits.size() ? splits[i] : c.num_layers;
    specs.push_back({std::make_shared<CpuPipelineStage>(engine), begin, end});
    begin = end;
  }
  return std::make_unique<PipelineEngine>(
      std::move(specs),
      PipelineModelInfo{engine->name(), c.vocab_size, c.max_position, c.num_layers, engine->prefill_chunk()});
}

}  // namespace moesrv
