#include "format/index_repair.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "format/lock.h"
#include "format/safetensors.h"
#include "util/error.h"

namespace moesrv {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Writes text to path via a synced temp file and rename, so a crash never leaves a half-written index.
void write_file_atomic(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail("{}: cannot write: {}", tmp, std::strerror(errno));
  size_t off = 0;
  while (off < text.size()) {
    ssize_t n = ::write(fd, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      ::close(fd);
      fail("{}: write failed: {}", tmp, std::strerror(err));
    }
    off += size_t(n);
  }
  ::fsync(fd);
  ::close(fd);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("{}: rename failed: {}", path, std::strerror(errno));
}

struct ShardScan {
  std::map<std::string, std::vector<std::string>> where;  // tensor -> shards holding it
  std::map<std::string, uint64_t> nbytes;                 // tensor -> data bytes
};

// Opens (and thereby validates) every shard in the folder, like ModelPackage does.
ShardScan scan_shards(const std::string& dir) {
  ShardScan s;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string fname = e.path().filename().string();
    if (e.path().extension() != ".safetensors" || fname == "reference.safetensors") continue;
    auto f = SafetensorsFile::open(e.path().string());
    for (const auto& [name, t] : f->tensors()) {
      s.where[name].push_back(fname);
      s.nbytes[name] = t.nbytes;
    }
  }
  return s;
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

}  // namespace

std::string RepairReport::text() const {
  std::string out;
  for (const auto& a : added) out += "added   " + a + "\n";
  for (const auto& m : moved) out += "moved   " + m + "\n";
  for (const auto& s : new_shards) out += "shard   " + s + " is now named by the index\n";
  if (!changed) out += "index is complete: nothing to repair\n";
  else
    out += fmt::format("{} added, {} moved, metadata.total_size = {}{}\n", added.size(), moved.size(), total_size,
                       written ? " (written; backup " + backup + ")" : " (not written)");
  if (!lock_note.empty()) out += lock_note + "\n";
  return out;
}

