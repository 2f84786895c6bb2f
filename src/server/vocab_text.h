// The text of every token, computed once per server: what constrained decoding checks candidates against.
// Plain tokens are also indexed in byte tries, so a mask walks shared prefixes once instead of every token.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "server/chat_codec.h"

namespace moesrv {

struct VocabText {
  std::vector<std::string> bytes;  // token id -> raw bytes
  std::vector<uint8_t> special;    // token id -> 1 if a special/added token (an atomic marker, never text)
  std::vector<int32_t> special_ids;
  std::vector<uint8_t> plain;  // token id -> 1 if a non-empty plain token
  // Characters a plain token adds inside a JSON string when it is "string-safe": whole UTF-8 characters, no
  // quote, backslash or control character (0: not string-safe).
  std::vector<uint16_t> string_chars;

  struct TrieNode {
    int32_t first_child = -1, next_sibling = -1;
    int32_t token = -1;  // token ending here (-1: none)
    unsigned char byte = 0;
  };
  struct Trie {
    std::vector<TrieNode> nodes{1};                 // 0: root
    std::vector<std::pair<int32_t, int32_t>> dups;  // (node, token) for tokens with identical bytes
    void insert(const std::string& s, int32_t token);
  };
  Trie all;     // every plain token
  Trie unsafe;  // plain tokens that are not string-safe

  explicit VocabText(const ChatCodec& codec);
};

inline void VocabText::Trie::insert(const std::string& s, int32_t token) {
  int32_t n = 0;
  for (unsigned char c : s) {
    int32_t child = nodes[size_t(n)].first_child, prev = -1;
    while (child >= 0 && nodes[size_t(child)].byte != c) prev = child, child = nodes[size_t(child)].next_sibling;
    if (child < 0) {
      nodes.push_back({-1, -1, -1, c});
      child = int32_t(nodes.size()) - 1;
      if (prev < 0) nodes[size_t(n)].first_child = child;
      else nodes[size_t(prev)].next_sibling = child;
    }
    n = child;
  }
  if (nodes[size_t(n)].token < 0) nodes[size_t(n)].token = token;
  else dups.push_back({n, token});
}

inline VocabText::VocabText(const ChatCodec& codec) {
  int64_t n = codec.vocab_size();
  bytes.resize(size_t(n));
  special.resize(size_t(n));
  plain.resize(size_t(n));
  string_chars.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    auto id = int32_t(i);
    bytes[size_t(i)] = codec.token_bytes(id);
    special[size_t(i)] = codec.is_special(id);
    if (special[size_t(i)]) {
      special_ids.push_back(id);
      continue;
    }
    const std::string& b = bytes[size_t(i)];
    if (b.empty()) continue;
    plain[size_t(i)] = 1;
    all.insert(b, id);
    // String-safe: complete UTF-8 characters only (lead bytes with the right number of continuations).
    size_t chars = 0, k = 0;
    bool safe = true;
    while (k < b.size() && safe) {
      unsigned char c = (unsigned char)b[k];
      size_t len = c < 0x80                                ? 1
                   : (c >= 0xC2 && c <= 0xDF)              ? 2
                   : (c >= 0xE1 && c <= 0xEF && c != 0xED) ? 3
                   : (c >= 0xF1 && c <= 0xF3)              ? 4
                                              : 0;  // E0/ED/F0/F4 have narrower ranges: left to the slow path
      if (len == 0 || c == '"' || c == '\\' || c < 0x20 || k + len > b.size()) safe = false;
      for (size_t j = 1; safe && j < len; ++j) safe = ((unsigned char)b[k + j] & 0xC0) == 0x80;
      k += len;
      ++chars;
    }
    if (safe && chars < 65535) string_chars[size_t(i)] = uint16_t(chars);
    else unsafe.insert(b, id);
  }
}

}  // namespace moesrv
