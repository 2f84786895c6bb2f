// Memory-mapped safetensors file: validated header, zero-copy tensor views.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "format/tensor_view.h"

namespace moesrv {

class SafetensorsFile {
 public:
  // Maps the file and validates the header; throws Error naming the file on any inconsistency
  // (truncation, bad JSON, unknown dtype, offsets out of range or overlapping, size != shape*dtype).
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);
  // The same validation over bytes already in memory (kept alive by `owner`); `name` appears in the errors.
  static std::shared_ptr<SafetensorsFile> from_memory(const uint8_t* data, size_t size,
                                                      std::shared_ptr<const void> owner, const std::string& name);
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorView* find(const std::string& name) const;
  size_t file_size() const { return size_; }

 private:
  SafetensorsFile() = default;
  void parse(const uint8_t* base);  // validates the header of size_ bytes at base, fills tensors_ / metadata_
  std::string path_;
  void* map_ = nullptr;
  std::shared_ptr<const void> owner_;  // from_memory's bytes
  size_t size_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors (name -> view with data) as a safetensors file; used by tests, tools and the EXL3 encoder.
void write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace moesrv
