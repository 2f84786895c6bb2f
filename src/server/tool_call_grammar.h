// Strict tool calls (--strict-tools, or a required/named tool_choice): inside <tool_call>...</tool_call> the
// model may only write a declared function name, then <arg_key>K</arg_key><arg_value>V</arg_value> pairs where
// K is an unused property of that function's schema and V is valid JSON of the declared type (any text for
// string properties); </tool_call> only once every required property is present. Implemented as a character
// automaton; the token mask runs each candidate token's text through a copy of the current state.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "server/chat_request.h"
#include "server/glm_output_parser.h"
#include "server/json_prefix_validator.h"
#include "server/vocab_text.h"

namespace moesrv {

class ToolCallGrammar {
 public:
  // `allowed_names` empty: every tool in `tools` is allowed.
  ToolCallGrammar(const std::vector<ToolSpec>& tools, const std::vector<std::string>& allowed_names, GlmMarkers markers);

  struct State {
    enum Phase : uint8_t { kName, kAfterName, kKey, kAfterKey, kValue, kAfterValue, kDone } phase = kName;
    int tool = -1;        // index into tools_ once the name is complete
    std::string text;     // name or key typed so far
    int prop = -1;        // property of the current value (-1: free-form)
    uint64_t used = 0;    // bit per property already given
    bool text_value = true;
    uint8_t spaces = 0;   // whitespace run between elements (bounded so weak models cannot stall)
    JsonPrefixValidator json;
  };

  // Advances `s` by a token (the token after <tool_call> onward); false if the grammar forbids it.
  bool advance(State& s, int32_t token, const VocabText& vocab) const;
  // mask[i] = 1 if token i may come next.
  void mask(const State& s, const VocabText& vocab, std::vector<uint8_t>& mask) const;

 private:
  bool feed_char(State& s, char c) const;
  bool feed_marker(State& s, int32_t token) const;
  bool required_done(const State& s) const;
  bool key_possible(const State& s) const;  // another property can still be given
  static constexpr uint8_t kMaxSpaces = 2;
  const std::vector<ToolSpec>& tools_;
  std::vector<int> allowed_;  // tool indices
  GlmMarkers m_;
};

}  // namespace moesrv
