// Shared helpers for the package tests (lock, repair, download, preflight): temp dirs and synthetic packages.
#pragma once
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "format/safetensors.h"

namespace moesrv::testutil {

namespace fs = std::filesystem;

// A fresh empty directory under the system temp dir, removed on destruction.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag = "pkg") {
    static std::mt19937_64 rng{std::random_device{}()};
    path = fs::temp_directory_path() / ("moesrv_" + tag + "_" + std::to_string(rng()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string str() const { return path.string(); }
  std::string operator/(const std::string& rel) const { return (path / rel).string(); }
};

inline std::string read_file(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_file(const std::string& p, const std::string& data) {
  fs::create_directories(fs::path(p).parent_path());
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(data.data(), std::streamsize(data.size()));
}

// Copies a read-only test package into dst (files made writable).
inline void copy_package(const std::string& src, const std::string& dst) {
  fs::create_directories(dst);
  for (const auto& e : fs::directory_iterator(src)) {
    fs::copy_file(e.path(), fs::path(dst) / e.path().filename(), fs::copy_options::overwrite_existing);
    fs::permissions(fs::path(dst) / e.path().filename(), fs::perms::owner_read | fs::perms::owner_write);
  }
}

inline void flip_byte(const std::string& p, uint64_t offset) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(offset));
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ 0x5a);
  f.seekp(std::streamoff(offset));
  f.write(&c, 1);
}

// A tensor with owned F32 data (value = seed + i).
struct OwnedTensor {
  std::vector<float> data;
  TensorView view;
  OwnedTensor(std::string name, std::vector<int64_t> shape, float seed = 0) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    data.resize(size_t(n));
    for (int64_t i = 0; i < n; ++i) data[size_t(i)] = seed + float(i);
    view.name = std::move(name);
    view.dtype = DType::F32;
    view.shape = std::move(shape);
    view.data = reinterpret_cast<const uint8_t*>(data.data());
    view.nbytes = data.size() * sizeof(float);
  }
};

inline void write_shard(const std::string& path, const std::vector<std::pair<std::string, std::vector<int64_t>>>& specs) {
  std::vector<OwnedTensor> owned;
  owned.reserve(specs.size());
  float seed = 0;
  for (const auto& [n, s] : specs) owned.emplace_back(n, s, seed += 1);
  std::vector<TensorView> views;
  for (const auto& o : owned) views.push_back(o.view);
  write_safetensors(path, views);
}

}  // namespace moesrv::testutil
