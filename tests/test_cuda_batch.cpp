// Several requests on one CUDA engine (the server's --max-batch: serving/batch_runner.h): members generating on their
// own threads give exactly the tokens each gives alone, while other threads create, clone, truncate and free
// sequences of the same engine (the prefix cache's work). Skipped without CUDA or a device.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "backend/cuda/cuda_engine.h"
#include "reference_util.h"
#include "serving/batch_runner.h"
#include "serving/sampler.h"

namespace moesrv {
namespace {

#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA

std::vector<int32_t> greedy_run(Engine& e, const std::vector<int32_t>& prompt, int n) {
  auto seq = e.new_sequence();
  auto logits = e.forward(*seq, prompt);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(argmax(logits));
    if (i + 1 < n) logits = e.forward(*seq, {out.back()});
  }
  return out;
}

class CudaBatch : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaBatch, ConcurrentMembersMatchEachAloneWhileOthersTouchSequences) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA backend or device";
  CudaEngineOptions opt;
  opt.max_ctx = 256;
  CudaEngine engine(ModelPackage::open(testing::hf_tiny(GetParam())), opt);
  ASSERT_TRUE(engine.concurrent_sequence_ops());
  const auto ids = testing::load_reference(GetParam()).input_ids;
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < 4; ++i)
    prompts.emplace_back(ids.begin() + long(i), ids.begin() + long(std::min(ids.size(), 9 + 5 * i)));
  std::vector<std::vector<int32_t>> alone;
  for (const auto& p : prompts) alone.push_back(greedy_run(engine, p, 14));

  BatchRunner runner(engine, 4, std::chrono::microseconds(2000));
  std::vector<std::vector<int32_t>> together(prompts.size());
  std::atomic<bool> stop{false};
  std::thread toucher([&] {  // sequence operations of other requests (prefix cache snapshots) meanwhile
    auto base = engine.new_sequence();
    engine.forward(*base, prompts[0]);
    while (!stop) {
      auto copy = base->clone();
      copy->truncate(copy->resume_point(3));
      copy->checkpoint();
      auto fresh = engine.new_sequence();
    }
  });
  std::vector<std::thread> members;
  for (size_t i = 0; i < prompts.size(); ++i)
    members.emplace_back([&, i] {
      auto m = runner.join();
      together[i] = greedy_run(*m, prompts[i], 14);
    });
  for (auto& t : members) t.join();
  stop = true;
  toucher.join();
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(together[i], alone[i]) << "request " << i;
  EXPECT_GT(runner.stats().decode_steps, 0u);
}

INSTANTIATE_TEST_SUITE_P(TinyModels, CudaBatch, ::testing::Values("glm5_next", "deepseek_v3", "qwen3_next"));

#else

TEST(CudaBatch, SkippedWithoutCudaBuild) {
  EXPECT_FALSE(cuda_available());
  GTEST_SKIP() << "built without MOESRV_CUDA";
}

#endif

}  // namespace
}  // namespace moesrv
