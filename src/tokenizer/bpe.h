// Byte-pair-encoding model: vocab + ranked merges, applied per pre-tokenized word.
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace moesrv {

class Bpe {
 public:
  explicit Bpe(const nlohmann::json& model);  // the "model" object of tokenizer.json (type BPE)

  // Appends the ids of one word (already in vocab alphabet, e.g. byte-level characters).
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  const std::unordered_map<std::string, int32_t>& vocab() const { return vocab_; }

 private:
  struct Merge {
    int32_t rank, merged_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  void merge_symbols(std::string_view word, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<uint64_t, Merge> merges_;
  bool ignore_merges_ = false;

  // Cache of recent words -> ids (shared across threads).
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace moesrv
