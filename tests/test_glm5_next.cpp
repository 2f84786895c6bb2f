// GLM-5.3-Flash (glm5_next) beyond the two reference files: other configs of the architecture checked for
// self-consistency (incremental == full, resume == replay, pipeline == single engine), checkpoint layouts (flat,
// sharded, MTP, the upstream index quirk), clear errors, and prefix reuse of recurrent state.
#include <gtest/gtest.h>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <tuple>

#include "backend/cpu/cpu_engine.h"
#include "format/index_repair.h"
#include "format/lock.h"
#include "format/safetensors.h"
#include "glm5_next_variants.h"
#include "model/synthetic_model.h"
#include "reference_util.h"
#include "runtime/pipeline_cpu_stage.h"
#include "serving/prefix_cache.h"
#include "util/error.h"

namespace moesrv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace moesrv::testing;

double rows_error(const std::vector<float>& a, const std::vector<float>& b, int64_t V) {
  EXPECT_EQ(a.size(), b.size());
  return max_rel_row_error(a.data(), b.data(), int64_t(std::min(a.size(), b.size())) / V, V);
}

std::vector<int32_t> some_tokens(int64_t n, int64_t vocab, uint32_t seed) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(int32_t((seed = seed * 1664525u + 1013904223u) >> 8) % int32_t(vocab));
  return t;
}

using Variant = Glm5NextConfigVariant;

class Glm5NextVariant : public ::testing::TestWithParam<Variant> {};

json variant_config(const Variant& v) { return glm5_next_variant_config(v); }

// Incremental decode (prefill, then single tokens, then a multi-token continuation) equals one full forward.
TEST_P(Glm5NextVariant, IncrementalMatchesFullForward) {
  auto engine = std::make_shared<CpuEngine>(make_synthetic_model(variant_config(GetParam()), {.seed = 7, .stddev = 0.05f}));
  const int64_t V = engine->vocab_size();
  const auto ids = some_tokens(150, V, 11);
  auto full_seq = engine->new_sequence();
  const auto full = engine->forward(*full_seq, ids, true);

  auto seq = engine->new_sequence();
  std::vector<float> inc = engine->forward(*seq, {ids.begin(), ids.begin() + 70}, true);
  for (int64_t i = 70; i < 90; ++i) {
    auto l = engine->forward(*seq, {ids[size_t(i)]});
    inc.insert(inc.end(), l.begin(), l.end());
  }
  auto rest = engine->forward(*seq, {ids.begin() + 90, ids.end()}, true);
  inc.insert(inc.end(), rest.begin(), rest.end());
  EXPECT_LE(rows_error(inc, full, V), 1e-4) << GetParam().name;
}

// Cutting back to a checkpoint (the end of a prefill) and replaying gives bit-identical logits; a clone too.
TEST_P(Glm5NextVariant, ResumeFromCheckpointReplaysIdentically) {
  auto engine = std::make_shared<CpuEngine>(make_synthetic_model(variant_config(GetParam()), {.seed = 3, .stddev = 0.05f}));
  const auto ids = some_tokens(100, engine->vocab_size(), 5);
  auto seq = engine->new_sequence();
  engine->forward(*seq, {ids.begin(), ids.begin() + 67});
  EXPECT_EQ(seq->resume_point(67), 67);
  EXPECT_LT(seq->resume_point(66), 66);  // no checkpoint there: the recurrent state cannot rewind to 66
  auto snapshot = seq->clone();
  std::vector<float> first;
  for (int64_t i = 67; i < 80; ++i) first = engine->forward(*seq, {ids[size_t(i)]});
  seq->truncate(67);
  std::vector<float> again, from_clone;
  for (int64_t i = 67; i < 80; ++i) {
    again = engine->forward(*seq, {ids[size_t(i)]});
    from_clone = engine->forward(*snapshot, {ids[size_t(i)]});
  }
  EXPECT_EQ(first, again);
  EXPECT_EQ(first, from_clone);
  EXPECT_THROW(seq->truncate(70), Error);
}

