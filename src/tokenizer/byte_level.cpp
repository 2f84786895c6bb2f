#include "tokenizer/byte_level.h"

#include "tokenizer/utf8.h"

namespace moesrv {

ByteLevel::ByteLevel() {
  char_to_byte_.fill(-1);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    uint32_t cp = printable ? uint32_t(b) : uint32_t(next++);
    utf8::append(byte_text_[b], cp);
    char_to_byte_[cp] = int16_t(b);
  }
}

const ByteLevel& ByteLevel::get() {
  static const ByteLevel instance;
  return instance;
}

std::string ByteLevel::encode(std::string_view raw) const {
  std::string out;
  out.reserve(raw.size() * 2);
  for (unsigned char b : raw) out += byte_text_[b];
  return out;
}

std::string ByteLevel::decode(std::string_view text) const {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    size_t start = i;
    uint32_t cp = utf8::decode(text, i);
    if (cp < char_to_byte_.size() && char_to_byte_[cp] >= 0) {
      out += char(char_to_byte_[cp]);
    } else {
      out.append(text.substr(start, i - start));
    }
  }
  return out;
}

}  // namespace moesrv