RepairReport repair_index(const std::string& dir, const RepairOptions& opt) {
  fs::path idx = fs::path(dir) / kIndexFileName;
  if (!fs::is_directory(dir)) fail("model directory {} does not exist", dir);
  if (!fs::exists(idx))
    fail("{}: no {}; without an index every *.safetensors is served directly, so there is nothing to repair", dir, kIndexFileName);
  json index = read_json_file(idx.string());
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    fail("{}: no weight_map object", idx.string());
  const json& old_map = index["weight_map"];

  ShardScan scan = scan_shards(dir);
  RepairReport rep;
  json new_map = json::object();
  std::set<std::string> old_shards;
  for (auto it = old_map.begin(); it != old_map.end(); ++it) {
    if (!it->is_string()) fail("{}: weight_map entry {} is not a file name", idx.string(), it.key());
    std::string file = it->get<std::string>();
    old_shards.insert(file);
    auto w = scan.where.find(it.key());
    if (w == scan.where.end())
      fail("{}: the index lists tensor {} in {}, but no shard in the folder contains it; the package is incomplete "
           "(re-download {})", dir, it.key(), file, file);
    const auto& holders = w->second;
    if (std::find(holders.begin(), holders.end(), file) != holders.end()) {
      new_map[it.key()] = file;
    } else if (holders.size() == 1) {
      new_map[it.key()] = holders[0];
      rep.moved.push_back(fmt::format("{}: {} -> {}", it.key(), file, holders[0]));
    } else {
      fail("{}: tensor {} is listed in {} but found in several other shards ({}); cannot tell which is right", dir,
           it.key(), file, join(holders));
    }
  }
  for (const auto& [name, holders] : scan.where) {
    if (old_map.contains(name)) continue;
    if (holders.size() > 1) fail("{}: unindexed tensor {} is in several shards ({}); cannot tell which is right", dir, name, join(holders));
    new_map[name] = holders[0];
    rep.added.push_back(name + " -> " + holders[0]);
  }
  std::set<std::string> new_shards;
  for (auto it = new_map.begin(); it != new_map.end(); ++it) {
    rep.total_size += scan.nbytes[it.key()];
    new_shards.insert(it->get<std::string>());
  }
  for (const auto& s : new_shards)
    if (!old_shards.count(s)) rep.new_shards.push_back(s);

  bool size_ok = index.contains("metadata") && index["metadata"].is_object() &&
                 index["metadata"].value("total_size", json()) == json(rep.total_size);
  rep.changed = new_map != old_map || !size_ok;
  if (!rep.changed || opt.dry_run) return rep;

  // Re-check the shards the repaired index names against the lock before touching anything.
  fs::path lock_path = fs::path(dir) / kLockFileName;
  bool have_lock = fs::exists(lock_path);
  bool shards_verified = false;
  PackageLock lock;
  if (have_lock) {
    lock = read_lock(lock_path.string());
    VerifyOptions vo;
    vo.threads = opt.threads;
    vo.progress = opt.progress;
    vo.only.assign(new_shards.begin(), new_shards.end());
    VerifyReport vr = verify_against(dir, lock, vo);
    shards_verified = vr.issues.empty();
    if (!shards_verified) {
      if (opt.require_lock_ok)
        fail("{}: repaired index NOT written: its shards do not verify against {}:\n{}", dir, kLockFileName, vr.text());
      rep.lock_note = fmt::format("{} NOT updated: shards fail verification (moesrv verify will flag the index):\n{}",
                                  kLockFileName, vr.text());
    }
  } else {
    rep.lock_note = fmt::format("no {}; run `moesrv lock --model {}` to record the repaired package", kLockFileName, dir);
  }

  index["weight_map"] = new_map;
  if (!index.contains("metadata") || !index["metadata"].is_object()) index["metadata"] = json::object();
  index["metadata"]["total_size"] = rep.total_size;
  rep.backup = idx.string() + ".bak";
  fs::copy_file(idx, rep.backup, fs::copy_options::overwrite_existing);
  write_file_atomic(idx.string(), index.dump(2) + "\n");
  rep.written = true;

  if (have_lock && shards_verified) {
    lock.files[kIndexFileName] = {fs::file_size(idx), sha256_file(idx.string())};
    write_lock(lock_path.string(), lock);
    rep.lock_updated = true;
    rep.lock_note = fmt::format("every shard verified; {} updated with the new index hash", kLockFileName);
  }
  return rep;
}

std::vector<std::string> package_missing_tensors(const ModelPackage& pkg, const std::vector<std::string>& required) {
  std::vector<std::string> missing;
  for (const auto& n : required)
    if (!pkg.has(n)) missing.push_back(n);
  return missing;
}

std::vector<std::string> required_indexer_tensors(const json& config, const std::string& layer_prefix) {
  const json& cfg = config.contains("text_config") && config["text_config"].is_object() ? config["text_config"] : config;
  if (!cfg.contains("index_head_dim") || !cfg["index_head_dim"].is_number()) return {};
  int layers = cfg.value("num_hidden_layers", 0);
  auto types = cfg.value("indexer_types", json::array());
  auto attn = cfg.value("layer_types", json::array());
  static const char* kParts[] = {"wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"};
  std::vector<std::string> out;
  for (int i = 0; i < layers; ++i) {
    bool needs = types.is_array() && size_t(i) < types.size()
                     ? types[size_t(i)] == "full"
                     : !(attn.is_array() && size_t(i) < attn.size()) || attn[size_t(i)] == "deepseek_sparse_attention";
    if (needs && attn.is_array() && size_t(i) < attn.size() && attn[size_t(i)] != "deepseek_sparse_attention") needs = false;
    if (!needs) continue;
    for (const char* p : kParts) out.push_back(fmt::format("{}{}.self_attn.indexer.{}", layer_prefix, i, p));
  }
  return out;
}

}  // namespace moesrv
