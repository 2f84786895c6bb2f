// The text of every token, computed once per server: what constrained decoding checks candidates against.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "server/chat_codec.h"

namespace moesrv {

struct VocabText {
  std::vector<std::string> bytes;  // token id -> raw bytes
  std::vector<uint8_t> special;    // token id -> 1 if a special/added token
  explicit VocabText(const ChatCodec& codec) {
    int64_t n = codec.vocab_size();
    bytes.resize(size_t(n));
    special.resize(size_t(n));
    for (int64_t i = 0; i < n; ++i) {
      bytes[size_t(i)] = codec.token_bytes(int32_t(i));
      special[size_t(i)] = codec.is_special(int32_t(i));
    }
  }
};

}  // namespace moesrv
