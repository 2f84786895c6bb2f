// Added tokens (special tokens like <|im_start|>) are found in raw text before normalization
// and pre-tokenization, leftmost-longest like Hugging Face's AddedVocabulary.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace moesrv {

struct AddedToken {
  int32_t id;
  std::string content;
  bool special, lstrip, rstrip;
};

class AddedTokens {
 public:
  explicit AddedTokens(std::vector<AddedToken> tokens);

  struct Match {
    size_t begin, end;  // byte range consumed in the text (includes stripped whitespace)
    int32_t id;
  };
  // Finds all non-overlapping matches, leftmost-longest; special tokens only if with_special.
  std::vector<Match> find_all(std::string_view text, bool with_special) const;
  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  int32_t child(int32_t node, unsigned char c) const {
    auto it = edges_.find((uint64_t(node) << 8) | c);
    return it == edges_.end() ? -1 : it->second;
  }
  std::vector<AddedToken> tokens_;
  std::unordered_map<uint64_t, int32_t> edges_;  // byte trie: (node << 8 | byte) -> node
  std::vector<int32_t> node_token_{-1};          // per node: index into tokens_ or -1
  bool first_byte_[256] = {};
};

}  // namespace moesrv
