// Safetensors reader and model package: corrupt, truncated or inconsistent inputs fail with clear errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "backend/cpu/cpu_engine.h"
#include "format/package.h"
#include "format/safetensors.h"
#include "util/error.h"

namespace moesrv {
namespace {

namespace fs = std::filesystem;
const std::string kModel = std::string(MOESRV_TESTDATA) + "/hf-tiny/glm_moe_dsa";

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("moesrv-st-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
                                        "-" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& f) const { return (path / f).string(); }
};

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void spit(const std::string& p, const std::string& data) { std::ofstream(p, std::ios::binary) << data; }

std::string raw_file(const std::string& header) {
  uint64_t n = header.size();
  return std::string(reinterpret_cast<const char*>(&n), 8) + header;
}

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    FAIL() << "expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Safetensors, RoundTripWriteRead) {
  TempDir d;
  std::vector<uint16_t> a = {0x3f80, 0x4000, 0xbf80, 0x0000, 0x4040, 0x4080};  // bf16 1, 2, -1, 0, 3, 4
  std::vector<float> b = {0.5f, -0.25f};
  write_safetensors(d / "x.safetensors",
                    {{"a", DType::BF16, {2, 3}, reinterpret_cast<const uint8_t*>(a.data()), 12},
                     {"b", DType::F32, {2}, reinterpret_cast<const uint8_t*>(b.data()), 8}},
                    {{"format", "pt"}});
  auto f = SafetensorsFile::open(d / "x.safetensors");
  ASSERT_EQ(f->tensors().size(), 2u);
  EXPECT_EQ(f->find("a")->to_f32(), (std::vector<float>{1, 2, -1, 0, 3, 4}));
  EXPECT_EQ(f->find("b")->to_f32(), b);
  EXPECT_EQ(f->metadata().at("format"), "pt");
}

TEST(Safetensors, TruncatedShardIsReported) {
  TempDir d;
  std::string data = slurp(kModel + "/model.safetensors");
  spit(d / "cut.safetensors", data.substr(0, data.size() / 2));
  expect_error([&] { SafetensorsFile::open(d / "cut.safetensors"); }, "truncated");
  spit(d / "tiny.safetensors", "abc");
  expect_error([&] { SafetensorsFile::open(d / "tiny.safetensors"); }, "truncated");
  spit(d / "hdr.safetensors", raw_file("{\"a\": 1").substr(0, 10));
  expect_error([&] { SafetensorsFile::open(d / "hdr.safetensors"); }, "truncated");
}

TEST(Safetensors, CorruptHeadersAreRejected) {
  TempDir d;
  spit(d / "json.safetensors", raw_file("{not json}"));
  expect_error([&] { SafetensorsFile::open(d / "json.safetensors"); }, "not valid JSON");
  spit(d / "dtype.safetensors", raw_file(R"({"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})") + "x");
  expect_error([&] { SafetensorsFile::open(d / "dtype.safetensors"); }, "unknown dtype");
  spit(d / "size.safetensors", raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})") + "abcd");
  expect_error([&] { SafetensorsFile::open(d / "size.safetensors"); }, "needs 8 bytes");
  // Dimensions whose byte count wraps 64 bits to 0 (it passed as a 0-byte tensor before).
  for (const char* shape : {"[4294967296,4294967296]", "[4611686018427387904]"}) {
    const std::string h = std::string(R"({"w":{"dtype":"F32","shape":)") + shape + R"(,"data_offsets":[0,0]}})";
    spit(d / "wrap.safetensors", raw_file(h));
    expect_error([&] { SafetensorsFile::open(d / "wrap.safetensors"); }, "more bytes than 64 bits can count");
  }
  spit(d / "range.safetensors", raw_file(R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})") + "abcd");
  expect_error([&] { SafetensorsFile::open(d / "range.safetensors"); }, "truncated or corrupt");
  spit(d / "overlap.safetensors",
       raw_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})") + "abcdef");
  expect_error([&] { SafetensorsFile::open(d / "overlap.safetensors"); }, "overlap");
  spit(d / "shape.safetensors", raw_file(R"({"w":{"dtype":"U8","shape":"x","data_offsets":[0,1]}})") + "a");
  expect_error([&] { SafetensorsFile::open(d / "shape.safetensors"); }, "corrupt header entry");
  // Numbers that are not whole non-negative integers (a 9e61 offset was converted with undefined behaviour).
  for (const char* entry :
       {R"("shape":[2],"data_offsets":[0,89999999999999999999999999999999999999999])",
        R"("shape":[2],"data_offsets":[0,8.5])", R"("shape":[-2],"data_offsets":[0,8])",
        R"("shape":[2.0],"data_offsets":[0,8])", R"("shape":[9223372036854775808],"data_offsets":[0,8])"}) {
    spit(d / "num.safetensors", raw_file(std::string(R"({"w":{"dtype":"F32",)") + entry + "}}") + "abcdefgh");
    expect_error([&] { SafetensorsFile::open(d / "num.safetensors"); }, "corrupt header entry");
  }
}

