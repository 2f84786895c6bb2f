// Pipeline over CPU stages: bit-identical to CpuEngine for every split, with clone/truncate and DSA
// selections crossing a stage boundary.
#include <gtest/gtest.h>

#include "backend/cpu/cpu_engine.h"
#include "reference_util.h"
#include "runtime/pipeline_cpu_stage.h"

namespace moesrv {
namespace {

using namespace moesrv::testing;

class Pipeline : public ::testing::TestWithParam<std::string> {};

// Every way to split the model into 1, 2 and 3 stages.
std::vector<std::vector<int64_t>> all_splits(int64_t layers) {
  std::vector<std::vector<int64_t>> out{{}};
  for (int64_t a = 1; a < layers; ++a) {
    out.push_back({a});
    for (int64_t b = a + 1; b < layers; ++b) out.push_back({a, b});
  }
  return out;
}

std::string describe(const std::vector<int64_t>& s) {
  std::string d = "split";
  for (auto v : s) d += " " + std::to_string(v);
  return d;
}

TEST_P(Pipeline, LogitsBitIdenticalToCpuEngine) {
  std::shared_ptr<CpuEngine> cpu = CpuEngine::open(hf_tiny(GetParam()));
  Reference ref = load_reference(GetParam());
  const std::vector<int32_t> prompt(ref.input_ids.begin(), ref.input_ids.begin() + 24);
  const std::vector<int32_t> more(ref.input_ids.begin() + 24, ref.input_ids.begin() + 30);
  auto seq = cpu->new_sequence();
  const auto want_prefill = cpu->forward(*seq, prompt, true);
  const auto want_more = cpu->forward(*seq, more, true);
  const auto want_step = cpu->forward(*seq, {ref.input_ids[30]});
  for (const auto& split : all_splits(cpu->config().num_layers)) {
    auto pipe = make_cpu_pipeline(cpu, split);
    auto ps = pipe->new_sequence();
    EXPECT_EQ(pipe->forward(*ps, prompt, true), want_prefill) << describe(split);
    EXPECT_EQ(pipe->forward(*ps, more, true), want_more) << describe(split);
    EXPECT_EQ(pipe->forward(*ps, {ref.input_ids[30]}), want_step) << describe(split);
    EXPECT_EQ(ps->length(), 31);
  }
}

TEST_P(Pipeline, CloneAndTruncateReplayIdentically) {
  std::shared_ptr<CpuEngine> cpu = CpuEngine::open(hf_tiny(GetParam()));
  Reference ref = load_reference(GetParam());
  const std::vector<int32_t> a(ref.input_ids.begin(), ref.input_ids.begin() + 20), b(ref.input_ids.begin() + 20, ref.input_ids.begin() + 30);
  auto pipe = make_cpu_pipeline(cpu, {1, 3});
  auto seq = pipe->new_sequence();
  pipe->forward(*seq, a);
  auto snapshot = seq->clone();
  EXPECT_EQ(snapshot->bytes(), seq->bytes());
  auto first = pipe->forward(*seq, b);
  seq->truncate(20);
  EXPECT_EQ(seq->length(), 20);
  auto again = pipe->forward(*seq, b);
  auto from_clone = pipe->forward(*snapshot, b);
  EXPECT_EQ(first, again);
  EXPECT_EQ(first, from_clone);
  auto direct = cpu->new_sequence();
  cpu->forward(*direct, a);
  EXPECT_EQ(cpu->forward(*direct, b), first);
}

INSTANTIATE_TEST_SUITE_P(HfTiny, Pipeline, ::testing::Values("deepseek_v3", "glm4_moe", "glm_moe_dsa"));

// glm_moe_dsa layers: full, full, shared, full. Splitting 1|2 puts the shared layer 2 at the start of stage 1:
// it must reuse layer 1's top-k, which travels in StageActivations::selection.
TEST(PipelineDsa, SharedLayerSelectionCrossesStageBoundary) {
  std::shared_ptr<CpuEngine> cpu = CpuEngine::open(hf_tiny("glm_moe_dsa"));
  const ModelSpec& c = cpu->config();
  ASSERT_TRUE(c.dsa);
  ASSERT_TRUE(c.layer_has_indexer[1]);
  ASSERT_FALSE(c.layer_has_indexer[2]);
  Reference ref = load_reference("glm_moe_dsa");
  ASSERT_GT(int64_t(ref.input_ids.size()), c.index_topk + 8) << "prompt must exceed index_topk to exercise top-k";
  auto seq = cpu->new_sequence();
  const auto want = cpu->forward(*seq, ref.input_ids, true);

  // Run the two stages by hand to see what crosses the boundary.
  CpuPipelineStage s0(cpu), s1(cpu);
  auto q0 = s0.new_sequence(), q1 = s1.new_sequence();
  StageActivations act;
  act.tokens = int64_t(ref.input_ids.size());
  s0.embed(ref.input_ids, act);
  s0.forward_layers(*q0, act, 0, 2);
  ASSERT_EQ(int64_t(act.selection.size()), act.tokens) << "layer 1's top-k travels with the hidden state";
  StageActivations dropped = act;
  s1.forward_layers(*q1, act, 2, c.num_layers);
  EXPECT_EQ(s1.logits(act, act.tokens), want);

  // Without the selection, the shared layer would attend densely: different logits.
  dropped.selection.clear();
  auto q1b = s1.new_sequence();
  s1.forward_layers(*q1b, dropped, 2, c.num_layers);
  EXPECT_NE(s1.logits(dropped, dropped.tokens), want);

  auto pipe = make_cpu_pipeline(cpu, {2});
  auto ps = pipe->new_sequence();
  EXPECT_EQ(pipe->forward(*ps, ref.input_ids, true), want);
}

// The CUDA engine keeps a selection as rows of selection_width() positions, -1 padded (backend/stage_activations.h);
// a CUDA stage packs the host lists into that layout and unpacks it again. The CPU stage's lists (plain DSA and
// the k-pool indexer) must survive the round trip unchanged, also for a later chunk of a pass (row offset).
TEST(PipelineDsa, SelectionRoundTripsThroughTheDeviceLayout) {
  for (const char* model : {"glm_moe_dsa", "glm5_next"}) {
    SCOPED_TRACE(model);
    std::shared_ptr<CpuEngine> cpu = CpuEngine::open(hf_tiny(model));
    const ModelSpec& c = cpu->config();
    int64_t own = -1;
    for (int64_t l = 0; l < c.num_layers && own < 0; ++l)
      if (c.layers[size_t(l)].indexer == IndexerKind::Own) own = l;
    ASSERT_GE(own, 0);
    Reference ref = load_reference(model);
    CpuPipelineStage stage(cpu);
    auto seq = stage.new_sequence();
    StageActivations act;
    act.tokens = int64_t(ref.input_ids.size());
    stage.embed(ref.input_ids, act);
    stage.forward_layers(*seq, act, 0, own + 1);
    ASSERT_EQ(int64_t(act.selection.size()), act.tokens);
    const int64_t S = act.tokens, W = selection_width(c);
    for (int64_t s = 0; s < S; ++s)
      for (int32_t t : act.selection[size_t(s)]) {  // positions only: -1 ends a device row
        ASSERT_GE(t, 0);
        ASSERT_LE(t, s);
      }
    std::vector<int32_t> rows(size_t(S * W), 7);
    pack_selection(act.selection, 0, S, W, rows.data());
    std::vector<std::vector<int32_t>> back(static_cast<size_t>(S));
    unpack_selection(rows.data(), S, W, 0, back);
    EXPECT_EQ(back, act.selection);
    const int64_t row0 = S / 2, n = S - row0;  // a later chunk: rows [row0, S) at offset 0 of the device rows
    std::vector<std::vector<int32_t>> part(size_t(S), std::vector<int32_t>{42});
    pack_selection(act.selection, row0, n, W, rows.data());
    unpack_selection(rows.data(), n, W, row0, part);
    for (int64_t s = 0; s < S; ++s)
      EXPECT_EQ(part[size_t(s)], s < row0 ? std::vector<int32_t>{42} : act.selection[size_t(s)]) << s;
    EXPECT_THROW(pack_selection({std::vector<int32_t>(size_t(W + 1), 0)}, 0, 1, W, rows.data()), std::exception);
    EXPECT_THROW(pack_selection(act.selection, S - 1, 2, W, rows.data()), std::exception);
  }
}

TEST(PipelineEngine, RejectsBadRanges) {
  std::shared_ptr<CpuEngine> cpu = CpuEngine::open(hf_tiny("deepseek_v3"));
  const int64_t L = cpu->config().num_layers;
  auto stage = std::make_shared<CpuPipelineStage>(cpu);
  PipelineModelInfo info{"m", cpu->vocab_size(), cpu->max_context(), L};
  EXPECT_THROW(PipelineEngine({{stage, 0, 1}, {stage, 2, L}}, info), std::exception);  // gap
  EXPECT_THROW(PipelineEngine({{stage, 0, L - 1}}, info), std::exception);            // short
  EXPECT_THROW(PipelineEngine({{stage, 0, 0}, {stage, 0, L}}, info), std::exception); // empty stage
  EXPECT_NO_THROW(PipelineEngine({{stage, 0, L}}, info));
  auto other = make_cpu_pipeline(cpu, {});
  auto foreign = cpu->new_sequence();
  EXPECT_THROW(other->forward(*foreign, {1}), std::exception);
}

// A stage that fails after running its layers (e.g. a device error on a later GPU).
class FailingStage : public CpuPipelineStage {
 public:
  using CpuPipelineStage::CpuPipelineStage;
  bool fail_next = false;
  void forward_layers(SequenceState& seq, StageActivations& a, int64_t begin, int64_t end) override {
    CpuPipelineStage::forward_layers(seq, a, begin, end);
    if (fail_next) throw std::runtime_error("stage failed");
  }
};

TEST(PipelineEngine, FailedPassLeavesTheSequenceUnchanged) {
  std::shared_ptr<CpuEngine> cpu = CpuEngine::open(hf_tiny("glm4_moe"));
  const int64_t L = cpu->config().num_layers;
  auto last = std::make_shared<FailingStage>(cpu);
  PipelineEngine pipe({{std::make_shared<CpuPipelineStage>(cpu), 0, 1}, {last, 1, L}},
                      {"m", cpu->vocab_size(), cpu->max_context(), L});
  auto seq = pipe.new_sequence();
  pipe.forward(*seq, {1, 2, 3});
  const size_t bytes = seq->bytes();
  last->fail_next = true;
  EXPECT_THROW(pipe.forward(*seq, {4, 5}), std::runtime_error);
  EXPECT_EQ(seq->length(), 3);
  EXPECT_EQ(seq->bytes(), bytes);
  last->fail_next = false;
  auto ref = cpu->new_sequence();
  cpu->forward(*ref, {1, 2, 3});
  EXPECT_EQ(pipe.forward(*seq, {4, 5}), cpu->forward(*ref, {4, 5}));
}

}  // namespace
}  // namespace moesrv
