// TurnGrammar::tokens_to_end: how many tokens a turn needs, at least, to reach an allowed end from a state. The
// decoder keeps it within the tokens left, so a required call (or JSON content) is closed before max_tokens.
#include <algorithm>

#include "server/turn_grammar.h"

namespace moesrv {

namespace {
constexpr uint64_t kFar = JsonSchema::kFar;
}

uint64_t TurnGrammar::glm_value_min(int tool, int key) const {
  const JsonSchema::Node& n = args_node(tool);
  const JsonSchema::Node& v =
      tools_[size_t(tool)].schema->node(key >= 0 ? n.key_nodes[size_t(key)] : n.additional_node);
  if (!json_value_is_text(v)) return v.min_chars;
  if (key >= 0 && !glm_enums_[size_t(tool)][size_t(key)].empty()) {
    uint64_t best = kFar;
    for (auto& e : glm_enums_[size_t(tool)][size_t(key)]) best = std::min<uint64_t>(best, e.size());
    return best;
  }
  return uint64_t(v.min_length);
}

// <arg_key>K</arg_key><arg_value>V</arg_value> for each required key not in `used`.
uint64_t TurnGrammar::glm_missing(int tool, uint64_t used) const {
  const JsonSchema::Node& n = args_node(tool);
  uint64_t sum = 0;
  for (size_t k = 0; k < n.keys.size() && k < 64; ++k)
    if ((n.required >> k & 1) && !(used >> k & 1)) sum += 4 + n.keys[k].size() + glm_value_min(tool, int(k));
  return sum;
}

uint64_t TurnGrammar::whole_call() const {
  if (!rules_.strict_calls) return 1;  // a free body: its closing marker
  State s;
  s.phase = State::kCall;
  s.step = 0;
  enter_step(s);
  return call_rest(s);
}

uint64_t TurnGrammar::call_rest(const State& s) const {
  if (s.step == kFreeStep) return 1;
  if (m_.family == ToolFamily::kGlm) {
    const uint64_t close = 1;  // </tool_call>
    switch (s.step) {
      case kGName: {
        uint64_t best = kFar;
        for (uint32_t i = s.lo; i < s.hi; ++i)
          best = std::min(best, names_[i].size() - s.off + glm_missing(name_tool_[i], 0));
        return best + close;
      }
      case kGAfterName:
      case kGAfterValue: return glm_missing(s.tool, s.used) + close;
      case kGKey: {
        const JsonSchema::Node& n = args_node(s.tool);
        uint64_t typed = s.off ? 0 : 1;  // a key of its own needs a character
        uint64_t best = n.additional ? typed + 3 + glm_value_min(s.tool, -1) + glm_missing(s.tool, s.used) : kFar;
        for (uint32_t k = s.lo; k < s.hi; ++k)
          if (k >= 64 || !(s.used >> k & 1)) {
            uint64_t used = k < 64 ? s.used | uint64_t(1) << k : s.used;
            best = std::min(best,
                            n.keys[k].size() - s.off + 3 + glm_value_min(s.tool, int(k)) + glm_missing(s.tool, used));
          }
        return best + close;
      }
      case kGAfterKey: return 2 + glm_value_min(s.tool, s.key) + glm_missing(s.tool, s.used) + close;
      case kGValue: {
        uint64_t value = 0;
        if (s.text_chars == UINT32_MAX) {
          value = s.json.chars_to_complete();
        } else if (s.key >= 0 && !glm_enums_[size_t(s.tool)][size_t(s.key)].empty()) {
          value = kFar;
          for (uint32_t i = s.lo; i < s.hi; ++i)
            value = std::min<uint64_t>(value, glm_enums_[size_t(s.tool)][size_t(s.key)][i].size() - s.off);
        } else {
          const JsonSchema::Node& n = args_node(s.tool);
          int node = s.key >= 0 ? n.key_nodes[size_t(s.key)] : n.additional_node;
          int min_length = tools_[size_t(s.tool)].schema->node(node).min_length;
          value = uint64_t(std::max<int64_t>(0, int64_t(min_length) - int64_t(s.text_chars)));
        }
        return value + 1 + glm_missing(s.tool, s.used) + close;
      }
      default: return kFar;
    }
  }
  // JSON formats: the rest of the current step, then the later steps (a name counts with its tool's arguments).
  uint64_t rest = 0;
  bool named_with_args = false;
  for (size_t i = s.step; i < program_.size(); ++i) {
    const Step& st = program_[i];
    bool current = i == s.step;
    switch (st.kind) {
      case Step::kMarker: rest += 1; break;
      case Step::kLiteral: rest += st.text.size() - (current ? s.off : 0); break;
      case Step::kName: {
        uint32_t lo = current ? s.lo : 0, hi = current ? s.hi : uint32_t(names_.size());
        uint64_t best = kFar;
        for (uint32_t j = lo; j < hi; ++j)
          best = std::min(best, names_[j].size() - (current ? s.off : 0) + args_node(name_tool_[j]).min_chars);
        rest += best;
        named_with_args = true;
        break;
      }
      case Step::kArgs:
        if (named_with_args) break;
        rest += current ? s.json.chars_to_complete() : args_node(s.tool).min_chars;
        break;
    }
  }
  return rest;
}

uint32_t TurnGrammar::tokens_to_end(const State& s) const {
  const uint64_t end = 1, after_call = m_.family == ToolFamily::kDeepSeekV3 ? 2 : 1;  // DeepSeek: section end
  uint64_t n = kFar;
  switch (s.phase) {
    case State::kEnd: n = 0; break;
    case State::kSectionEnd: n = end; break;
    case State::kAfterCall: n = after_call; break;
    case State::kCall: n = call_rest(s) + after_call; break;
    case State::kContent:
    case State::kReasoning: {
      uint64_t content = end;
      if (rules_.call_required) content = 1 + whole_call() + after_call;
      else if (rules_.content_schema)
        content = (s.json_content ? s.json.chars_to_complete()
                                  : rules_.content_schema->node(rules_.content_schema->root()).min_chars) +
                  end;
      if (s.phase == State::kContent) n = content;
      else if (may_end(s)) n = end;
      else if (m_.think_close >= 0) n = 1 + content;
      break;
    }
  }
  return uint32_t(std::min(n, kFar));
}

}  // namespace moesrv
