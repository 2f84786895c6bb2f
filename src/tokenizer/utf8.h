// Small UTF-8 helpers shared by the tokenizer, NFC normalizer and stream decoder.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moesrv::utf8 {

// Length of the sequence introduced by lead byte `c` (1 for invalid/continuation bytes).
inline size_t seq_len(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) return 2;
  if ((c & 0xF0) == 0xE0) return 3;
  if ((c & 0xF8) == 0xF0) return 4;
  return 1;
}

// Decodes one code point at s[i], advancing i. Invalid bytes decode as U+FFFD (one byte consumed).
inline uint32_t decode(std::string_view s, size_t& i) {
  unsigned char c = s[i];
  size_t n = seq_len(c);
  if (n == 1 || i + n > s.size()) {
    ++i;
    return c < 0x80 ? c : 0xFFFD;
  }
  uint32_t cp = c & (0xFF >> (n + 1));
  for (size_t k = 1; k < n; ++k) {
    unsigned char cc = s[i + k];
    if ((cc & 0xC0) != 0x80) {
      ++i;
      return 0xFFFD;
    }
    cp = (cp << 6) | (cc & 0x3F);
  }
  i += n;
  return cp;
}

inline void append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

// Number of trailing bytes of `s` that form an incomplete (but so far valid) UTF-8 sequence.
inline size_t incomplete_tail(std::string_view s) {
  size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    unsigned char c = s[n - back];
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    size_t need = seq_len(c);
    return (need > back) ? back : 0;
  }
  return 0;
}

}  // namespace moesrv::utf8
