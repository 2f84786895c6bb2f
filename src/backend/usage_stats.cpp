#include "backend/usage_stats.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>

#include "util/error.h"

namespace moesrv {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
// Checked before anything is allocated (a negative or absurd shape must not size a vector).
int64_t checked_layers(int64_t layers, int64_t experts, int64_t experts_per_token) {
  constexpr int64_t kMax = int64_t(1) << 20;
  if (layers < 0 || layers > kMax || experts <= 0 || experts > kMax || experts_per_token <= 0 ||
      experts_per_token > experts || layers * experts > kMax * 16)
    fail("usage stats: invalid shape {} layers x {} experts, top-{}", layers, experts, experts_per_token);
  return layers;
}

// An integer field of the usage document (get<int64_t> on 9e61 or 2.5 would convert with undefined behaviour).
int64_t integer_field(const json& j, const char* key) {
  const json& v = j.at(key);
  if (!v.is_number_integer()) fail("expert usage: \"{}\" is not an integer: {}", key, v.dump());
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))
    fail("expert usage: \"{}\" is out of range", key);
  return v.get<int64_t>();
}
}  // namespace

UsageStats::UsageStats(int64_t layers, int64_t experts, int64_t experts_per_token)
    : layers_(checked_layers(layers, experts, experts_per_token)),
      experts_(experts),
      k_(experts_per_token),
      counts_(size_t(layers * experts), 0.0),
      tokens_(size_t(layers), 0.0) {}

UsageStats::UsageStats(const UsageStats& o) : layers_(o.layers_), experts_(o.experts_), k_(o.k_) {
  std::lock_guard lk(o.mu_);
  counts_ = o.counts_;
  tokens_ = o.tokens_;
}

UsageStats& UsageStats::operator=(const UsageStats& o) {
  if (this == &o) return *this;
  std::scoped_lock lk(mu_, o.mu_);
  layers_ = o.layers_, experts_ = o.experts_, k_ = o.k_;
  counts_ = o.counts_;
  tokens_ = o.tokens_;
  return *this;
}

void UsageStats::record(int64_t layer, const int32_t* ids, size_t n) {
  if (layer < 0 || layer >= layers_) fail("usage stats: layer {} out of range [0, {})", layer, layers_);
  std::lock_guard lk(mu_);
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= experts_) fail("usage stats: expert {} out of range [0, {})", ids[i], experts_);
    counts_[size_t(layer * experts_ + ids[i])] += 1.0;
  }
  tokens_[size_t(layer)] += 1.0;
}

void UsageStats::add_counts(int64_t layer, const uint32_t* per_expert, double tokens) {
  if (layer < 0 || layer >= layers_) fail("usage stats: layer {} out of range [0, {})", layer, layers_);
  std::lock_guard lk(mu_);
  for (int64_t e = 0; e < experts_; ++e) counts_[size_t(layer * experts_ + e)] += double(per_expert[e]);
  tokens_[size_t(layer)] += tokens;
}

void UsageStats::decay(double factor) {
  if (!(factor > 0 && factor <= 1)) fail("usage stats: decay factor {} outside (0, 1]", factor);
  std::lock_guard lk(mu_);
  for (double& c : counts_) c *= factor;
  for (double& t : tokens_) t *= factor;
}

void UsageStats::merge(const UsageStats& other) {
  if (&other == this) fail("usage stats: cannot merge into itself");
  if (other.layers_ != layers_ || other.experts_ != experts_)
    fail("usage stats: cannot merge {}x{} counts into {}x{}", other.layers_, other.experts_, layers_, experts_);
  std::scoped_lock lk(mu_, other.mu_);
  for (size_t i = 0; i < counts_.size(); ++i) counts_[i] += other.counts_[i];
  for (size_t i = 0; i < tokens_.size(); ++i) tokens_[i] += other.tokens_[i];
}

void UsageStats::clear() {
  std::lock_guard lk(mu_);
  std::fill(counts_.begin(), counts_.end(), 0.0);
  std::fill(tokens_.begin(), tokens_.end(), 0.0);
}

double UsageStats::count(int64_t layer, int64_t expert) const {
  std::lock_guard lk(mu_);
  return counts_.at(size_t(layer * experts_ + expert));
}

std::vector<double> UsageStats::counts(int64_t layer) const {
  if (layer < 0 || layer >= layers_) fail("usage stats: layer {} out of range [0, {})", layer, layers_);
  std::lock_guard lk(mu_);
  auto b = counts_.begin() + layer * experts_;
  return {b, b + experts_};
}

