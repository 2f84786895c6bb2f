// Routed-expert usage counts per layer (from router outputs), with exponential decay, persisted next to the
// model as <model>/.moesrv/expert_usage.json so the next start can pin the hottest experts.
#pragma once
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace moesrv {

class UsageStats {
 public:
  UsageStats(int64_t layers, int64_t experts, int64_t experts_per_token);
  UsageStats(const UsageStats& o);
  UsageStats& operator=(const UsageStats& o);

  int64_t layers() const { return layers_; }
  int64_t experts() const { return experts_; }
  int64_t experts_per_token() const { return k_; }

  // One routed token's selected expert ids (any count); thread-safe.
  void record(int64_t layer, const int32_t* ids, size_t n);
  void record(int64_t layer, const std::vector<int32_t>& ids) { record(layer, ids.data(), ids.size()); }
  // Adds counts gathered elsewhere (a GPU's counters): per expert of `layer` (experts() values) and tokens.
  void add_counts(int64_t layer, const uint32_t* per_expert, double tokens);
  // Multiplies every count by `factor` (0..1], so recent traffic dominates.
  void decay(double factor);
  // Adds another recording of the same model's shape.
  void merge(const UsageStats& other);
  void clear();

  double count(int64_t layer, int64_t expert) const;
  std::vector<double> counts(int64_t layer) const;
  double tokens(int64_t layer) const;  // routed tokens recorded (decayed)
  bool empty(int64_t layer) const { return tokens(layer) <= 0; }
  // Probability that one token selects each expert (count / tokens); uniform k/E without data.
  std::vector<double> selection_probability(int64_t layer) const;
  // Expert ids by descending count (ties: lower id first).
  std::vector<int32_t> hottest(int64_t layer, size_t n) const;
  // Shannon entropy (nats) of the layer's selection distribution; log(E) without data.
  double entropy(int64_t layer) const;

  nlohmann::json to_json(const std::string& model_id = "") const;
  // Throws Error on a malformed document; `expect_*` > 0 must match the file's shape.
  static UsageStats from_json(const nlohmann::json& j, int64_t expect_layers = 0, int64_t expect_experts = 0);

  // <model_dir>/.moesrv/expert_usage.json
  static std::string default_path(const std::string& model_dir);
  // Atomic: writes a temporary file in the same folder, flushes it, renames it over `path`.
  void save(const std::string& path, const std::string& model_id = "") const;
  // nullopt when the file is absent or its shape does not match the model (stale stats are ignored).
  static std::optional<UsageStats> load(const std::string& path, int64_t layers, int64_t experts);

 private:
  int64_t layers_, experts_, k_;
  std::vector<double> counts_;  // [layers][experts]
  std::vector<double> tokens_;  // [layers]
  mutable std::mutex mu_;
};

}  // namespace moesrv
