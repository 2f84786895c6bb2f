#include "runtime/pipeline_cuda_stage.h"

#include <algorithm>

#include "util/error.h"

namespace moesrv {

#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA

std::unique_ptr<SequenceState> CudaPipelineStage::new_sequence() const { return engine_->new_sequence(); }

void CudaPipelineStage::embed(const std::vector<int32_t>& tokens, StageActivations& a) { engine_->embed(tokens, a); }

void CudaPipelineStage::forward_layers(SequenceState& seq, StageActivations& a, int64_t begin, int64_t end) {
  engine_->forward_layers(seq, a, begin, end);
}

std::vector<float> CudaPipelineStage::logits(const StageActivations& a, int64_t rows) {
  return engine_->logits(a, rows);
}

std::unique_ptr<PipelineEngine> make_cuda_pipeline(std::shared_ptr<ModelPackage> pkg,
                                                   const std::vector<CudaEngineOptions>& options,
                                                   const std::vector<int64_t>& splits) {
  const size_t n = splits.size() + 1;
  if (options.size() != 1 && options.size() != n)
    fail("make_cuda_pipeline: {} option sets for {} stages (give one, or one per stage)", options.size(), n);
  std::vector<PipelineStageSpec> specs;
  PipelineModelInfo info;
  int64_t begin = 0;
  for (size_t i = 0; i < n; ++i) {
    CudaEngineOptions o = options[options.size() == 1 ? 0 : i];
    o.layer_begin = begin;
    o.layer_end = i < splits.size() ? splits[i] : -1;  // the last stage: to the model's last layer
    auto engine = std::make_shared<CudaEngine>(pkg, o);
    if (i == 0)
      info = {engine->name(), engine->vocab_size(), engine->max_context(), engine->num_layers(),
              engine->prefill_chunk()};
    info.max_context = std::min(info.max_context, engine->max_context());
    info.prefill_chunk = std::min(info.prefill_chunk, engine->prefill_chunk());
    specs.push_back({std::make_shared<CudaPipelineStage>(engine), engine->layer_begin(), engine->layer_end()});
    begin = engine->layer_end();
  }
  return std::make_unique<PipelineEngine>(std::move(specs), std::move(info));
}

#else

std::unique_ptr<SequenceState> CudaPipelineStage::new_sequence() const { fail("CUDA pipeline stage: no CUDA backend"); }
void CudaPipelineStage::embed(const std::vector<int32_t>&, StageActivations&) {
  fail("CUDA pipeline stage: no CUDA backend");
}
void CudaPipelineStage::forward_layers(SequenceState&, StageActivations&, int64_t, int64_t) {
  fail("CUDA pipeline stage: no CUDA backend");
}
std::vector<float> CudaPipelineStage::logits(const StageActivations&, int64_t) {
  fail("CUDA pipeline stage: no CUDA backend");
}
std::unique_ptr<PipelineEngine> make_cuda_pipeline(std::shared_ptr<ModelPackage>, const std::vector<CudaEngineOptions>&,
                                                   const std::vector<int64_t>&) {
  fail("make_cuda_pipeline: this build has no CUDA backend");
}

#endif

}  // namespace moesrv
