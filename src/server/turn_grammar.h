// Grammar-constrained decoding of one assistant turn: a single automaton over tokens (markers) and characters
// (text) that serves every constraint the API offers, for every tool-call format:
//   * tool_choice none / auto / required / named, parallel_tool_calls (max calls),
//   * the strict tool grammar: a declared name, then arguments that are valid JSON under the tool's schema
//     (GLM: <arg_key>/<arg_value> pairs typed by the schema), and no end of turn inside a call,
//   * response_format json_object / json_schema: the content is one JSON value under the schema,
//   * reasoning: nothing but </think> leaves it; no call starts inside it; it must close before a required call.
// Phases: reasoning -> content -> call -> after call (-> DeepSeek section end) -> end.
// The token mask runs candidate texts through a copy of the state, walking the vocabulary's byte trie so shared
// prefixes are checked once.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "server/chat_codec.h"
#include "server/chat_request.h"
#include "server/json_schema.h"
#include "server/vocab_text.h"

namespace moesrv {

enum class ToolFamily : uint8_t { kNone, kGlm, kDeepSeekV3, kQwen3 };
const char* family_name(ToolFamily f);

// Structure tokens of the model's chat format (-1: absent), detected from the tokenizer's special tokens.
struct TurnMarkers {
  ToolFamily family = ToolFamily::kNone;
  int32_t think_open = -1, think_close = -1;
  int32_t call_open = -1, call_close = -1;  // GLM/Qwen3: <tool_call> </tool_call>; DeepSeek: calls begin / end
  int32_t key_open = -1, key_close = -1, value_open = -1, value_close = -1;  // GLM arguments
  int32_t item_open = -1, item_close = -1,
          sep = -1;              // DeepSeek: <｜tool▁call▁begin｜> <｜tool▁call▁end｜> <｜tool▁sep｜>
  std::vector<int32_t> end_ids;  // end of turn
  static TurnMarkers detect(const ChatCodec& codec);
  bool is_end(int32_t t) const;
};

struct TurnRules {
  bool calls_allowed = false;                        // tools given and tool_choice is not none
  bool call_required = false;                        // tool_choice required or named
  int max_calls = 0;                                 // 0: unlimited (parallel_tool_calls false: 1)
  bool strict_calls = false;                         // constrain call bodies (names, argument schemas)
  std::vector<int> tools;                            // tool indices a call may name (empty: all)
  std::shared_ptr<const JsonSchema> content_schema;  // response_format: the content is JSON under it
  bool start_in_reasoning = false;
};

class TurnGrammar {
 public:
  TurnGrammar(const TurnMarkers& markers, const std::vector<ToolSpec>& tools, TurnRules rules, const VocabText& vocab);

  struct State {
    enum Phase : uint8_t { kReasoning, kContent, kCall, kAfterCall, kSectionEnd, kEnd } phase = kContent;
    bool reasoned = false;      // a reasoning block was opened (or the prompt opened it)
    bool json_content = false;  // content has started as JSON (response_format)
    uint8_t spaces = 0;         // bounded whitespace runs between structure elements
    uint16_t calls = 0;         // completed calls
    uint8_t step = 0;           // position in the call's program
    uint16_t off = 0;           // characters of a literal / name / key typed so far
    uint32_t lo = 0, hi = 0;    // candidate range (names, keys, enum strings)
    int32_t tool = -1;          // tool named by the current call
    int32_t key = -1;           // GLM: property whose value is being written (-1: free-form)
    uint64_t used = 0;          // GLM: properties given
    uint32_t text_chars = 0;    // GLM: characters of a text value
    JsonMatcher json;           // arguments (JSON formats), a typed GLM value, or the content (response_format)
  };

  State initial() const;
  // Advances by one generated token; false if the grammar forbids it (the state is then unspecified).
  bool advance(State& s, int32_t token) const;
  // mask[i] = 1 if token i may come next.
  void mask(const State& s, std::vector<uint8_t>& mask) const;
  // End of turn allowed now (for callers that need to know, e.g. the forced-token logic).
  bool may_end(const State& s) const;
  // Tokens that must still come, at least, before the turn may end, counting each character as a token (a
  // byte-level vocabulary spells any text that way) and each marker as one; JsonSchema::kFar: it cannot end.
  uint32_t tokens_to_end(const State& s) const;
  const TurnRules& rules() const { return rules_; }

 private:
  static constexpr uint8_t kFreeStep = 255;  // a call body that is not constrained
  // GLM: NAME \n <arg_key>K</arg_key> \n <arg_value>V</arg_value> ... </tool_call>
  enum GlmStep : uint8_t { kGName, kGAfterName, kGKey, kGAfterKey, kGValue, kGAfterValue };
  struct Step {  // one element of a JSON-format call's layout
    enum Kind { kMarker, kLiteral, kName, kArgs } kind;
    int32_t marker = -1;
    std::string text;
  };
  bool feed_char(State& s, char c) const;
  bool feed_marker(State& s, int32_t t) const;
  bool call_char(State& s, char c) const;
  bool call_marker(State& s, int32_t t) const;
  bool glm_char(State& s, char c) const;
  bool glm_marker(State& s, int32_t t) const;
  void start_call(State& s) const;
  void end_call(State& s) const;
  bool text_phase(const State& s) const;  // free text: every plain token is allowed
  void walk(const VocabText::Trie& trie, int32_t node, const State& s, std::vector<uint8_t>& mask) const;
  void enter_step(State& s) const;
  bool narrow_names(State& s, char c) const;
  bool glm_required_done(const State& s) const;
  bool glm_key_left(const State& s) const;
  const JsonSchema::Node& args_node(int tool) const;
  // turn_closing.cpp
  uint64_t call_rest(const State& s) const;             // from inside a call to its end
  uint64_t whole_call() const;                          // a call's body, from its opening marker
  uint64_t glm_missing(int tool, uint64_t used) const;  // the required GLM arguments not given yet
  uint64_t glm_value_min(int tool, int key) const;

  TurnMarkers m_;
  const std::vector<ToolSpec>& tools_;
  TurnRules rules_;
  const VocabText& vocab_;
  std::vector<std::string> names_;                                // allowed tool names, sorted
  std::vector<int> name_tool_;                                    // tool index of names_[i]
  std::vector<std::vector<std::vector<std::string>>> glm_enums_;  // [tool][key]: raw string enum values, sorted
  std::vector<Step> program_;                                     // JSON formats: the call's layout
};

}  // namespace moesrv
