// GPT-2 style byte-level mapping: every byte is shown as a printable Unicode character.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace moesrv {

class ByteLevel {
 public:
  static const ByteLevel& get();
  // UTF-8 encoding of the character that stands for byte `b`.
  const std::string& byte_to_text(uint8_t b) const { return byte_text_[b]; }
  // Maps each byte of `raw` to its character.
  std::string encode(std::string_view raw) const;
  // Inverse of encode. Characters outside the byte alphabet are kept as their UTF-8 bytes.
  std::string decode(std::string_view text) const;

 private:
  ByteLevel();
  std::array<std::string, 256> byte_text_;
  std::array<int16_t, 324> char_to_byte_;  // code points used are all < 324
};

}  // namespace moesrv
