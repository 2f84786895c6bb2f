// DecodeHooks for /v1/completions: raw text out (no reasoning/tool parsing), stop sequences, end tokens.
#pragma once
#include <algorithm>
#include <functional>

#include <nlohmann/json.hpp>

#include "server/chat_codec.h"
#include "server/generator.h"
#include "server/stop_matcher.h"
#include "serving/sampler.h"

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

// Legacy completions logprobs: {tokens, token_logprobs, top_logprobs, text_offset}.
struct CompletionLogprobs {
  nlohmann::json tokens = nlohmann::json::array(), token_logprobs = nlohmann::json::array(),
                 top_logprobs = nlohmann::json::array(), text_offset = nlohmann::json::array();
  bool empty() const { return tokens.empty(); }
  nlohmann::json to_json() const {
    return {{"tokens", tokens},
            {"token_logprobs", token_logprobs},
            {"top_logprobs", top_logprobs},
            {"text_offset", text_offset}};
  }
};

class TextDecoder : public DecodeHooks {
 public:
  // Sink: text of a delta and the logprobs of its tokens (null unless requested).
  using Sink = std::function<bool(const std::string&, const nlohmann::json&)>;
  TextDecoder(const ChatCodec& codec, std::vector<std::string> stops, Sink sink, int logprobs = -1)
      : codec_(codec),
        end_ids_(codec.end_of_turn_ids()),
        stops_(std::move(stops)),
        sink_(std::move(sink)),
        logprobs_(logprobs) {}

  // Only the tokenizer's ids (a model's vocabulary is often padded beyond it).
  const std::vector<uint8_t>* allowed_tokens() override { return allowed_; }
  void restrict_to(const std::vector<uint8_t>* allowed) { allowed_ = allowed; }

  bool wants_logits() const override { return logprobs_ >= 0; }
  void on_sampled(std::span<const float> logits, int32_t id) override {
    if (logprobs_ < 0 || std::find(end_ids_.begin(), end_ids_.end(), id) != end_ids_.end()) return;
    TokenLogprobs lp = token_logprobs(tokenizer_logits(codec_, logits), id, logprobs_);
    nlohmann::json top = nlohmann::json::object();
    for (auto& [t, v] : lp.top) top[codec_.token_bytes(t)] = v;
    std::string text = codec_.is_special(id) ? "" : codec_.token_bytes(id);
    for (auto* l : {&pending_lp_, &all_lp_}) {
      l->tokens.push_back(text);
      l->token_logprobs.push_back(lp.logprob);
      l->top_logprobs.push_back(top);
      l->text_offset.push_back(int64_t(offset_));
    }
    offset_ += text.size();
  }

  bool on_token(int32_t id) override {
    if (std::find(end_ids_.begin(), end_ids_.end(), id) != end_ids_.end()) return false;
    if (!codec_.is_special(id)) pending_ += codec_.token_bytes(id);  // special tokens are never text
    return emit(stops_.push(take_complete_utf8(pending_))) && !stops_.hit();
  }
  void finish() {
    std::string rest = stops_.hit() ? "" : stops_.push(pending_);
    emit(rest + stops_.flush(), true);
  }
  const std::string& text() const { return text_; }
  const CompletionLogprobs& logprobs() const { return all_lp_; }
  bool cancelled() const { return cancelled_; }
  void cancel() { cancelled_ = true; }
  bool stop_hit() const { return stops_.hit(); }

 private:
  bool emit(const std::string& s, bool last = false) {
    if (cancelled_ || (s.empty() && !(last && !pending_lp_.empty()))) return !cancelled_;
    text_ += s;
    nlohmann::json lp;
    if (logprobs_ >= 0) {
      lp = pending_lp_.to_json();
      pending_lp_ = {};
    }
    if (!sink_(s, lp)) cancelled_ = true;
    return !cancelled_;
  }
  const ChatCodec& codec_;
  std::vector<int32_t> end_ids_;
  StopMatcher stops_;
  Sink sink_;
  int logprobs_;
  const std::vector<uint8_t>* allowed_ = nullptr;
  std::string pending_, text_;
  size_t offset_ = 0;
  CompletionLogprobs pending_lp_, all_lp_;
  bool cancelled_ = false;
};

}  // namespace moesrv
