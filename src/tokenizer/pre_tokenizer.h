// Pre-tokenization: splits normalized text into words that BPE encodes independently.
// Supports what Qwen/DeepSeek/GLM tokenizer.json files use: Sequence, Split (regex, Isolated),
// ByteLevel (byte mapping, optionally with the GPT-2 regex). Anything else fails on load.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace moesrv {

struct Span {
  size_t begin, end;
};

class RegexSplitter;

class PreTokenizer {
 public:
  explicit PreTokenizer(const nlohmann::json& config);  // config may be null: no splitting
  ~PreTokenizer();
  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;

  // Splits `text` (valid UTF-8) into word spans, in order, covering all of `text`.
  std::vector<Span> split(std::string_view text) const;
  // Whether words must be mapped with the byte-level alphabet before BPE.
  bool byte_level() const { return byte_level_; }

 private:
  void add(const nlohmann::json& config);
  std::vector<std::unique_ptr<RegexSplitter>> splitters_;
  bool byte_level_ = false;
};

}  // namespace moesrv
