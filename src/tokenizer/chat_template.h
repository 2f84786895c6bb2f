// Renders a model's Jinja chat template (tokenizer_config.json "chat_template") for an
// OpenAI-style conversation, like transformers' apply_chat_template(tokenize=False).
#pragma once
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace moesrv {

namespace jinja {
class Template;
}

struct ChatRequest {
  // OpenAI messages: role, content, tool_calls, tool_call_id, reasoning_content, ... Use
  // ordered_json so that key order (e.g. tool JSON schemas shown to the model) is preserved.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  nlohmann::ordered_json tools;  // null or array of {"type": "function", "function": {...}}
  bool add_generation_prompt = true;
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();  // extra variables: enable_thinking, ...
};

class ChatTemplate {
 public:
  ChatTemplate(const std::string& source, std::string bos_token = "", std::string eos_token = "");
  // Picks "chat_template" from a tokenizer_config.json (string, or list of named templates:
  // "tool_use" when `with_tools` and present, else "default"); bos/eos from the same config.
  static ChatTemplate from_config(const nlohmann::json& tokenizer_config, bool with_tools = false);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  std::string render(const ChatRequest& request) const;

 private:
  std::unique_ptr<jinja::Template> tmpl_;
  std::string bos_, eos_;
};

}  // namespace moesrv
