#include "server/tokenizer_codec.h"

#include <filesystem>
#include <fstream>

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
  if (format_ == ChatFormat::kJinja) {
    MOESRV_CHECK(has_template, "{}: tokenizer_config.json has no chat_template (use --chat-format glm45/glm47)", tokenizer_dir);
    plain_ = std::make_unique<ChatTemplate>(ChatTemplate::from_config(tok_.config(), false));
    with_tools_ = std::make_unique<ChatTemplate>(ChatTemplate::from_config(tok_.config(), true));
  }
  auto add_end = [&](int64_t id) {
    if (id >= 0 && id < tok_.vocab_size() && std::find(end_ids_.begin(), end_ids_.end(), int32_t(id)) == end_ids_.end())
      end_ids_.push_back(int32_t(id));
  };
  if (auto eos = tok_.eos_id()) add_end(*eos);
  for (auto* t : {"<|endoftext|>", "<|user|>", "<|observation|>"})
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
  if (id && (tok_.is_special(*id) || markers_.count(*id))) return id;
  return std::nullopt;
}

std::string TokenizerCodec::render_chat(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                        const nlohmann::ordered_json& kwargs) const {
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
