// ChatCodec backed by the real tokenizer (tokenizer.json) and chat formatting: the model's Jinja chat
// template, or the built-in GLM formatter (GLM-4.5 style or GLM-4.7/5 style).
#pragma once
#include <memory>
#include <string>
#include <unordered_set>

#include "server/chat_codec.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moesrv {

enum class ChatFormat { kAuto, kJinja, kGlm45, kGlm47 };
ChatFormat parse_chat_format(const std::string& s);  // auto | jinja | glm45 | glm47

class TokenizerCodec : public ChatCodec {
 public:
  // `tokenizer_dir` holds tokenizer.json (+ tokenizer_config.json); end-of-turn ids also come from
  // `model_dir`/generation_config.json when present.
  TokenizerCodec(const std::string& tokenizer_dir, const std::string& model_dir, ChatFormat format = ChatFormat::kAuto);

  int64_t vocab_size() const override { return tok_.vocab_size(); }
  std::vector<int32_t> encode(const std::string& text) const override { return tok_.encode(text, true); }
  std::string token_bytes(int32_t id) const override { return tok_.token_text(id); }
  // Every added token is a marker (matched atomically, never text): specials and e.g. Qwen's <tool_call>.
  bool is_special(int32_t id) const override { return tok_.is_added(id) || markers_.count(id); }
  std::optional<int32_t> special_id(const std::string& text) const override;
  std::vector<int32_t> end_of_turn_ids() const override { return end_ids_; }
  std::string render_chat(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                          const nlohmann::ordered_json& template_kwargs) const override;
  const Tokenizer& tokenizer() const { return tok_; }
  ChatFormat format() const { return format_; }

 private:
  Tokenizer tok_;
  ChatFormat format_;
  std::unique_ptr<ChatTemplate> plain_, with_tools_;
  std::unordered_set<int32_t> markers_;  // GLM structure tokens (atomic even when not flagged special)
  std::vector<int32_t> end_ids_;
  bool deepseek_tools_ = false;     // DeepSeek-V3 tool format: arguments are strings, content null on calls
  bool template_has_tools_ = true;  // the template renders `tools`; if not, they are described in a system turn
};

}  // namespace moesrv
