// Repair of model.safetensors.index.json: tensors present in a shard but missing from the index (or placed in
// the wrong shard) are (re)indexed; the result is written atomically with a backup, and re-locked only when
// every shard verifies against checkpoint.lock.json. Also: checks that a package holds the tensors a config needs.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "format/package.h"

namespace moesrv {

inline constexpr const char* kIndexFileName = "model.safetensors.index.json";

struct RepairOptions {
  bool dry_run = false;          // report only, write nothing
  bool require_lock_ok = true;   // false: write the index even if shards fail the lock (lock left untouched)
  int threads = 0;               // for re-verifying shards
  bool progress = true;
};

struct RepairReport {
  std::vector<std::string> added;     // "tensor -> shard" entries added to the weight map
  std::vector<std::string> moved;     // "tensor: old -> new" entries whose shard was wrong
  std::vector<std::string> new_shards;  // shards the index did not name before
  uint64_t total_size = 0;            // metadata.total_size written (sum of tensor bytes)
  bool changed = false;               // the index content changed
  bool written = false;               // the index file was rewritten
  bool lock_updated = false;          // checkpoint.lock.json now holds the new index hash
  std::string backup;                 // path of the .bak copy, when written
  std::string lock_note;              // what happened with the lock, human-readable
  std::string text() const;
};

// Throws Error when the index cannot be repaired (a listed tensor exists in no shard, a tensor is in two
// shards, or the shards fail the lock while require_lock_ok).
RepairReport repair_index(const std::string& dir, const RepairOptions& opt = {});

// Names from `required` that the package does not serve (indexed tensors only).
std::vector<std::string> package_missing_tensors(const ModelPackage& pkg, const std::vector<std::string>& required);

// DSA indexer weights a glm_moe_dsa-style config needs: layers whose indexer_types entry is "full" (every
// deepseek_sparse_attention layer when indexer_types is absent). Empty for configs without an indexer.
std::vector<std::string> required_indexer_tensors(const nlohmann::json& config, const std::string& layer_prefix = "model.layers.");

}  // namespace moesrv
