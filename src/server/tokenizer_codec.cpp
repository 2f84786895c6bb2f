#include "server/tokenizer_codec.h"

#include <filesystem>
#include <fstream>
#include <regex>

#include "tokenizer/glm_chat.h"
#include "util/error.h"

namespace moesrv {

namespace fs = std::filesystem;
using nlohmann::json;

ChatFormat parse_chat_format(const std::string& s) {
  if (s == "auto") return ChatFormat::kAuto;
  if (s == "jinja") return ChatFormat::kJinja;
  if (s == "glm45") return ChatFormat::kGlm45;
  if (s == "glm47") return ChatFormat::kGlm47;
  fail("unknown chat format '{}' (auto, jinja, glm45, glm47)", s);
}

static const char* kGlmMarkers[] = {"<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                                    "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>",
                                    "<|user|>", "<|assistant|>", "<|system|>", "<|observation|>"};

TokenizerCodec::TokenizerCodec(const std::string& tokenizer_dir, const std::string& model_dir, ChatFormat format)
    : tok_(Tokenizer::load((fs::path(tokenizer_dir) / "tokenizer.json").string())), format_(format) {
  for (auto* m : kGlmMarkers)
    if (auto id = tok_.token_id(m)) markers_.insert(*id);
  bool has_template = tok_.config().contains("chat_template");
  bool glm = tok_.token_id("[gMASK]").has_value();
  if (format_ == ChatFormat::kAuto) format_ = has_template ? ChatFormat::kJinja : glm ? ChatFormat::kGlm47 : ChatFormat::kJinja;
  deepseek_tools_ = tok_.token_id("<｜tool▁sep｜>").has_value() && tok_.token_id("<｜tool▁calls▁begin｜>").has_value();
  if (format_ == ChatFormat::kJinja) {
    std::string sources = tok_.config()["chat_template"].dump();
    template_has_tools_ = std::regex_search(sources, std::regex("\\btools\\b"));
    MOESRV_CHECK(has_template, "{}: tokenizer_config.json has no chat_template (use --chat-format glm45/glm47)", tokenizer_dir);
    plain_ = std::make_unique<ChatTemplate>(ChatTemplate::from_config(tok_.config(), false));
    with_tools_ = std::make_unique<ChatTemplate>(ChatTemplate::from_config(tok_.config(), true));
  }
  auto add_end = [&](int64_t id) {
    if (id >= 0 && id < tok_.vocab_size() && std::find(end_ids_.begin(), end_ids_.end(), int32_t(id)) == end_ids_.end())
      end_ids_.push_back(int32_t(id));
  };
  if (auto eos = tok_.eos_id()) add_end(*eos);
  for (auto* t : {"<|endoftext|>", "<|user|>", "<|observation|>", "<|im_end|>"})
    if (auto id = tok_.token_id(t)) add_end(*id);
  std::ifstream gen(fs::path(model_dir) / "generation_config.json");
  if (gen) {
    json g = json::parse(gen, nullptr, false);
    if (!g.is_discarded() && g.contains("eos_token_id")) {
      const json& e = g["eos_token_id"];
      if (e.is_number_integer()) add_end(e.get<int64_t>());
      if (e.is_array())
        for (auto& x : e)
          if (x.is_number_integer()) add_end(x.get<int64_t>());
    }
  }
}

std::optional<int32_t> TokenizerCodec::special_id(const std::string& text) const {
  auto id = tok_.token_id(text);
  if (id && (tok_.is_added(*id) || markers_.count(*id))) return id;
  return std::nullopt;
}

namespace {

// For templates that do not render `tools` (DeepSeek-V3's): the tools and the call format, as a system turn.
std::string deepseek_tools_prompt(const nlohmann::ordered_json& tools) {
  std::string s = "## Tools\nYou have access to the following tools:\n";
  for (auto& t : tools) {
    const auto& fn = t.value("function", nlohmann::ordered_json::object());
    auto text = [&](const char* key) {  // a string field, or "" (absent, null)
      return fn.contains(key) && fn[key].is_string() ? fn[key].get<std::string>() : std::string();
    };
    s += "\n### " + text("name") + "\nDescription: " + text("description") +
         "\n\nParameters: " + fn.value("parameters", nlohmann::ordered_json::object()).dump() + "\n";
  }
  s += "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>tool_call_name\n```json\ntool_call_"
       "arguments\n```"
       "<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\n\nWhere:\n\n"
       "- `tool_call_name` must be an exact match to one of the available tools\n"
       "- `tool_call_arguments` must be valid JSON based on the required parameters and parameter types\n"
       "- For multiple tool calls, chain them directly without separators or spaces\n";
  return s;
}

}  // namespace

std::string TokenizerCodec::render_chat(const nlohmann::ordered_json& messages_in, const nlohmann::ordered_json& tools,
                                        const nlohmann::ordered_json& kwargs) const {
  nlohmann::ordered_json messages = messages_in;
  if (deepseek_tools_) {
    // DeepSeek-V3's template concatenates arguments as text and renders calls only when content is null.
    for (auto& m : messages) {
      if (!m.contains("tool_calls")) continue;
      if (m.value("content", std::string()).empty()) m["content"] = nullptr;
      for (auto& c : m["tool_calls"])
        if (c.contains("function") && !c["function"]["arguments"].is_string())
          c["function"]["arguments"] = c["function"]["arguments"].dump();
    }
  }
  if (!template_has_tools_ && !tools.empty() && deepseek_tools_) {
    std::string text = deepseek_tools_prompt(tools);
    if (!messages.empty() && messages[0].value("role", "") == "system")
      messages[0]["content"] = messages[0].value("content", std::string()) + "\n\n" + text;
    else messages.insert(messages.begin(), nlohmann::ordered_json{{"role", "system"}, {"content", text}});
  }
  ChatRequest req;
  req.messages = messages;
  req.tools = tools.empty() ? nlohmann::ordered_json() : tools;
  req.kwargs = kwargs;
  req.add_generation_prompt = true;
  switch (format_) {
    case ChatFormat::kGlm45: return format_glm_chat(req, {.style = GlmStyle::V45});
    case ChatFormat::kGlm47: return format_glm_chat(req, {.style = GlmStyle::V47});
    default: return (tools.empty() ? plain_ : with_tools_)->render(req);
  }
}

}  // namespace moesrv