// Pipeline stages over layer ranges (the residual streams and the DSA selection travel between stages) give
// the single engine's logits bit for bit.
TEST_P(Glm5NextVariant, PipelineStagesEqualSingleEngine) {
  auto engine = std::make_shared<CpuEngine>(make_synthetic_model(variant_config(GetParam()), {.seed = 5, .stddev = 0.05f}));
  const auto ids = some_tokens(40, engine->vocab_size(), 9);
  auto pipe = make_cpu_pipeline(engine, {3, 5});
  auto a = engine->new_sequence();
  auto b = pipe->new_sequence();
  EXPECT_EQ(engine->forward(*a, ids, true), pipe->forward(*b, ids, true));
  for (int32_t t : {5, 17, 42}) EXPECT_EQ(engine->forward(*a, {t}), pipe->forward(*b, {t}));
}

INSTANTIATE_TEST_SUITE_P(Configs, Glm5NextVariant, ::testing::ValuesIn(glm5_next_variants()),
                         [](const auto& info) { return std::string(info.param.name); });

// A follow-up request that shares a prefix resumes from the recurrent-state checkpoint at the end of the
// first prompt and gives the same logits (and greedy tokens) as a cold request.
TEST(Glm5NextPrefixCache, FollowUpReusesCheckpointAndMatchesCold) {
  auto engine = CpuEngine::open(hf_tiny("glm5_next"));
  Reference ref = load_reference("glm5_next");
  const int64_t V = engine->vocab_size();
  PrefixCache cache(size_t(1) << 30);
  std::vector<int32_t> first(ref.input_ids.begin(), ref.input_ids.begin() + 100);
  auto seq = engine->new_sequence();
  auto logits = engine->forward(*seq, first);
  std::vector<int32_t> history = first;
  for (int i = 0; i < 4; ++i) {
    history.push_back(argmax(logits.data(), V));
    logits = engine->forward(*seq, {history.back()});
  }
  cache.insert(history, std::move(seq));

  // Next turn: the first prompt + two of the answer's tokens + new text.
  std::vector<int32_t> follow(history.begin(), history.begin() + 102);
  follow.insert(follow.end(), ref.input_ids.begin() + 100, ref.input_ids.begin() + 130);
  auto hit = cache.acquire(follow, int64_t(follow.size()) - 1);
  ASSERT_TRUE(hit.state);
  EXPECT_EQ(hit.reused, 100);  // the checkpoint, not the 102-token match
  auto warm = engine->forward(*hit.state, {follow.begin() + hit.reused, follow.end()}, true);
  auto cold_seq = engine->new_sequence();
  auto cold = engine->forward(*cold_seq, follow, true);
  const std::vector<float> cold_tail(cold.end() - int64_t(follow.size() - 100) * V, cold.end());
  EXPECT_LE(rows_error(warm, cold_tail, V), 1e-4);
  EXPECT_EQ(argmax(warm.data() + warm.size() - V, V), argmax(cold.data() + cold.size() - V, V));
}

// A prompt longer than the CPU engine's checkpoint interval (2048): the prefill is cut at the interval, the
// recurrent state carried across the cut, and a follow-up request resumes from the checkpoint taken at the cut.
// Full forward == two chunks straddling the cut == cached prefix + rest, and decode continues identically.
TEST(Glm5NextPrefixCache, PromptAcrossTheCheckpointIntervalResumesThere) {
  auto engine = CpuEngine::open(hf_tiny("glm5_next"));
  const int64_t V = engine->vocab_size(), I = CpuEngine::kCheckpointInterval, N = I + 60;
  std::vector<int32_t> prompt(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) prompt[size_t(i)] = int32_t((i * 7919 + 13) % V);
  auto full_seq = engine->new_sequence();
  const auto full = engine->forward(*full_seq, prompt, true);
  auto chunked_seq = engine->new_sequence();
  engine->forward(*chunked_seq, {prompt.begin(), prompt.begin() + I - 500});
  const auto tail = engine->forward(*chunked_seq, {prompt.begin() + I - 500, prompt.end()}, true);
  const std::vector<float> full_tail(full.end() - int64_t(tail.size()), full.end());
  EXPECT_LE(rows_error(tail, full_tail, V), 1e-4);

  PrefixCache cache(size_t(1) << 30);
  cache.insert(prompt, std::move(full_seq));
  std::vector<int32_t> follow(prompt.begin(), prompt.begin() + I + 20);
  for (int i = 0; i < 30; ++i) follow.push_back(int32_t((i * 31 + 5) % V));
  auto hit = cache.acquire(follow, int64_t(follow.size()) - 1);
  ASSERT_TRUE(hit.state);
  EXPECT_EQ(hit.reused, I);  // the checkpoint at the cut, not the (I + 20)-token match
  const auto warm = engine->forward(*hit.state, {follow.begin() + hit.reused, follow.end()}, true);
  auto cold_seq = engine->new_sequence();
  const auto cold = engine->forward(*cold_seq, follow, true);
  const std::vector<float> cold_tail(cold.end() - int64_t(warm.size()), cold.end());
  EXPECT_LE(rows_error(warm, cold_tail, V), 1e-4);
  const int32_t next = argmax(cold.data() + cold.size() - V, V);
  EXPECT_EQ(argmax(warm.data() + warm.size() - V, V), next);
  EXPECT_LE(rows_error(engine->forward(*hit.state, {next}), engine->forward(*cold_seq, {next}), V), 1e-4);
}

