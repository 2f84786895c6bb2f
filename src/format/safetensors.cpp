#include "format/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "util/error.h"

namespace moesrv {

using json = nlohmann::json;

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    fail("{}: cannot stat: {}", path, std::strerror(errno));
  }
  f->size_ = size_t(st.st_size);
  if (f->size_ < 8) {
    ::close(fd);
    fail("{}: truncated safetensors file ({} bytes, header length needs 8)", path, f->size_);
  }
  void* m = mmap(nullptr, f->size_, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) fail("{}: mmap failed: {}", path, std::strerror(errno));
  f->map_ = m;
  f->parse(static_cast<const uint8_t*>(m));
  return f;
}

std::shared_ptr<SafetensorsFile> SafetensorsFile::from_memory(const uint8_t* data, size_t size,
                                                              std::shared_ptr<const void> owner,
                                                              const std::string& name) {
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = name;
  f->size_ = size;
  f->owner_ = std::move(owner);
  if (size < 8) fail("{}: truncated safetensors file ({} bytes, header length needs 8)", name, size);
  f->parse(data);
  return f;
}

namespace {
// A JSON array of non-negative integers. nlohmann's get<uint64_t> converts floats (9e61) and negative numbers with
// undefined behaviour, so every element's type is checked first.
std::vector<uint64_t> whole_numbers(const json& a, const std::string& path, const std::string& tensor,
                                    const char* field) {
  if (!a.is_array()) fail("{}: corrupt header entry for tensor {}: {} is not an array", path, tensor, field);
  std::vector<uint64_t> out;
  for (const auto& e : a) {
    if (!e.is_number_unsigned())
      fail("{}: corrupt header entry for tensor {}: {} entry {} is not a non-negative integer", path, tensor, field,
           e.dump());
    out.push_back(e.get<uint64_t>());
  }
  return out;
}
}  // namespace

void SafetensorsFile::parse(const uint8_t* base) {
  SafetensorsFile* f = this;
  const std::string& path = path_;
  uint64_t header_len = 0;
  std::memcpy(&header_len, base, 8);
  if (header_len > f->size_ - 8) fail("{}: truncated safetensors file: header says {} bytes, file has {}", path, header_len, f->size_ - 8);
  json header;
  try {
    header = json::parse(base + 8, base + 8 + header_len);
  } catch (const json::exception& e) {
    fail("{}: corrupt safetensors header (not valid JSON: {})", path, e.what());
  }
  if (!header.is_object()) fail("{}: corrupt safetensors header (not a JSON object)", path);
  const uint8_t* data = base + 8 + header_len;
  size_t data_size = f->size_ - 8 - header_len;

  std::vector<std::pair<size_t, size_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (it->is_object())
        for (auto m2 = it->begin(); m2 != it->end(); ++m2)
          if (m2->is_string()) f->metadata_[m2.key()] = m2->get<std::string>();
      continue;
    }
    const json& t = *it;
    TensorView v;
    v.name = it.key();
    try {
      if (!parse_dtype(t.at("dtype").get<std::string>(), v.dtype))
        fail("{}: tensor {} has unknown dtype {}", path, v.name, t.at("dtype").dump());
      v.shape.clear();
      for (uint64_t d : whole_numbers(t.at("shape"), path, v.name, "shape")) {
        if (d > uint64_t(INT64_MAX))
          fail("{}: corrupt header entry for tensor {}: a dimension beyond int64", path, v.name);
        v.shape.push_back(int64_t(d));
      }
      auto off = whole_numbers(t.at("data_offsets"), path, v.name, "data_offsets");
      if (off.size() != 2 || off[0] > off[1]) fail("{}: tensor {} has bad data_offsets", path, v.name);
      if (off[1] > data_size)
        fail("{}: truncated or corrupt: tensor {} ends at byte {} but the data section has {}", path, v.name, off[1], data_size);
      // Bytes from the shape without wrapping (huge dimensions must not multiply to a small, "valid" size).
      uint64_t expect = dtype_size(v.dtype);
      for (auto d : v.shape) {
        if (d < 0) fail("{}: tensor {} has a negative dimension", path, v.name);
        if (__builtin_mul_overflow(expect, uint64_t(d), &expect))
          fail("{}: tensor {} {} has more bytes than 64 bits can count", path, v.name, v.shape_str());
      }
      if (off[1] - off[0] != expect)
        fail("{}: tensor {} {} {} needs {} bytes but offsets span {}", path, v.name, dtype_name(v.dtype), v.shape_str(), expect, off[1] - off[0]);
      v.data = data + off[0];
      v.nbytes = expect;
      ranges.emplace_back(off[0], off[1]);
    } catch (const json::exception& e) {
      fail("{}: corrupt header entry for tensor {}: {}", path, it.key(), e.what());
    }
    f->tensors_.emplace(v.name, std::move(v));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second) fail("{}: corrupt header: tensor data ranges overlap", path);
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) munmap(map_, size_);
}

const TensorView* SafetensorsFile::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

void write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape}, {"data_offsets", {off, off + t.nbytes}}};
    off += t.nbytes;
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8) h += ' ';
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail("{}: cannot write", tmp);
    uint64_t n = h.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out.write(h.data(), std::streamsize(h.size()));
    for (const auto& t : tensors) out.write(reinterpret_cast<const char*>(t.data), std::streamsize(t.nbytes));
    if (!out) fail("{}: write failed", tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("{}: rename failed: {}", path, std::strerror(errno));
}

}  // namespace moesrv
