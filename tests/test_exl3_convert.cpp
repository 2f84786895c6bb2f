// EXL3 model conversion (test encoder) and config parsing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "backend/cpu/exl3_linear.h"
#include "format/exl3_config.h"
#include "format/exl3_convert.h"
#include "util/error.h"

using namespace moesrv;

TEST(Exl3Config, ParsesExllamav3QuantizationConfig) {
  auto cfg = nlohmann::json::parse(R"({"model_type": "glm4_moe", "quantization_config": {
      "quant_method": "exl3", "version": "1.4.4", "bits": 2.05, "head_bits": 5, "mtp_bits": 2,
      "codebook": "mul1", "out_scales": "always", "calibration": {"rows": 250, "cols": 2048}}})");
  auto q = parse_exl3_config(cfg);
  ASSERT_TRUE(q.has_value());
  EXPECT_DOUBLE_EQ(q->bits, 2.05);
  EXPECT_EQ(q->head_bits, 5);
  EXPECT_EQ(q->codebook, Exl3Codebook::Mul1);
  EXPECT_EQ(q->version, "1.4.4");
  EXPECT_EQ(q->out_scales, "always");
  EXPECT_EQ(exl3_config_json(*q)["calibration"]["rows"], 250);

  EXPECT_FALSE(parse_exl3_config(nlohmann::json::parse(R"({"model_type": "x"})")).has_value());
  EXPECT_FALSE(parse_exl3_config(nlohmann::json::parse(R"({"quantization_config": {"quant_method": "fp8"}})")));
  auto old = parse_exl3_config(nlohmann::json::parse(R"({"quantization_config": {"quant_method": "exl3", "bits": 4}})"));
  ASSERT_TRUE(old.has_value());
  EXPECT_EQ(old->codebook, Exl3Codebook::Inst3);  // configs older than the codebook key
  EXPECT_THROW(parse_exl3_config(nlohmann::json::parse(R"({"quantization_config": {"quant_method": "exl3"}})")), Error);
  EXPECT_THROW(parse_exl3_config(nlohmann::json::parse(
                   R"({"quantization_config": {"quant_method": "exl3", "bits": 3, "codebook": "zzz"}})")),
               Error);
}

TEST(Exl3Convert, TensorSelection) {
  TensorView m2, m1, m3;
  m2.shape = {32, 128};
  m1.shape = {128};
  m3.shape = {8192, 1, 4};
  EXPECT_TRUE(exl3_should_quantize("model.layers.1.mlp.experts.3.gate_proj.weight", m2));
  EXPECT_TRUE(exl3_should_quantize("model.layers.0.self_attn.q_a_proj.weight", m2));
  EXPECT_TRUE(exl3_should_quantize("model.layers.0.linear_attn.in_proj_qkvz.weight", m2));
  EXPECT_TRUE(exl3_should_quantize("model.layers.1.mlp.shared_experts.down_proj.weight", m2));
  EXPECT_TRUE(exl3_should_quantize("lm_head.weight", m2));
  EXPECT_FALSE(exl3_should_quantize("model.layers.0.self_attn.kv_b_proj.weight", m2));
  EXPECT_FALSE(exl3_should_quantize("model.layers.1.mlp.gate.weight", m2));
  EXPECT_FALSE(exl3_should_quantize("model.layers.1.mlp.shared_expert_gate.weight", m2));
  EXPECT_FALSE(exl3_should_quantize("model.embed_tokens.weight", m2));
  EXPECT_FALSE(exl3_should_quantize("model.layers.1.mlp.gate.e_score_correction_bias", m1));
  EXPECT_FALSE(exl3_should_quantize("model.layers.0.q_proj.bias", m1));
  EXPECT_FALSE(exl3_should_quantize("model.layers.0.linear_attn.conv1d.weight", m3));
  EXPECT_FALSE(exl3_should_quantize("model.layers.0.self_attn.indexer.weights_proj.weight", m2));
}

TEST(Exl3Convert, TinyModelLayersQuantizeAndLoadWithLogicalShapes) {
  const std::string src = std::string(MOESRV_TESTDATA) + "/hf-tiny/glm4_moe";
  if (!std::filesystem::exists(src + "/model.safetensors")) GTEST_SKIP() << "no test data at " << src;
  const std::string out = (std::filesystem::temp_directory_path() / ("moesrv_exl3_conv_" + std::to_string(::getpid()))).string();
  Exl3ConvertOptions opt;
  opt.bits = 4;
  opt.codebook = Exl3Codebook::Mul1;
  // a slice of the model keeps the test fast: two experts, one attention projection (with bias), the head
  opt.filter = [](const std::string& n) {
    return n.starts_with("model.layers.1.mlp.experts.0.") || n == "model.layers.1.mlp.experts.1.down_proj.weight" ||
           n == "model.layers.0.self_attn.q_proj.weight" || n == "lm_head.weight";
  };
  auto st = exl3_convert_model(src, out, opt);
  EXPECT_EQ(st.quantized, 6);
  auto in_pkg = ModelPackage::open(src), q_pkg = ModelPackage::open(out);
  auto q = parse_exl3_config(q_pkg->config());
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->bits, 4);
  EXPECT_EQ(q->codebook, Exl3Codebook::Mul1);
  EXPECT_FALSE(q_pkg->has("model.layers.1.mlp.experts.0.gate_proj.weight"));
  EXPECT_TRUE(q_pkg->has("model.layers.1.mlp.experts.0.gate_proj.mul1"));
  // kept tensors are byte-identical
  for (const char* n : {"model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
                        "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.experts.2.up_proj.weight"}) {
    const auto &a = in_pkg->require(n), &b = q_pkg->require(n);
    ASSERT_EQ(a.nbytes, b.nbytes) << n;
    EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes), 0) << n;
  }
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (const char* p : {"model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.experts.0.down_proj",
                        "model.layers.0.self_attn.q_proj", "lm_head"}) {
    auto dense = load_linear(*in_pkg, p), ql = load_linear(*q_pkg, p);
    ASSERT_EQ(ql->kind(), std::string(p) == "lm_head" ? "exl3-k6-mul1" : "exl3-k4-mul1") << p;
    ASSERT_EQ(ql->in_features(), dense->in_features()) << p;
    ASSERT_EQ(ql->out_features(), dense->out_features()) << p;
    const int64_t n = 4;
    std::vector<float> x(size_t(n * dense->in_features()));
    for (auto& v : x) v = nd(rng);
    std::vector<float> yd(size_t(n * dense->out_features())), yq(yd.size());
    dense->forward(x.data(), n, yd.data());
    ql->forward(x.data(), n, yq.data());
    double num = 0, den = 0;
    for (size_t i = 0; i < yd.size(); ++i) {
      num += (double(yd[i]) - yq[i]) * (double(yd[i]) - yq[i]);
      den += double(yd[i]) * yd[i];
    }
    printf("%s: output relative MSE %.5f\n", p, num / den);
    EXPECT_LT(num / den, std::string(p) == "lm_head" ? 0.004 : 0.02) << p;
  }
  std::filesystem::remove_all(out);
}