TEST(Package, MissingRequiredTensorIsNamed) {
  TempDir d;
  fs::copy_file(kModel + "/config.json", d / "config.json");
  auto src = SafetensorsFile::open(kModel + "/model.safetensors");
  std::vector<TensorView> keep;
  for (const auto& [name, t] : src->tensors())
    if (name != "model.layers.3.self_attn.indexer.wk.weight") keep.push_back(t);
  write_safetensors(d / "model.safetensors", keep);
  expect_error([&] { CpuEngine::open(d.path.string()); }, "missing:\n  model.layers.3.self_attn.indexer.wk.weight (layer 3)");
}

TEST(Package, IndexNamingAMissingShardFails) {
  TempDir d;
  fs::copy_file(kModel + "/config.json", d / "config.json");
  spit(d / "model.safetensors.index.json", R"({"weight_map":{"lm_head.weight":"model-00002-of-00002.safetensors"}})");
  expect_error([&] { ModelPackage::open(d.path.string()); }, "model-00002-of-00002.safetensors");
  // An index naming a file outside the model folder is refused before anything is opened.
  for (const char* file : {"../model.safetensors", "/etc/passwd", ".."}) {
    spit(d / "model.safetensors.index.json", std::string(R"({"weight_map":{"lm_head.weight":")") + file + R"("}})");
    expect_error([&] { ModelPackage::open(d.path.string()); }, "not a file in the model folder");
  }
}

TEST(Package, UnindexedTensorIsNotSilentlyUsed) {
  // An aux shard holds the indexer weights but the index forgets them: loading must say so and point to repair.
  TempDir d;
  fs::copy_file(kModel + "/config.json", d / "config.json");
  auto src = SafetensorsFile::open(kModel + "/model.safetensors");
  std::vector<TensorView> main, aux;
  nlohmann::json index = {{"metadata", nlohmann::json::object()}, {"weight_map", nlohmann::json::object()}};
  for (const auto& [name, t] : src->tensors()) {
    bool idx = name.find(".indexer.") != std::string::npos;
    (idx ? aux : main).push_back(t);
    if (!idx) index["weight_map"][name] = "model-00001-of-00001.safetensors";
  }
  write_safetensors(d / "model-00001-of-00001.safetensors", main);
  write_safetensors(d / "model-aux.safetensors", aux);
  spit(d / "model.safetensors.index.json", index.dump());
  auto pkg = ModelPackage::open(d.path.string());
  EXPECT_FALSE(pkg->unindexed().empty());
  EXPECT_FALSE(pkg->has("model.layers.0.self_attn.indexer.wk.weight"));
  expect_error([&] { CpuEngine::open(d.path.string()); }, "repair-index");
}

TEST(Package, ShardedPackageServesTheSameModel) {
  TempDir d;
  fs::copy_file(kModel + "/config.json", d / "config.json");
  auto src = SafetensorsFile::open(kModel + "/model.safetensors");
  std::vector<TensorView> a, b;
  nlohmann::json index = {{"weight_map", nlohmann::json::object()}};
  int i = 0;
  for (const auto& [name, t] : src->tensors()) {
    bool first = (i++ % 2) == 0;
    (first ? a : b).push_back(t);
    index["weight_map"][name] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  write_safetensors(d / "model-00001-of-00002.safetensors", a);
  write_safetensors(d / "model-00002-of-00002.safetensors", b);
  spit(d / "model.safetensors.index.json", index.dump());
  auto sharded = CpuEngine::open(d.path.string());
  auto single = CpuEngine::open(kModel);
  auto s1 = sharded->new_sequence(), s2 = single->new_sequence();
  EXPECT_EQ(sharded->forward(*s1, {1, 2, 3, 4}), single->forward(*s2, {1, 2, 3, 4}));
}

TEST(Config, BadConfigsAreClearErrors) {
  nlohmann::json c = read_json_file(kModel + "/config.json");
  c["model_type"] = "llama";
  expect_error([&] { ModelSpec::from_json(c); }, "not supported");
  c = read_json_file(kModel + "/config.json");
  c.erase("kv_lora_rank");
  expect_error([&] { ModelSpec::from_json(c); }, "kv_lora_rank");
  c = read_json_file(kModel + "/config.json");
  c["hidden_size"] = "wide";
  expect_error([&] { ModelSpec::from_json(c); }, "wrong type");
}

TEST(Engine, RejectsOutOfVocabTokensAndOverlongContext) {
  auto engine = CpuEngine::open(kModel);
  auto seq = engine->new_sequence();
  expect_error([&] { engine->forward(*seq, {5, 99999}); }, "outside vocabulary");
  EXPECT_EQ(seq->length(), 0);
  std::vector<int32_t> huge(size_t(engine->max_context() + 1), 3);
  expect_error([&] { engine->forward(*seq, huge); }, "context length exceeded");
}

}  // namespace
}  // namespace moesrv
