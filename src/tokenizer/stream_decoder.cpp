#include "tokenizer/stream_decoder.h"

#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace moesrv {

std::string StreamDecoder::push(int32_t id) {
  if (!(skip_special_ && tok_.is_special(id))) pending_ += tok_.token_text(id);
  return take_complete(false);
}

std::string StreamDecoder::flush() { return take_complete(true); }

std::string StreamDecoder::take_complete(bool final) {
  size_t keep = final ? 0 : utf8::incomplete_tail(pending_);
  std::string ready = pending_.substr(0, pending_.size() - keep);
  pending_.erase(0, pending_.size() - keep);
  // Invalid bytes (e.g. a model emitting a stray continuation byte) become U+FFFD.
  std::string out;
  out.reserve(ready.size());
  for (size_t i = 0; i < ready.size();) {
    size_t start = i;
    uint32_t cp = utf8::decode(ready, i);
    if (cp == 0xFFFD && i - start == 1) {
      utf8::append(out, 0xFFFD);
    } else {
      out.append(ready, start, i - start);
    }
  }
  return out;
}

}  // namespace moesrv
