// Model level: an hf-tiny model quantized to EXL3 (test encoder, every projection except kv_b_proj) runs
// through the CPU engine and its logits stay close to the bf16 model's.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "backend/cpu/cpu_engine.h"
#include "format/exl3_config.h"
#include "format/exl3_convert.h"
#include "reference_util.h"

namespace moesrv {
namespace {

using namespace moesrv::testing;

struct Agreement {
  double mean_rel_l2 = 0;  // mean over rows of ||q - ref|| / ||ref||
  double top1 = 0;         // fraction of rows with the same argmax
};

Agreement compare(const std::vector<float>& q, const std::vector<float>& ref, int64_t rows, int64_t V) {
  Agreement a;
  for (int64_t r = 0; r < rows; ++r) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < V; ++i) {
      double d = double(q[size_t(r * V + i)]) - ref[size_t(r * V + i)];
      num += d * d;
      den += double(ref[size_t(r * V + i)]) * ref[size_t(r * V + i)];
    }
    a.mean_rel_l2 += std::sqrt(num / den) / double(rows);
    a.top1 += (argmax(q.data() + r * V, V) == argmax(ref.data() + r * V, V)) / double(rows);
  }
  return a;
}

// Quantizes a slice of the model (keeps the test short: the test encoder runs a 2^16-state Viterbi per tile):
// every projection of layers 0-1 except routed experts 4..15, plus lm_head at head_bits.
bool in_slice(const std::string& n) {
  if (n == "lm_head.weight") return true;
  if (!n.starts_with("model.layers.0.") && !n.starts_with("model.layers.1.")) return false;
  auto e = n.find(".experts.");
  return e == std::string::npos || std::stoi(n.substr(e + 9)) < 4;
}

bool head_only(const std::string& n) { return n == "lm_head.weight"; }

Agreement run_quantized(const std::string& model, int bits, bool (*filter)(const std::string&),
                        const std::vector<float>& ref_logits, const std::vector<int32_t>& ids, int64_t V) {
  const std::string out = (std::filesystem::temp_directory_path() /
                           ("moesrv_exl3_model_" + std::to_string(::getpid()) + "_k" + std::to_string(bits)))
                              .string();
  Exl3ConvertOptions opt;
  opt.bits = bits;
  opt.head_bits = bits;
  opt.codebook = Exl3Codebook::Mul1;
  opt.filter = filter;
  auto t0 = std::chrono::steady_clock::now();
  auto st = exl3_convert_model(hf_tiny(model), out, opt);
  std::printf("converted %s at K=%d: %d tensors quantized, %d kept, mean rel MSE %.5f, %.1f s\n", model.c_str(), bits,
              st.quantized, st.kept, st.mean_rel_mse,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  auto q = parse_exl3_config(ModelPackage::open(out)->config());
  EXPECT_TRUE(q.has_value() && q->bits == bits);
  auto engine = CpuEngine::open(out);
  auto seq = engine->new_sequence();
  auto lq = engine->forward(*seq, ids, true);
  std::filesystem::remove_all(out);
  EXPECT_EQ(lq.size(), ref_logits.size());
  Agreement a = compare(lq, ref_logits, int64_t(ids.size()), V);
  std::printf("%s EXL3 K=%d (%s) vs bf16 over %zu tokens: mean relative L2 %.4f, top-1 agreement %.3f\n",
              model.c_str(), bits, filter == head_only ? "lm_head" : "layers 0-1 + lm_head", ids.size(), a.mean_rel_l2,
              a.top1);
  return a;
}

// deepseek_v3: MLA with kv_b_proj kept bf16, padded projections (kv_a 40x128, q_b 96x64, experts 32x128).
TEST(Exl3Model, QuantizedTinyModelLogitsTrackBf16) {
  const std::string model = "deepseek_v3";
  if (!std::filesystem::exists(hf_tiny(model) + "/model.safetensors")) GTEST_SKIP() << "no test data";
  Reference ref = load_reference(model);
  auto ref_engine = CpuEngine::open(hf_tiny(model));
  const int64_t V = ref_engine->vocab_size();
  auto seq = ref_engine->new_sequence();
  auto lr = ref_engine->forward(*seq, ref.input_ids, true);
  // lm_head alone (padded 1024x128 -> no routing downstream): logit error ~ the head's weight error
  Agreement h8 = run_quantized(model, 8, head_only, lr, ref.input_ids, V);
  Agreement h4 = run_quantized(model, 4, head_only, lr, ref.input_ids, V);
  EXPECT_LT(h8.mean_rel_l2, 0.03);
  EXPECT_LT(h4.mean_rel_l2, 0.12);
  EXPECT_GE(h8.top1, 0.95);
  // Two whole layers: MoE routing (top-k over perturbed hidden states) amplifies the weight noise, so the
  // bounds are loose; K=8 must still beat K=4 clearly.
  Agreement k8 = run_quantized(model, 8, in_slice, lr, ref.input_ids, V);
  Agreement k4 = run_quantized(model, 4, in_slice, lr, ref.input_ids, V);
  EXPECT_LT(k8.mean_rel_l2, 0.15);
  EXPECT_GE(k8.top1, 0.7);
  EXPECT_LT(k4.mean_rel_l2, 0.5);
  EXPECT_LT(k8.mean_rel_l2, 0.5 * k4.mean_rel_l2);
}

}  // namespace
}  // namespace moesrv
