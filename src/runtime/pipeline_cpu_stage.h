// A pipeline stage that runs its layer range with the CPU engine (reference path and tests; stages may
// share one CpuEngine, each with its own sequence states).
#pragma once
#include <memory>

#include "backend/cpu/cpu_engine.h"
#include "runtime/pipeline.h"

namespace moesrv {

class CpuPipelineStage : public PipelineStage {
 public:
  explicit CpuPipelineStage(std::shared_ptr<CpuEngine> engine) : engine_(std::move(engine)) {}
  std::unique_ptr<SequenceState> new_sequence() const override { return engine_->new_sequence(); }
  void embed(const std::vector<int32_t>& tokens, StageActivations& a) override;
  void forward_layers(SequenceState& seq, StageActivations& a, int64_t begin, int64_t end) override;
  std::vector<float> logits(const StageActivations& a, int64_t rows) override;

 private:
  std::shared_ptr<CpuEngine> engine_;
};

// A PipelineEngine of CPU stages over one CpuEngine with the given layer boundaries, e.g. {2} -> [0,2) [2,L).
std::unique_ptr<PipelineEngine> make_cpu_pipeline(std::shared_ptr<CpuEngine> engine, const std::vector<int64_t>& splits);

}  // namespace moesrv
