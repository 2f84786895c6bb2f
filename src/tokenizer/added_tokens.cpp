#include "tokenizer/added_tokens.h"

#include <algorithm>

namespace moesrv {
namespace {
bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
}  // namespace

AddedTokens::AddedTokens(std::vector<AddedToken> tokens) : tokens_(std::move(tokens)) {
  for (size_t t = 0; t < tokens_.size(); ++t) {
    const std::string& s = tokens_[t].content;
    if (s.empty()) continue;
    first_byte_[static_cast<unsigned char>(s[0])] = true;
    int32_t node = 0;
    for (unsigned char c : s) {
      int32_t next = child(node, c);
      if (next < 0) {
        next = int32_t(node_token_.size());
        node_token_.push_back(-1);
        edges_.emplace((uint64_t(node) << 8) | c, next);
      }
      node = next;
    }
    node_token_[node] = int32_t(t);
  }
}

std::vector<AddedTokens::Match> AddedTokens::find_all(std::string_view text, bool with_special) const {
  std::vector<Match> out;
  for (size_t i = 0; i < text.size();) {
    if (!first_byte_[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    int32_t node = 0, best = -1;
    size_t best_end = 0;
    for (size_t j = i; j < text.size(); ++j) {
      node = child(node, static_cast<unsigned char>(text[j]));
      if (node < 0) break;
      int32_t t = node_token_[node];
      if (t >= 0 && (with_special || !tokens_[t].special)) {
        best = t;
        best_end = j + 1;
      }
    }
    if (best < 0) {
      ++i;
      continue;
    }
    const AddedToken& tok = tokens_[best];
    size_t begin = i, end = best_end;
    if (tok.lstrip) {
      size_t floor = out.empty() ? 0 : out.back().end;
      while (begin > floor && is_space(text[begin - 1])) --begin;
    }
    if (tok.rstrip)
      while (end < text.size() && is_space(text[end])) ++end;
    out.push_back({begin, end, tok.id});
    i = end;
  }
  return out;
}

}  // namespace moesrv