double UsageStats::tokens(int64_t layer) const {
  std::lock_guard lk(mu_);
  return tokens_.at(size_t(layer));
}

std::vector<double> UsageStats::selection_probability(int64_t layer) const {
  std::vector<double> c = counts(layer);
  double t = tokens(layer);
  for (double& v : c) v = t > 0 ? std::min(1.0, v / t) : double(k_) / double(experts_);
  return c;
}

std::vector<int32_t> UsageStats::hottest(int64_t layer, size_t n) const {
  std::vector<double> c = counts(layer);
  std::vector<int32_t> ids(c.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return c[size_t(a)] > c[size_t(b)]; });
  ids.resize(std::min(n, ids.size()));
  return ids;
}

double UsageStats::entropy(int64_t layer) const {
  std::vector<double> c = counts(layer);
  double sum = std::accumulate(c.begin(), c.end(), 0.0);
  if (sum <= 0) return std::log(double(experts_));
  double h = 0;
  for (double v : c)
    if (v > 0) h -= v / sum * std::log(v / sum);
  return h;
}

json UsageStats::to_json(const std::string& model_id) const {
  std::lock_guard lk(mu_);
  json layers = json::array();
  for (int64_t l = 0; l < layers_; ++l) {
    auto b = counts_.begin() + l * experts_;
    layers.push_back(json{{"tokens", tokens_[size_t(l)]}, {"counts", std::vector<double>(b, b + experts_)}});
  }
  return json{{"format", "moesrv-expert-usage"},
              {"version", 1},
              {"model", model_id},
              {"num_layers", layers_},
              {"n_routed_experts", experts_},
              {"experts_per_token", k_},
              {"layers", layers}};
}

UsageStats UsageStats::from_json(const json& j, int64_t expect_layers, int64_t expect_experts) {
  try {
    if (j.value("format", "") != "moesrv-expert-usage") fail("expert usage: not a moesrv-expert-usage document");
    if (integer_field(j, "version") != 1) fail("expert usage: unsupported version {}", j.at("version").dump());
    UsageStats s(integer_field(j, "num_layers"), integer_field(j, "n_routed_experts"),
                 integer_field(j, "experts_per_token"));
    if (expect_layers > 0 && s.layers_ != expect_layers)
      fail("expert usage: {} layers, the model has {}", s.layers_, expect_layers);
    if (expect_experts > 0 && s.experts_ != expect_experts)
      fail("expert usage: {} experts per layer, the model has {}", s.experts_, expect_experts);
    const json& layers = j.at("layers");
    if (!layers.is_array() || int64_t(layers.size()) != s.layers_)
      fail("expert usage: layers array has the wrong length");
    for (int64_t l = 0; l < s.layers_; ++l) {
      auto c = layers[size_t(l)].at("counts").get<std::vector<double>>();
      if (int64_t(c.size()) != s.experts_)
        fail("expert usage: layer {} has {} counts, expected {}", l, c.size(), s.experts_);
      for (double v : c)
        if (!(v >= 0) || !std::isfinite(v)) fail("expert usage: layer {} has an invalid count", l);
      std::copy(c.begin(), c.end(), s.counts_.begin() + l * s.experts_);
      s.tokens_[size_t(l)] = layers[size_t(l)].at("tokens").get<double>();
    }
    return s;
  } catch (const json::exception& e) {
    fail("expert usage: malformed document: {}", e.what());
  }
}

std::string UsageStats::default_path(const std::string& model_dir) {
  return (fs::path(model_dir) / ".moesrv" / "expert_usage.json").string();
}

void UsageStats::save(const std::string& path, const std::string& model_id) const {
  fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path());
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::string text = to_json(model_id).dump(1);
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("{}: cannot write", tmp);
  bool ok =
      std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  ok = std::fclose(f) == 0 && ok;
  if (!ok) {
    fs::remove(tmp);
    fail("{}: write failed", tmp);
  }
  std::error_code ec;
  fs::rename(tmp, p, ec);
  if (ec) {
    fs::remove(tmp);
    fail("{}: cannot replace: {}", path, ec.message());
  }
}

std::optional<UsageStats> UsageStats::load(const std::string& path, int64_t layers, int64_t experts) {
  if (!fs::exists(path)) return std::nullopt;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return std::nullopt;
  std::string text;
  char buf[65536];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) text.append(buf, n);
  std::fclose(f);
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return std::nullopt;
  try {
    return from_json(j, layers, experts);
  } catch (const Error&) {
    return std::nullopt;
  }
}

}  // namespace moesrv
