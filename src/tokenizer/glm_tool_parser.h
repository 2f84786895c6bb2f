// Incremental parser for GLM model output: splits streamed text into reasoning (inside
// <think>...</think>), visible content, and tool calls
//   <tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>
// (GLM-4.5/4.6 put newlines between the parts; both layouts are accepted). Argument values are
// typed with the tool's JSON schema: "string" parameters stay strings, others are parsed as JSON
// (falling back to a string when that fails). Tags may be split across pieces.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace moesrv {

struct GlmToolCall {
  std::string name;
  std::string arguments;  // JSON object text, e.g. {"city":"Paris","days":2}
};

struct GlmParseEvent {
  enum Kind { Reasoning, Content, ToolCall };
  Kind kind;
  std::string text;   // Reasoning / Content
  GlmToolCall call;   // ToolCall
};

class GlmToolCallParser {
 public:
  // `tools`: the request's OpenAI tools array (or null). `in_reasoning`: the prompt ended with
  // "<think>", so output starts inside the reasoning block.
  explicit GlmToolCallParser(const nlohmann::json& tools = nullptr, bool in_reasoning = true);

  std::vector<GlmParseEvent> feed(std::string_view piece);
  // End of output: flushes held-back text; an unterminated tool call is returned as content.
  std::vector<GlmParseEvent> finish();

  // Parses a complete tool-call body (the text between <tool_call> and </tool_call>).
  GlmToolCall parse_call(std::string_view body) const;

 private:
  enum class State { Reasoning, Content, ToolCall };
  void emit_text(GlmParseEvent::Kind kind, std::string_view text, std::vector<GlmParseEvent>& out);
  void flush_pending_ws(GlmParseEvent::Kind kind, std::vector<GlmParseEvent>& out);
  void process(bool final, std::vector<GlmParseEvent>& out);

  nlohmann::json tools_;
  State state_;
  std::string buf_;          // unprocessed input
  std::string call_body_;    // inside <tool_call>
  std::string pending_ws_;   // trailing whitespace held until more text follows
  bool at_segment_start_ = true;  // drop leading whitespace of a reasoning/content segment
};

}  // namespace moesrv
