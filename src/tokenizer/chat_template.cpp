#include "tokenizer/chat_template.h"

#include "tokenizer/jinja/template.h"
#include "util/error.h"

namespace moesrv {
namespace {

std::string config_token(const nlohmann::json& cfg, const char* key) {
  if (!cfg.contains(key)) return "";
  const auto& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}

}  // namespace

ChatTemplate::ChatTemplate(const std::string& source, std::string bos, std::string eos)
    : tmpl_(std::make_unique<jinja::Template>(source)), bos_(std::move(bos)), eos_(std::move(eos)) {}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

ChatTemplate ChatTemplate::from_config(const nlohmann::json& cfg, bool with_tools) {
  if (!cfg.contains("chat_template")) fail("tokenizer_config.json has no chat_template");
  const auto& ct = cfg["chat_template"];
  std::string source;
  if (ct.is_string()) {
    source = ct.get<std::string>();
  } else if (ct.is_array()) {
    for (const auto& t : ct) {
      std::string name = t.value("name", "");
      if (name == "default" && source.empty()) source = t.value("template", "");
      if (name == "tool_use" && with_tools) {
        source = t.value("template", "");
        break;
      }
    }
  }
  if (source.empty()) fail("tokenizer_config.json: no usable chat_template");
  return ChatTemplate(source, config_token(cfg, "bos_token"), config_token(cfg, "eos_token"));
}

std::string ChatTemplate::render(const ChatRequest& r) const {
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  ctx["messages"] = r.messages;
  ctx["tools"] = r.tools;
  ctx["add_generation_prompt"] = r.add_generation_prompt;
  ctx["bos_token"] = bos_;
  ctx["eos_token"] = eos_;
  for (auto it = r.kwargs.begin(); it != r.kwargs.end(); ++it) ctx[it.key()] = it.value();
  return tmpl_->render(ctx);
}

}  // namespace moesrv