// Writes the tiny glm5_next checkpoint into `dir` in another layout. rename(name) -> "" drops a tensor;
// shard(name) picks the file.
void rewrite_package(const std::string& dir, const json& config, const std::function<std::string(const std::string&)>& rename,
                     const std::function<std::string(const std::string&)>& shard, bool index = true,
                     const std::vector<std::string>& unindexed_shards = {}) {
  fs::create_directories(dir);
  auto src = SafetensorsFile::open(hf_tiny("glm5_next") + "/model.safetensors");
  std::map<std::string, std::vector<TensorView>> files;
  json weight_map = json::object();
  for (const auto& [name, view] : src->tensors()) {
    std::string to = rename(name);
    if (to.empty()) continue;
    TensorView t = view;
    t.name = to;
    const std::string file = shard(to);
    files[file].push_back(t);
    if (std::find(unindexed_shards.begin(), unindexed_shards.end(), file) == unindexed_shards.end()) weight_map[to] = file;
  }
  for (const auto& [file, tensors] : files) write_safetensors(dir + "/" + file, tensors);
  std::ofstream(dir + "/config.json") << config.dump(2);
  if (index) std::ofstream(dir + "/" + kIndexFileName) << json{{"metadata", json::object()}, {"weight_map", weight_map}}.dump(2);
}

