// Splits GLM-style model output into reasoning, content and tool calls, token by token, for streaming.
// Works on token ids: the markers (<think>, </think>, <tool_call>, <arg_key>, ...) are single special tokens,
// so no text lookahead is needed; the text between them is decoded incrementally as UTF-8.
//   <think>R</think>\nC<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>
// Tool arguments are streamed as the JSON text of an object; values of free-text properties become JSON
// strings, others are parsed as JSON (falling back to a string).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "server/chat_codec.h"
#include "server/chat_request.h"

namespace moesrv {

struct GlmMarkers {
  int32_t think_open = -1, think_close = -1, tool_open = -1, tool_close = -1;
  int32_t key_open = -1, key_close = -1, value_open = -1, value_close = -1;
  static GlmMarkers from(const ChatCodec& codec);
};

struct ToolCallDelta {
  int index = 0;
  std::string id, name;  // set on the first delta of a call only
  std::string arguments;
};

struct ChatDelta {
  std::string reasoning, content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

struct ParsedToolCall {
  std::string id, name, arguments;  // arguments: JSON object text
};

class GlmOutputParser {
 public:
  enum class Mode { kContent, kReasoning, kToolCall };
  GlmOutputParser(const ChatCodec& codec, const std::vector<ToolSpec>* tools, bool start_in_reasoning);

  void push(int32_t token, ChatDelta& out);
  void finish(ChatDelta& out);  // flushes held text, closes an unterminated tool call

  Mode mode() const { return mode_; }
  bool tool_call_complete() const { return !calls_.empty() && mode_ != Mode::kToolCall; }
  const std::string& reasoning() const { return reasoning_; }
  const std::string& content() const { return content_; }
  const std::vector<ParsedToolCall>& tool_calls() const { return calls_; }

 private:
  enum class ToolPart { kName, kBetween, kKey, kValue };
  void on_text(const std::string& text, ChatDelta& out);
  void emit_text(std::string text, ChatDelta& out);  // reasoning/content with whitespace trimming
  void flush_segment(ChatDelta& out);
  void finish_name(const std::string& name, ChatDelta& out);
  void start_value(ChatDelta& out);
  void end_value(ChatDelta& out);
  void end_tool_call(ChatDelta& out);
  void emit_args(const std::string& s, ChatDelta& out);
  std::string take_utf8();

  const ChatCodec& codec_;
  const std::vector<ToolSpec>* tools_;
  GlmMarkers m_;
  Mode mode_;
  std::string bytes_;          // undecoded tail (partial UTF-8)
  bool segment_started_ = false;
  std::string held_space_;     // trailing whitespace, emitted only if more text follows
  std::string reasoning_, content_;
  std::vector<ParsedToolCall> calls_;
  ToolPart part_ = ToolPart::kName;
  std::string name_, key_, value_;
  bool value_is_text_ = false;
  int args_emitted_ = 0;
};

}  // namespace moesrv
