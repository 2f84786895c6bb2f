// What the server needs from a tokenizer + chat template, as one small interface so the HTTP layer can be
// tested with scripted doubles and backed by the real tokenizer in production (see tokenizer_codec.h).
#pragma once
#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace moesrv {

class ChatCodec {
 public:
  virtual ~ChatCodec() = default;
  virtual int64_t vocab_size() const = 0;
  // Text -> ids; special-token text (e.g. "<|user|>") maps to the special ids.
  virtual std::vector<int32_t> encode(const std::string& text) const = 0;
  // The raw bytes a token stands for (may be a partial UTF-8 sequence); special tokens give their text.
  virtual std::string token_bytes(int32_t id) const = 0;
  virtual bool is_special(int32_t id) const = 0;
  virtual std::optional<int32_t> special_id(const std::string& text) const = 0;
  // Tokens that end an assistant turn (EOS, <|user|>, <|observation|>, ...).
  virtual std::vector<int32_t> end_of_turn_ids() const = 0;
  // Renders a conversation to the prompt text (messages already normalised, tool_call arguments as objects).
  virtual std::string render_chat(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                  const nlohmann::ordered_json& template_kwargs) const = 0;
};

// The logits of the tokens the tokenizer knows: a model's vocabulary is often padded beyond it (DeepSeek-V3 129280
// vs 128815 ids), and those ids can neither be sampled nor shown, so logprobs are over the tokenizer's ids.
inline std::span<const float> tokenizer_logits(const ChatCodec& codec, std::span<const float> logits) {
  return logits.first(std::min(logits.size(), size_t(std::max<int64_t>(codec.vocab_size(), 0))));
}

}  // namespace moesrv
