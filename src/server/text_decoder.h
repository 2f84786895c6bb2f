// DecodeHooks for /v1/completions: raw text out (no reasoning/tool parsing), stop sequences, end tokens.
#pragma once
#include <algorithm>
#include <functional>

#include "server/chat_codec.h"
#include "server/generator.h"
#include "server/stop_matcher.h"

namespace moesrv {

// Splits off the longest prefix of `bytes` made of whole UTF-8 sequences; the rest stays for later.
inline std::string take_complete_utf8(std::string& bytes) {
  size_t n = bytes.size(), cut = n;
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    unsigned char c = bytes[n - back];
    if ((c & 0xC0) == 0x80) continue;
    size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    if (need > back) cut = n - back;
    break;
  }
  std::string out = bytes.substr(0, cut);
  bytes.erase(0, cut);
  return out;
}

class TextDecoder : public DecodeHooks {
 public:
  using Sink = std::function<bool(const std::string&)>;
  TextDecoder(const ChatCodec& codec, std::vector<std::string> stops, Sink sink)
      : codec_(codec), end_ids_(codec.end_of_turn_ids()), stops_(std::move(stops)), sink_(std::move(sink)) {}

  bool on_token(int32_t id) override {
    if (std::find(end_ids_.begin(), end_ids_.end(), id) != end_ids_.end()) return false;
    pending_ += codec_.token_bytes(id);
    return emit(stops_.push(take_complete_utf8(pending_))) && !stops_.hit();
  }
  void finish() {
    std::string rest = stops_.hit() ? "" : stops_.push(pending_);
    emit(rest + stops_.flush());
  }
  const std::string& text() const { return text_; }
  bool cancelled() const { return cancelled_; }
  bool stop_hit() const { return stops_.hit(); }

 private:
  bool emit(const std::string& s) {
    if (s.empty() || cancelled_) return !cancelled_;
    text_ += s;
    if (!sink_(s)) cancelled_ = true;
    return !cancelled_;
  }
  const ChatCodec& codec_;
  std::vector<int32_t> end_ids_;
  StopMatcher stops_;
  Sink sink_;
  std::string pending_, text_;
  bool cancelled_ = false;
};

}  // namespace moesrv
