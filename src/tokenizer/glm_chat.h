// Built-in chat formatter for GLM-4.5 / 4.6 / 4.7 / 5 (no Jinja needed), following the official
// GLM chat templates:
//   [gMASK]<sop>[<|system|> tools block]<|system|>..<|user|>..<|assistant|><think>R</think>C
//   <tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call><|observation|><tool_response>..</tool_response>
// V45 (GLM-4.5/4.6) puts newlines after role tags and between tool-call parts; V47 (GLM-4.7/5) does not.
#pragma once
#include <string>

#include "tokenizer/chat_template.h"

namespace moesrv {

enum class GlmStyle {
  V45,  // GLM-4.5, GLM-4.6
  V47,  // GLM-4.7, GLM-5
};

struct GlmChatOptions {
  GlmStyle style = GlmStyle::V47;
  // Generation prompt: V47 ends with "<|assistant|><think>" (thinking) or "<|assistant|></think>";
  // V45 ends with "<|assistant|>" or "<|assistant|>\n<think></think>" and appends "/nothink" to user turns.
  bool enable_thinking = true;
  // Drop reasoning of assistant turns before the last user message (the templates' default).
  bool clear_thinking = true;
};

// Request kwargs "enable_thinking" / "clear_thinking" (booleans) override the options.
std::string format_glm_chat(const ChatRequest& request, GlmChatOptions options = {});

}  // namespace moesrv
