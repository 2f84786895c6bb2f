#include "format/package.h"

#include <filesystem>
#include <fstream>

#include "util/error.h"

namespace moesrv {

namespace fs = std::filesystem;
using json = nlohmann::json;

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("{}: cannot open", path);
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", path, e.what());
  }
}

std::shared_ptr<ModelPackage> ModelPackage::open(const std::string& dir) {
  auto p = std::make_shared<ModelPackage>();
  p->dir_ = dir;
  if (!fs::is_directory(dir)) fail("model directory {} does not exist", dir);
  fs::path cfg = fs::path(dir) / "config.json";
  if (!fs::exists(cfg)) fail("{}: no config.json", dir);
  p->config_ = read_json_file(cfg.string());

  fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::map<std::string, std::string> weight_map;
  if (fs::exists(index)) {
    p->has_index_ = true;
    json j = read_json_file(index.string());
    if (!j.contains("weight_map") || !j["weight_map"].is_object()) fail("{}: no weight_map object", index.string());
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it->is_string()) fail("{}: weight_map entry {} is not a file name", index.string(), it.key());
      const std::string file = it->get<std::string>();
      // A shard is a plain file name inside the model folder (no path: a downloaded index must not reach elsewhere).
      if (file.empty() || file.find('/') != std::string::npos || file.find('\\') != std::string::npos || file == "." ||
          file == "..")
        fail("{}: weight_map entry {} names {}, not a file in the model folder", index.string(), it.key(), file);
      weight_map[it.key()] = file;
    }
    for (const auto& [name, file] : weight_map) {
      if (!p->shards_.count(file)) {
        fs::path shard = fs::path(dir) / file;
        if (!fs::exists(shard)) fail("{}: shard {} named by the index (tensor {}) is missing", dir, file, name);
        p->shards_[file] = SafetensorsFile::open(shard.string());
      }
      const TensorView* t = p->shards_[file]->find(name);
      if (!t) fail("{}: the index places tensor {} in {}, but that shard does not contain it", dir, name, file);
      p->tensors_[name] = t;
    }
    // Shards in the folder the index never mentions may still hold tensors (e.g. an aux shard of DSA indexer weights).
    for (const auto& e : fs::directory_iterator(dir)) {
      auto fname = e.path().filename().string();
      if (e.path().extension() == ".safetensors" && !p->shards_.count(fname) && fname != "reference.safetensors")
        p->shards_[fname] = SafetensorsFile::open(e.path().string());
    }
    for (const auto& [file, shard] : p->shards_)
      for (const auto& [name, t] : shard->tensors())
        if (!weight_map.count(name)) p->unindexed_[name] = file;
  } else {
    for (const auto& e : fs::directory_iterator(dir)) {
      auto fname = e.path().filename().string();
      if (e.path().extension() == ".safetensors" && fname != "reference.safetensors")
        p->shards_[fname] = SafetensorsFile::open(e.path().string());
    }
    if (p->shards_.empty()) fail("{}: no *.safetensors files", dir);
    for (const auto& [file, shard] : p->shards_)
      for (const auto& [name, t] : shard->tensors()) {
        if (p->tensors_.count(name)) fail("{}: tensor {} appears in more than one shard", dir, name);
        p->tensors_[name] = &t;
      }
  }
  return p;
}

std::shared_ptr<ModelPackage> ModelPackage::from_memory(json config, std::vector<TensorView> tensors,
                                                       std::shared_ptr<const void> owner, std::string dir) {
  auto p = std::make_shared<ModelPackage>();
  p->dir_ = std::move(dir);
  p->config_ = std::move(config);
  p->memory_owner_ = std::move(owner);
  for (auto& t : tensors) {
    std::string name = t.name;
    if (!p->memory_tensors_.emplace(name, std::move(t)).second) fail("{}: tensor {} given twice", p->dir_, name);
  }
  for (const auto& [name, t] : p->memory_tensors_) p->tensors_[name] = &t;
  return p;
}

const TensorView* ModelPackage::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second;
}

const TensorView& ModelPackage::require(const std::string& name) const {
  if (auto* t = find(name)) return *t;
  auto u = unindexed_.find(name);
  if (u != unindexed_.end())
    fail("{}: tensor {} is in shard {} but missing from model.safetensors.index.json; run `moesrv repair-index --model {}`",
         dir_, name, u->second, dir_);
  fail("{}: required tensor {} is missing from the model package", dir_, name);
}

std::vector<std::string> ModelPackage::names() const {
  std::vector<std::string> out;
  for (const auto& [n, t] : tensors_) out.push_back(n);
  return out;
}

}  // namespace moesrv
