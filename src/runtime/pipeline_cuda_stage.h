// A pipeline stage on one GPU: a CudaEngine that holds one layer range (CudaEngineOptions::layer_begin/end) on
// its device; the hand-off between stages goes through host memory (runtime/pipeline.h). CUDA builds only
// (check cuda_available() first; the functions fail in CPU builds).
#pragma once
#include <memory>
#include <vector>

#include "backend/cuda/cuda_engine.h"
#include "runtime/pipeline.h"

namespace moesrv {

class CudaPipelineStage : public PipelineStage {
 public:
  explicit CudaPipelineStage(std::shared_ptr<CudaEngine> engine) : engine_(std::move(engine)) {}
  std::unique_ptr<SequenceState> new_sequence() const override;
  void embed(const std::vector<int32_t>& tokens, StageActivations& a) override;
  void forward_layers(SequenceState& seq, StageActivations& a, int64_t begin, int64_t end) override;
  std::vector<float> logits(const StageActivations& a, int64_t rows) override;
  CudaEngine& engine() const { return *engine_; }

 private:
  std::shared_ptr<CudaEngine> engine_;
};

// A PipelineEngine of CUDA stages over one package with the given layer boundaries, e.g. {2} -> [0,2) [2,L): stage
// i opens a CudaEngine with options[i] (one entry: the same for every stage; device, budget, context, ...) and
// that layer range. Stages may share a device.
std::unique_ptr<PipelineEngine> make_cuda_pipeline(std::shared_ptr<ModelPackage> pkg,
                                                   const std::vector<CudaEngineOptions>& options,
                                                   const std::vector<int64_t>& splits);

}  // namespace moesrv