std::string temp_dir(const std::string& name) {
  auto d = fs::temp_directory_path() / ("moesrv_glm5_next_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  return d.string();
}

json nested_config() { return read_json_file(hf_tiny("glm5_next") + "/config.json"); }

// Flat (text-only) layout in two shards, with an MTP block at layer num_hidden_layers: same logits as nested.
TEST(Glm5NextLayout, FlatTwoShardsWithMtpMatchesNested) {
  const std::string dir = temp_dir("flat");
  json flat = nested_config()["text_config"];
  flat["model_type"] = "glm5_next";
  int count = 0;
  rewrite_package(
      dir, flat,
      [](const std::string& n) -> std::string {
        if (n.rfind("model.visual.", 0) == 0) return "";
        if (n.rfind("model.language_model.", 0) == 0) return "model." + n.substr(21);
        return n;
      },
      [&](const std::string&) { return ++count % 2 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors"; });
  // An MTP block: layer 8 (a copy of layer 7's tensors) must be ignored by the forward pass.
  {
    auto src = SafetensorsFile::open(hf_tiny("glm5_next") + "/model.safetensors");
    std::vector<TensorView> mtp;
    for (const auto& [n, view] : src->tensors())
      if (n.rfind("model.language_model.layers.7.", 0) == 0) {
        TensorView t = view;
        t.name = "model.layers.8." + n.substr(std::string("model.language_model.layers.7.").size());
        mtp.push_back(t);
      }
    write_safetensors(dir + "/mtp.safetensors", mtp);
    json idx = read_json_file(dir + "/" + kIndexFileName);
    for (const auto& t : mtp) idx["weight_map"][t.name] = "mtp.safetensors";
    std::ofstream(dir + "/" + kIndexFileName) << idx.dump(2);
  }
  auto flat_engine = CpuEngine::open(dir);
  auto nested_engine = CpuEngine::open(hf_tiny("glm5_next"));
  EXPECT_EQ(flat_engine->weights().root, "model.");
  EXPECT_EQ(nested_engine->weights().root, "model.language_model.");
  EXPECT_EQ(flat_engine->weights().mtp.size(), 75u);  // every tensor of the copied layer 7
  EXPECT_TRUE(nested_engine->weights().mtp.empty());
  Reference ref = load_reference("glm5_next");
  auto a = flat_engine->new_sequence();
  auto b = nested_engine->new_sequence();
  EXPECT_EQ(flat_engine->forward(*a, ref.input_ids, true), nested_engine->forward(*b, ref.input_ids, true));
  fs::remove_all(dir);
}

// The upstream package's quirk: the k-pool tensors sit in kpool_aux.safetensors, absent from the index. Loading
// refuses and names every one of them (and repair-index); after the repair (checked against the lock) it
// runs and matches the reference.
TEST(Glm5NextLayout, UnindexedKpoolTensorsRefusedThenRepaired) {
  const std::string dir = temp_dir("kpool_aux");
  auto is_kpool = [](const std::string& n) { return n.find("index_kpool_compress_") != std::string::npos; };
  rewrite_package(
      dir, nested_config(), [](const std::string& n) { return n; },
      [&](const std::string& n) { return is_kpool(n) ? "kpool_aux.safetensors" : "model.safetensors"; }, true,
      {"kpool_aux.safetensors"});
  write_package_lock(dir, {.threads = 1, .progress = false});
  try {
    CpuEngine::open(dir);
    ADD_FAILURE() << "loading should refuse unindexed k-pool tensors";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("4 tensor(s)"), std::string::npos) << msg;
    for (int layer : {3, 7})
      for (const char* t : {"index_kpool_compress_ape", "index_kpool_compress_gate"})
        EXPECT_NE(msg.find(fmt::format("layers.{}.self_attn.indexer.{}", layer, t)), std::string::npos) << msg;
    EXPECT_NE(msg.find("moesrv repair-index"), std::string::npos) << msg;
  }
  RepairReport report = repair_index(dir, {.progress = false});
  EXPECT_EQ(report.added.size(), 4u);
  EXPECT_TRUE(report.lock_updated) << report.lock_note;
  auto engine = CpuEngine::open(dir);
  Reference ref = load_reference("glm5_next");
  auto seq = engine->new_sequence();
  auto logits = engine->forward(*seq, ref.input_ids, true);
  EXPECT_LE(rows_error(logits, ref.logits, engine->vocab_size()), 2e-3);
  fs::remove_all(dir);
}

// mlp_layer_types and indexer_types take only their known values: anything else is refused with the entry named
// (transformers would silently build a dense MLP for an unknown mlp_layer_types value).
TEST(Glm5NextErrors, UnknownMlpAndIndexerTypesAreNamed) {
  const std::vector<std::tuple<const char*, int, const char*, const char*>> cases = {
      {"mlp_layer_types", 4, "moe", "mlp_layer_types[4] is moe (dense, sparse)"},
      {"mlp_layer_types", 0, "Dense", "mlp_layer_types[0] is Dense (dense, sparse)"},
      {"indexer_types", 7, "skip", "indexer_types[7] is skip (full, shared)"}};
  for (const auto& [key, index, value, expected] : cases) {
    json bad = nested_config();
    bad["text_config"][key][index] = value;
    try {
      ModelSpec::from_json(bad);
      ADD_FAILURE() << key << " " << value << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
}

TEST(Glm5NextErrors, UnknownLayerTypeAndMissingTensorsAreNamed) {
  json bad = nested_config();
  bad["text_config"]["layer_types"][2] = "mamba2";
  try {
    ModelSpec::from_json(bad);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer_types[2] is mamba2"), std::string::npos) << e.what();
  }
  const std::string dir = temp_dir("missing");
  rewrite_package(
      dir, nested_config(),
      [](const std::string& n) { return n.find("layers.5.self_attn.f_b_proj") != std::string::npos || n.find("layers.7.hc_ffn_fn") != std::string::npos ? std::string() : n; },
      [](const std::string&) { return "model.safetensors"; });
  try {
    CpuEngine::open(dir);
    ADD_FAILURE();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("model.language_model.layers.5.self_attn.f_b_proj.weight (layer 5)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.language_model.layers.7.hc_ffn_fn (layer 7)"), std::string::npos) << msg;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moesrv
