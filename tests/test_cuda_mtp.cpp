// Speculative decoding with the MTP block on the CUDA engine (CudaEngineOptions::mtp): greedy output equal to the
// engine's plain decoding for k = 1..3 (graph-replayed verifies and eager ones), forced acceptance committing several
// tokens per step, rollback of recurrent / conv / k-pool state on the device, and the MTP block's forward against the
// CPU engine's (checked against vLLM's MTP code: tests/test_mtp_speculative.cpp). Skipped without CUDA or a device.
#include <gtest/gtest.h>

#include <filesystem>

#include "backend/cpu/cpu_engine.h"
#include "backend/cuda/cuda_engine.h"
#include "cuda_test_util.h"
#include "engine_test_util.h"
#include "mtp_test_checks.h"
#include "mtp_test_model.h"
#include "reference_util.h"
#include "server/generator.h"
#include "serving/speculative.h"

namespace moesrv {
namespace {

#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA

#define SKIP_WITHOUT_CUDA() \
  if (!cuda_available()) GTEST_SKIP() << "no CUDA backend or device"

using testing::copy_with_mtp;
using testing::hf_tiny;

// The CUDA engine (and, with cpu, the CPU engine) on a copy of `model` with an MTP block; the copy's folder goes as
// soon as both are open (the CPU engine maps its files).
struct MtpModels {
  std::unique_ptr<CudaEngine> gpu;
  std::unique_ptr<CpuEngine> cpu;
};
// lent: every routed expert in host memory behind 2 LRU slots per layer, with lent slots (lend_pass_arena, on for
// the tiny arenas too).
MtpModels open_with_mtp(const std::string& model, bool cpu = false, bool with_head = false, bool lent = false) {
  const std::string dir = copy_with_mtp(hf_tiny(model), model, 1234, with_head);
  CudaEngineOptions opt;
  opt.mtp = true;
  opt.max_ctx = 256;
  if (lent) opt = test::with_lent_slots(dir, opt);
  MtpModels m{std::make_unique<CudaEngine>(ModelPackage::open(dir), opt), nullptr};
  if (cpu) m.cpu = CpuEngine::open(dir);
  std::filesystem::remove_all(dir);
  return m;
}

// CUDA against the CPU engine: test_cuda_engine's per-row tolerance (the GPU's multi-row GEMMs take bf16 inputs).
constexpr double kCpuTolerance = 1e-2;

class CudaMtpGreedy : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaMtpGreedy, SameTokensAsPlainDecodingForK1To3) {
  SKIP_WITHOUT_CUDA();
  MtpModels m = open_with_mtp(GetParam(), false, GetParam() == "deepseek_v3");
  ASSERT_NE(m.gpu->mtp(), nullptr);
  const auto prompt = testing::reference_prompt(GetParam(), 19);
  const auto plain = test::greedy_tokens(*m.gpu, prompt, 24);
  for (bool graphs : {true, false}) {
    m.gpu->set_use_graph(graphs);
    for (int k = 1; k <= 3; ++k) {
      Sampler s(SamplingParams{.temperature = 0.0f});
      SpeculativeStats stats;
      EXPECT_EQ(generate_speculative(*m.gpu, prompt, 24, s, k, &stats), plain) << "k = " << k << " graphs " << graphs;
      EXPECT_GT(stats.steps, 0);
      EXPECT_GT(stats.drafted, 0);
    }
  }
}

// The same with the experts in host memory and lent slots: a 40-token prompt takes the lent arena, the verifies and
// drafts run with the lent slots.
TEST_P(CudaMtpGreedy, SameTokensWithLentSlots) {
  SKIP_WITHOUT_CUDA();
  MtpModels m = open_with_mtp(GetParam(), false, GetParam() == "deepseek_v3", true);
  ASSERT_NE(m.gpu->mtp(), nullptr);
  const auto prompt = testing::reference_prompt(GetParam(), 40);
  const auto plain = test::greedy_tokens(*m.gpu, prompt, 16);
  for (int k = 1; k <= 3; ++k) {
    Sampler s(SamplingParams{.temperature = 0.0f});
    EXPECT_EQ(generate_speculative(*m.gpu, prompt, 16, s, k), plain) << "k = " << k;
  }
  EXPECT_GT(m.gpu->stats().lent_slots, 0);
  EXPECT_GE(m.gpu->stats().arena_switches, 8);  // each of the 4 runs: the prompt, then its steps
}

// Drafts from a picker that knows the greedy tokens: all accepted (several tokens per step), or with every third
// position corrupted a prefix is; the output is plain greedy decoding's either way.
TEST_P(CudaMtpGreedy, ForcedAcceptanceCommitsSeveralTokensPerStep) {
  SKIP_WITHOUT_CUDA();
  MtpModels m = open_with_mtp(GetParam());
  const auto prompt = testing::reference_prompt(GetParam(), 17);
  const auto plain = test::greedy_tokens(*m.gpu, prompt, 24);
  testing::expect_forced_acceptance(*m.gpu, prompt, plain);
}

INSTANTIATE_TEST_SUITE_P(TinyModels, CudaMtpGreedy,
                         ::testing::Values("glm5_next", "glm5_next_clamp", "deepseek_v3", "glm4_moe",
                                           "glm_moe_dsa_h16"));

// A verify of 4 tokens cut back to 1, 2 or 3 of them goes on exactly as a plain run over those tokens (the KDA
// recurrent and conv state and the k-pool's open pool across the pool boundary at 20 restored on the device); the
// verify's logits and head inputs are the single steps'.
TEST(CudaMtpRollback, RejectedDraftsLeaveTheStateOfThePlainRun) {
  SKIP_WITHOUT_CUDA();
  for (bool graphs : {true, false}) {
    MtpModels m = open_with_mtp("glm5_next");
    m.gpu->set_use_graph(graphs);
    MtpEngine& mtp = *m.gpu->mtp();
    const auto prompt = testing::reference_prompt("glm5_next", 18);
    const std::vector<int32_t> window{5, 77, 300, 9};
    auto plain = m.gpu->new_sequence();
    std::vector<float> h;
    mtp.forward_hidden(*plain, prompt, false, false, h);
    std::vector<std::vector<float>> step_logits, step_hidden, next_logits;
    for (size_t j = 0; j < window.size(); ++j) {
      step_logits.push_back(mtp.forward_hidden(*plain, {window[j]}, false, false, h));
      step_hidden.push_back(h);
    }
    for (int64_t keep = 1; keep <= 4; ++keep) {  // the plain run's logits after `keep` window tokens, then 42
      auto p = m.gpu->new_sequence();
      m.gpu->forward(*p, prompt);
      m.gpu->forward(*p, std::vector<int32_t>(window.begin(), window.begin() + keep));
      next_logits.push_back(m.gpu->forward(*p, {42}));
    }
    const int64_t D = mtp.hidden_size();
    const size_t V = size_t(m.gpu->vocab_size());
    for (int64_t keep = 1; keep <= 4; ++keep) {
      auto seq = m.gpu->new_sequence();
      m.gpu->forward(*seq, prompt);
      std::vector<float> hidden;
      auto logits = mtp.forward_hidden(*seq, window, true, true, hidden);
      ASSERT_EQ(hidden.size(), size_t(4 * D));
      for (size_t j = 0; j < 4; ++j) {
        EXPECT_LT(
            testing::rel_l2_diff(std::vector<float>(logits.begin() + long(j * V), logits.begin() + long((j + 1) * V)),
                                 step_logits[j]),
            1e-4)
            << "graphs " << graphs << " row " << j;
        EXPECT_LT(
            testing::rel_l2_diff(std::vector<float>(hidden.begin() + long(j) * D, hidden.begin() + long(j + 1) * D),
                                 step_hidden[j]),
            1e-4)
            << "graphs " << graphs << " row " << j;
      }
      const int64_t n = int64_t(prompt.size()) + keep;
      EXPECT_GE(m.gpu->sequence_bytes(n), seq->bytes());  // the rollback points are in what admission reserves
      EXPECT_EQ(seq->resume_point(n), n);
      seq->truncate(n);
      EXPECT_EQ(seq->length(), n);
      EXPECT_LT(testing::rel_l2_diff(m.gpu->forward(*seq, {42}), next_logits[size_t(keep - 1)]), 1e-4)
          << "graphs " << graphs << " keep " << keep;
    }
  }
}

// The MTP block on the GPU against the CPU engine's (the same package): logits and chained hidden state of a prompt's
// positions, then of single chained steps.
TEST(CudaMtpForward, MatchesTheCpuEngine) {
  SKIP_WITHOUT_CUDA();
  for (const char* model : {"glm5_next", "deepseek_v3", "glm4_moe"}) {
    MtpModels m = open_with_mtp(model, true, std::string(model) == "deepseek_v3");
    MtpEngine &g = *m.gpu->mtp(), &c = *m.cpu->mtp();
    const auto prompt = testing::reference_prompt(model, 12);
    const int64_t D = g.hidden_size(), n = int64_t(prompt.size()) - 1;
    auto cseq = m.cpu->new_sequence();
    std::vector<float> hidden;
    c.forward_hidden(*cseq, prompt, false, false, hidden);  // the CPU's hidden states feed both blocks
    const std::vector<int32_t> next(prompt.begin() + 1, prompt.end());
    const std::vector<float> rows(hidden.begin(), hidden.begin() + n * D);
    auto gs = g.new_mtp_sequence(), cs = c.new_mtp_sequence();
    std::vector<float> gh, ch;
    EXPECT_LT(testing::rel_l2_diff(g.mtp_forward(*gs, next, rows, gh), c.mtp_forward(*cs, next, rows, ch)),
              kCpuTolerance)
        << model;
    EXPECT_LT(testing::rel_l2_diff(gh, ch), kCpuTolerance) << model;
    for (int32_t t : {7, 300, 12}) {  // chained steps, each fed its own block's hidden state back
      std::vector<float> gh2, ch2;
      EXPECT_LT(testing::rel_l2_diff(g.mtp_forward(*gs, {t}, gh, gh2), c.mtp_forward(*cs, {t}, ch, ch2)), kCpuTolerance)
          << model;
      gh.swap(gh2), ch.swap(ch2);
    }
    EXPECT_EQ(gs->length(), cs->length());
  }
}

TEST(CudaMtpForward, OnlyWhenAskedForAndPresent) {
  SKIP_WITHOUT_CUDA();
  CudaEngine off(ModelPackage::open(hf_tiny("glm5_next")), CudaEngineOptions{});
  EXPECT_EQ(off.mtp(), nullptr);
  CudaEngineOptions opt;
  opt.mtp = true;
  CudaEngine absent(ModelPackage::open(hf_tiny("deepseek_v3")), opt);  // num_nextn_predict_layers 1, no tensors
  EXPECT_EQ(absent.mtp(), nullptr);
  Sampler s(SamplingParams{.temperature = 0.0f});
  EXPECT_THROW(generate_speculative(absent, {1, 2, 3}, 4, s, 2), std::exception);
}

#else

TEST(CudaMtp, SkippedWithoutCudaBuild) {
  EXPECT_FALSE(cuda_available());
  GTEST_SKIP() << "built without MOESRV_CUDA";
}

#endif

}  // namespace
}  // namespace moesrv
