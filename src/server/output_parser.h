// Splits model output into reasoning, content and tool calls, token by token, for streaming. One subclass per
// tool-call format (GLM, DeepSeek-V3, Qwen3), chosen from the tokenizer's markers (TurnMarkers::detect).
// Shared rules: structure tokens are never text; other special tokens never reach reasoning or content; a
// call marker inside reasoning is not a call; partial UTF-8 is held until the character completes;
// whitespace around structure is trimmed.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "server/chat_codec.h"
#include "server/chat_request.h"
#include "server/turn_grammar.h"

namespace moesrv {

struct ToolCallDelta {
  int index = 0;
  std::string id, name;  // set on the first delta of a call only
  std::string arguments;
};

struct ChatDelta {
  std::string reasoning, content;
  std::vector<ToolCallDelta> tool_calls;
  nlohmann::json logprobs;  // array of OpenAI logprob entries for the content of this delta (null: none)
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty() && logprobs.is_null(); }
};

struct ParsedToolCall {
  std::string id, name, arguments;  // arguments: JSON object text
};

std::string new_tool_call_id();

class OutputParser {
 public:
  enum class Mode { kContent, kReasoning, kToolCall };
  virtual ~OutputParser() = default;
  virtual void push(int32_t token, ChatDelta& out) = 0;
  virtual void finish(ChatDelta& out) = 0;  // flushes held text, closes an unterminated tool call

  Mode mode() const { return mode_; }
  const std::string& reasoning() const { return reasoning_; }
  const std::string& content() const { return content_; }
  const std::vector<ParsedToolCall>& tool_calls() const { return calls_; }

  static std::unique_ptr<OutputParser> create(const ChatCodec& codec, const TurnMarkers& markers,
                                              const std::vector<ToolSpec>* tools, bool start_in_reasoning);

 protected:
  OutputParser(const ChatCodec& codec, const std::vector<ToolSpec>* tools, bool start_in_reasoning);
  // Text of a plain token for the reasoning/content channel (UTF-8 reassembled).
  void text_token(int32_t token, ChatDelta& out);
  void flush_bytes(ChatDelta& out);  // a partial character left at a marker
  void emit_text(std::string text, ChatDelta& out);
  void end_segment();  // trailing whitespace before a marker is formatting
  // Tool calls: opens a call (emits id + name), appends argument text.
  void open_call(const std::string& name, ChatDelta& out);
  void emit_args(const std::string& s, ChatDelta& out);
  std::string take_utf8(std::string& bytes);

  const ChatCodec& codec_;
  const std::vector<ToolSpec>* tools_;
  Mode mode_;
  std::string bytes_;  // undecoded tail (partial UTF-8)
  bool segment_started_ = false;
  std::string held_space_;
  std::string reasoning_, content_;
  std::vector<ParsedToolCall> calls_;
};

}  // namespace moesrv
