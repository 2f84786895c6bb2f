// A copy of an hf-tiny model with an MTP block added (header-only): config.json gains num_nextn_predict_layers 1, a
// second shard mtp.safetensors holds layer num_hidden_layers in the checkpoint's own naming (model/manifest.h's
// mtp_manifest), random bf16 weights from a fixed seed; the model's own shard is linked, not copied.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "format/package.h"
#include "format/safetensors.h"
#include "model/manifest.h"
#include "util/numeric.h"

namespace moesrv::testing {

// with_head: also write shared_head.head (else the block uses the model's lm_head).
inline std::string copy_with_mtp(const std::string& src_dir, const std::string& tag, uint64_t seed, bool with_head) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("moesrv_mtp_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  nlohmann::json config = read_json_file(src_dir + "/config.json");
  nlohmann::json& text = config.contains("text_config") ? config["text_config"] : config;
  text["num_nextn_predict_layers"] = 1;
  std::ofstream(dir / "config.json") << config.dump(2);
  fs::create_symlink(fs::absolute(fs::path(src_dir) / "model.safetensors"), dir / "model.safetensors");

  const ModelSpec spec = ModelSpec::from_json(config);
  auto src = SafetensorsFile::open(src_dir + "/model.safetensors");
  const std::string root = src->find("model.language_model.embed_tokens.weight") ? "model.language_model." : "model.";
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.08f);
  std::vector<std::vector<uint16_t>> data;
  std::vector<TensorView> views;
  for (const TensorEntry& e : mtp_manifest(spec, root)) {
    if (e.optional && e.name.find("shared_head.head") != std::string::npos && !with_head) continue;
    auto& buf = data.emplace_back(size_t(e.numel()));
    for (uint16_t& v : buf)
      v = f32_to_bf16(e.init == TensorInit::Ones ? 1.0f : e.init == TensorInit::Zeros ? 0.0f : normal(rng));
    TensorView t;
    t.name = e.name;
    t.dtype = DType::BF16;
    t.shape = e.shape;
    t.data = reinterpret_cast<const uint8_t*>(buf.data());
    t.nbytes = buf.size() * sizeof(uint16_t);
    views.push_back(t);
  }
  write_safetensors((dir / "mtp.safetensors").string(), views);
  return dir.string();
}

}  // namespace moesrv::testing
