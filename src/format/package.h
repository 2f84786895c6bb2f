// A model package on disk: config.json + safetensors shards, resolved through model.safetensors.index.json
// when present (else every *.safetensors in the folder).
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "format/safetensors.h"

namespace moesrv {

class ModelPackage {
 public:
  // Opens and validates every shard the index names. Tensors present in a shard but absent from the index
  // are recorded in unindexed() (see index_repair.h); they are NOT silently served.
  static std::shared_ptr<ModelPackage> open(const std::string& dir);
  // A package over in-memory tensors (synthetic models, tests); `owner` keeps the tensors' bytes alive.
  static std::shared_ptr<ModelPackage> from_memory(nlohmann::json config, std::vector<TensorView> tensors,
                                                   std::shared_ptr<const void> owner, std::string dir = "<memory>");

  const std::string& dir() const { return dir_; }
  const nlohmann::json& config() const { return config_; }
  bool has_index() const { return has_index_; }

  const TensorView* find(const std::string& name) const;
  // Throws a clear error naming the tensor and the package when it is absent.
  const TensorView& require(const std::string& name) const;
  bool has(const std::string& name) const { return find(name) != nullptr; }
  // Every tensor name the package serves (indexed ones).
  std::vector<std::string> names() const;
  // name -> shard file name, for tensors in a shard that the index does not list.
  const std::map<std::string, std::string>& unindexed() const { return unindexed_; }
  const std::map<std::string, std::shared_ptr<SafetensorsFile>>& shards() const { return shards_; }

 private:
  std::string dir_;
  nlohmann::json config_;
  bool has_index_ = false;
  std::map<std::string, std::shared_ptr<SafetensorsFile>> shards_;  // file name -> shard
  std::map<std::string, const TensorView*> tensors_;
  std::map<std::string, std::string> unindexed_;
  std::map<std::string, TensorView> memory_tensors_;  // from_memory() only
  std::shared_ptr<const void> memory_owner_;
};

nlohmann::json read_json_file(const std::string& path);

}  // namespace moesrv
