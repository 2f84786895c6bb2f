// Incremental detokenizer for streaming: turns ids into UTF-8 text pieces, holding back bytes of
// a character that is not complete yet (a multi-byte character may span several tokens).
#pragma once
#include <cstdint>
#include <string>

namespace moesrv {

class Tokenizer;

class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = false) : tok_(tok), skip_special_(skip_special) {}

  // Adds one token; returns the text that became complete (possibly empty).
  std::string push(int32_t id);
  // Returns whatever is held back (incomplete bytes become U+FFFD) and resets.
  std::string flush();

 private:
  std::string take_complete(bool final);
  const Tokenizer& tok_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace moesrv
