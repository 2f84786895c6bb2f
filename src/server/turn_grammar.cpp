#include "server/turn_grammar.h"

#include <algorithm>

namespace moesrv {

namespace {
bool ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
constexpr uint8_t kMaxSpaces = 2;  // between structure elements

// Keeps candidates (sorted) whose character at `off` is `c`; false when none is left.
bool narrow(const std::vector<std::string>& cands, uint32_t& lo, uint32_t& hi, uint16_t& off, char c) {
  uint32_t l = lo;
  while (l < hi && (cands[l].size() <= off || cands[l][off] != c)) {
    if (cands[l].size() > off && (unsigned char)cands[l][off] > (unsigned char)c) return false;
    ++l;
  }
  uint32_t h = l;
  while (h < hi && cands[h].size() > off && cands[h][off] == c) ++h;
  if (l == h) return false;
  lo = l, hi = h, ++off;
  return true;
}
}  // namespace

const char* family_name(ToolFamily f) {
  switch (f) {
    case ToolFamily::kGlm: return "glm";
    case ToolFamily::kDeepSeekV3: return "deepseek_v3";
    case ToolFamily::kQwen3: return "qwen3";
    default: return "none";
  }
}

TurnMarkers TurnMarkers::detect(const ChatCodec& codec) {
  auto id = [&](const char* s) { return codec.special_id(s).value_or(-1); };
  TurnMarkers m;
  m.think_open = id("<think>");
  m.think_close = id("</think>");
  if (id("<tool_call>") >= 0 && id("<arg_key>") >= 0) {
    m.family = ToolFamily::kGlm;
    m.call_open = id("<tool_call>"), m.call_close = id("</tool_call>");
    m.key_open = id("<arg_key>"), m.key_close = id("</arg_key>");
    m.value_open = id("<arg_value>"), m.value_close = id("</arg_value>");
  } else if (id("<｜tool▁calls▁begin｜>") >= 0 && id("<｜tool▁sep｜>") >= 0) {
    m.family = ToolFamily::kDeepSeekV3;
    m.call_open = id("<｜tool▁calls▁begin｜>"), m.call_close = id("<｜tool▁calls▁end｜>");
    m.item_open = id("<｜tool▁call▁begin｜>"), m.item_close = id("<｜tool▁call▁end｜>");
    m.sep = id("<｜tool▁sep｜>");
  } else if (id("<tool_call>") >= 0 && id("</tool_call>") >= 0) {
    m.family = ToolFamily::kQwen3;
    m.call_open = id("<tool_call>"), m.call_close = id("</tool_call>");
  }
  m.end_ids = codec.end_of_turn_ids();
  return m;
}

bool TurnMarkers::is_end(int32_t t) const { return std::find(end_ids.begin(), end_ids.end(), t) != end_ids.end(); }

TurnGrammar::TurnGrammar(const TurnMarkers& markers, const std::vector<ToolSpec>& tools, TurnRules rules,
                         const VocabText& vocab)
    : m_(markers), tools_(tools), rules_(std::move(rules)), vocab_(vocab) {
  std::vector<std::pair<std::string, int>> names;
  for (size_t i = 0; i < tools.size(); ++i) {
    bool ok = rules_.tools.empty() || std::find(rules_.tools.begin(), rules_.tools.end(), int(i)) != rules_.tools.end();
    if (ok) names.push_back({tools[i].name, int(i)});
  }
  std::sort(names.begin(), names.end());
  for (auto& [n, i] : names) names_.push_back(n), name_tool_.push_back(i);
  if (names_.empty()) rules_.calls_allowed = rules_.call_required = false;
  if (m_.family == ToolFamily::kNone || m_.call_open < 0) rules_.calls_allowed = rules_.call_required = false;

  // GLM text values with a string enum: the raw strings.
  glm_enums_.resize(tools.size());
  for (size_t t = 0; t < tools.size(); ++t) {
    const JsonSchema::Node& n = args_node(int(t));
    glm_enums_[t].resize(n.keys.size());
    for (size_t k = 0; k < n.keys.size(); ++k) {
      const JsonSchema::Node& v = tools[t].schema->node(n.key_nodes[k]);
      if (!json_value_is_text(v)) continue;
      for (auto& e : v.enums) {
        auto j = nlohmann::json::parse(e, nullptr, false);
        if (j.is_string()) glm_enums_[t][k].push_back(j.get<std::string>());
      }
      std::sort(glm_enums_[t][k].begin(), glm_enums_[t][k].end());
    }
  }
  using K = Step::Kind;
  if (m_.family == ToolFamily::kQwen3) {
    program_ = {{K::kLiteral, -1, "\n{\"name\": \""},
                {K::kName, -1, ""},
                {K::kLiteral, -1, "\", \"arguments\": "},
                {K::kArgs, -1, ""},
                {K::kLiteral, -1, "}\n"},
                {K::kMarker, m_.call_close, ""}};
  } else if (m_.family == ToolFamily::kDeepSeekV3) {
    program_ = {{K::kMarker, m_.item_open, ""},   {K::kLiteral, -1, "function"},
                {K::kMarker, m_.sep, ""},         {K::kName, -1, ""},
                {K::kLiteral, -1, "\n```json\n"}, {K::kArgs, -1, ""},
                {K::kLiteral, -1, "\n```"},       {K::kMarker, m_.item_close, ""}};
  }
}

const JsonSchema::Node& TurnGrammar::args_node(int tool) const {
  const auto& s = tools_[size_t(tool)].schema;
  return s->node(s->root());
}

TurnGrammar::State TurnGrammar::initial() const {
  State s;
  s.phase = rules_.start_in_reasoning ? State::kReasoning : State::kContent;
  s.reasoned = rules_.start_in_reasoning;
  if (rules_.content_schema) s.json = JsonMatcher(rules_.content_schema.get(), rules_.content_schema->root(), true);
  return s;
}

bool TurnGrammar::may_end(const State& s) const {
  switch (s.phase) {
    case State::kReasoning: return !rules_.call_required && !rules_.content_schema;
    case State::kContent:
      if (rules_.call_required) return false;
      return !rules_.content_schema || (s.json_content && s.json.complete());
    case State::kAfterCall: return m_.family != ToolFamily::kDeepSeekV3;
    case State::kSectionEnd: return true;
    default: return false;
  }
}

void TurnGrammar::start_call(State& s) const {
  s.phase = State::kCall;
  s.spaces = 0;
  s.tool = -1, s.key = -1, s.used = 0, s.off = 0, s.text_chars = 0;
  if (!rules_.strict_calls) {
    s.step = kFreeStep;
    return;
  }
  s.step = 0;
  enter_step(s);
}

void TurnGrammar::end_call(State& s) const {
  ++s.calls;
  s.phase = State::kAfterCall;
  s.spaces = 0;
}

// Prepares the state for program_[s.step] (JSON formats) or the GLM name.
void TurnGrammar::enter_step(State& s) const {
  s.off = 0;
  if (m_.family == ToolFamily::kGlm) {
    if (s.step == 0) s.lo = 0, s.hi = uint32_t(names_.size());
    return;
  }
  if (s.step >= program_.size()) return;
  const Step& st = program_[s.step];
  if (st.kind == Step::kName) s.lo = 0, s.hi = uint32_t(names_.size());
  if (st.kind == Step::kArgs) {
    const auto& schema = tools_[size_t(s.tool)].schema;
    s.json = JsonMatcher(schema.get(), schema->root(), false);
  }
}

bool TurnGrammar::narrow_names(State& s, char c) const { return narrow(names_, s.lo, s.hi, s.off, c); }

bool TurnGrammar::call_char(State& s, char c) const {
  if (m_.family == ToolFamily::kGlm) return glm_char(s, c);
  for (int guard = 0; guard < 4; ++guard) {
    if (s.step >= program_.size()) return false;
    const Step& st = program_[s.step];
    switch (st.kind) {
      case Step::kMarker: return false;
      case Step::kLiteral:
        if (st.text[s.off] != c) return false;
        if (++s.off == st.text.size()) ++s.step, enter_step(s);
        return true;
      case Step::kName: {
        if (narrow_names(s, c)) return true;
        if (!(s.lo < s.hi && names_[s.lo].size() == s.off)) return false;
        s.tool = name_tool_[s.lo];
        ++s.step, enter_step(s);
        continue;  // the character belongs to the next step
      }
      case Step::kArgs: {
        if (!s.json.complete()) return s.json.feed(c);
        JsonMatcher copy = s.json;
        if (copy.feed(c)) {
          s.json = copy;
          return true;
        }
        ++s.step, enter_step(s);
        continue;
      }
    }
  }
  return false;
}

bool TurnGrammar::call_marker(State& s, int32_t t) const {
  if (m_.family == ToolFamily::kGlm) return glm_marker(s, t);
  if (s.step >= program_.size()) return false;
  const Step& st = program_[s.step];
  if (st.kind != Step::kMarker || st.marker != t) return false;
  ++s.step, enter_step(s);
  if (s.step == program_.size()) end_call(s);
  return true;
}

// ---- GLM: NAME \n <arg_key>K</arg_key> \n <arg_value>V</arg_value> ... </tool_call> ----

bool TurnGrammar::glm_required_done(const State& s) const {
  const auto& n = args_node(s.tool);
  return (n.required & ~s.used) == 0;
}

bool TurnGrammar::glm_key_left(const State& s) const {
  const auto& n = args_node(s.tool);
  if (n.additional) return true;
  for (size_t k = 0; k < n.keys.size(); ++k)
    if (k >= 64 || !(s.used >> k & 1)) return true;
  return false;
}

bool TurnGrammar::glm_char(State& s, char c) const {
  switch (s.step) {
    case kGName:
      if (c == '\n' && s.lo < s.hi && names_[s.lo].size() == s.off) {
        s.tool = name_tool_[s.lo];
        s.step = kGAfterName, s.spaces = 1;
        return true;
      }
      return narrow_names(s, c);
    case kGAfterName:
    case kGAfterKey:
    case kGAfterValue: return ws(c) && ++s.spaces <= kMaxSpaces;
    case kGKey: {
      const auto& n = args_node(s.tool);
      if (s.hi > s.lo) {  // still matching declared keys (unused ones)
        uint32_t lo = s.lo, hi = s.hi;
        uint16_t off = s.off;
        if (narrow(n.keys, lo, hi, off, c)) {
          bool any = false;
          for (uint32_t k = lo; k < hi && !any; ++k) any = k >= 64 || !(s.used >> k & 1);
          if (any) {
            s.lo = lo, s.hi = hi, s.off = off;
            return true;
          }
        }
        if (!n.additional) return false;
        s.hi = s.lo;  // a key of its own
      }
      if (c == '\n' || c == '<') return false;
      ++s.off;
      return true;
    }
    case kGValue: {
      if (s.key >= -1 && s.text_chars != UINT32_MAX) {  // text value
        const auto& en = s.key >= 0 ? glm_enums_[size_t(s.tool)][size_t(s.key)] : std::vector<std::string>();
        if (!en.empty()) return narrow(en, s.lo, s.hi, s.off, c);
        const auto& n = args_node(s.tool);
        const auto& v =
            tools_[size_t(s.tool)].schema->node(s.key >= 0 ? n.key_nodes[size_t(s.key)] : n.additional_node);
        if (((unsigned char)c & 0xC0) != 0x80) {
          if (v.max_length >= 0 && s.text_chars >= uint32_t(v.max_length)) return false;
          ++s.text_chars;
        }
        return true;
      }
      return s.json.feed(c);
    }
  }
  return false;
}

bool TurnGrammar::glm_marker(State& s, int32_t t) const {
  static const std::vector<std::string> kNoEnum;
  s.spaces = 0;
  if (s.step == kGName) {
    if (!(s.lo < s.hi && names_[s.lo].size() == s.off)) return false;
    s.tool = name_tool_[s.lo];
    s.step = kGAfterName;
  }
  const JsonSchema& schema = *tools_[size_t(s.tool)].schema;
  const auto& n = args_node(s.tool);
  switch (s.step) {
    case kGAfterName:
    case kGAfterValue:
      if (t == m_.key_open) {
        if (!glm_key_left(s)) return false;
        s.step = kGKey, s.lo = 0, s.hi = uint32_t(n.keys.size()), s.off = 0;
        return true;
      }
      if (t == m_.call_close && glm_required_done(s)) {
        end_call(s);
        return true;
      }
      return false;
    case kGKey: {
      if (t != m_.key_close || s.off == 0) return false;
      int idx = -1;
      if (s.lo < s.hi && n.keys[s.lo].size() == s.off && (s.lo >= 64 || !(s.used >> s.lo & 1))) idx = int(s.lo);
      if (idx < 0 && !n.additional) return false;
      s.key = idx;
      if (idx >= 0 && idx < 64) s.used |= uint64_t(1) << idx;
      s.step = kGAfterKey;
      return true;
    }
    case kGAfterKey: {
      if (t != m_.value_open) return false;
      int node = s.key >= 0 ? n.key_nodes[size_t(s.key)] : n.additional_node;
      bool text = json_value_is_text(schema.node(node));
      s.step = kGValue, s.off = 0, s.lo = 0, s.hi = 0;
      s.text_chars = text ? 0 : UINT32_MAX;
      if (text && s.key >= 0) s.hi = uint32_t(glm_enums_[size_t(s.tool)][size_t(s.key)].size());
      if (!text) s.json = JsonMatcher(&schema, node, true);
      return true;
    }
    case kGValue: {
      if (t != m_.value_close) return false;
      if (s.text_chars != UINT32_MAX) {
        const auto& en = s.key >= 0 ? glm_enums_[size_t(s.tool)][size_t(s.key)] : kNoEnum;
        if (!en.empty() && !(s.lo < s.hi && en[s.lo].size() == s.off)) return false;
        int node = s.key >= 0 ? n.key_nodes[size_t(s.key)] : n.additional_node;
        if (s.text_chars < uint32_t(schema.node(node).min_length)) return false;
      } else if (!s.json.complete()) {
        return false;
      }
      s.step = kGAfterValue;
      return true;
    }
    default: return false;
  }
}

// ---- the turn ----

bool TurnGrammar::feed_marker(State& s, int32_t t) const {
  if (m_.is_end(t)) {
    if (!may_end(s)) return false;
    s.phase = State::kEnd;
    return true;
  }
  bool more_calls = rules_.calls_allowed && (rules_.max_calls <= 0 || s.calls < rules_.max_calls);
  switch (s.phase) {
    case State::kReasoning:
      if (t != m_.think_close || t < 0) return false;
      s.phase = State::kContent, s.spaces = 0;
      return true;
    case State::kContent:
      if (t == m_.think_open && t >= 0 && !s.reasoned && !s.json_content) {
        s.phase = State::kReasoning, s.reasoned = true;
        return true;
      }
      if (t == m_.call_open && t >= 0 && more_calls && !s.json_content) {
        start_call(s);
        return true;
      }
      return false;
    case State::kCall:
      if (s.step != kFreeStep) return call_marker(s, t);
      if (t == (m_.family == ToolFamily::kDeepSeekV3 ? m_.item_close : m_.call_close)) end_call(s);
      return true;  // a free call body may hold any other marker
    case State::kAfterCall:
      s.spaces = 0;
      if (m_.family == ToolFamily::kDeepSeekV3) {
        if (t == m_.call_close) {
          s.phase = State::kSectionEnd;
          return true;
        }
        if (t == m_.item_open && more_calls) {
          start_call(s);
          if (s.step != kFreeStep) ++s.step, enter_step(s);  // the item marker was step 0
          return true;
        }
        return false;
      }
      if (t == m_.call_open && more_calls) {
        start_call(s);
        return true;
      }
      return false;
    default: return false;
  }
}

bool TurnGrammar::feed_char(State& s, char c) const {
  switch (s.phase) {
    case State::kReasoning: return true;
    case State::kContent:
      if (rules_.call_required) return false;
      if (!rules_.content_schema) return true;
      s.json_content = true;
      return s.json.feed(c);
    case State::kCall: return s.step == kFreeStep || call_char(s, c);
    case State::kAfterCall:
    case State::kSectionEnd: return ws(c) && ++s.spaces <= kMaxSpaces;
    default: return false;
  }
}

bool TurnGrammar::advance(State& s, int32_t token) const {
  if (token < 0 || size_t(token) >= vocab_.bytes.size()) return false;
  if (vocab_.special[size_t(token)]) return feed_marker(s, token);
  const std::string& text = vocab_.bytes[size_t(token)];
  if (text.empty()) return false;
  for (char c : text)
    if (!feed_char(s, c)) return false;
  return true;
}

bool TurnGrammar::text_phase(const State& s) const {
  switch (s.phase) {
    case State::kReasoning: return true;
    case State::kContent: return !rules_.call_required && !rules_.content_schema;
    case State::kCall:
      return s.step == kFreeStep ||
             (m_.family == ToolFamily::kGlm && s.step == kGValue && s.text_chars != UINT32_MAX && s.hi == s.lo && [&] {
               const auto& n = args_node(s.tool);
               int node = s.key >= 0 ? n.key_nodes[size_t(s.key)] : n.additional_node;
               return tools_[size_t(s.tool)].schema->node(node).max_length < 0;
             }());
    default: return false;
  }
}

void TurnGrammar::walk(const VocabText::Trie& trie, int32_t node, const State& s, std::vector<uint8_t>& mask) const {
  for (int32_t child = trie.nodes[size_t(node)].first_child; child >= 0;
       child = trie.nodes[size_t(child)].next_sibling) {
    const VocabText::TrieNode& cn = trie.nodes[size_t(child)];
    State copy = s;
    if (!feed_char(copy, char(cn.byte))) continue;
    if (cn.token >= 0) {
      mask[size_t(cn.token)] = 1;
      for (auto& [n, t] : trie.dups)
        if (n == child) mask[size_t(t)] = 1;
    }
    if (cn.first_child >= 0) walk(trie, child, copy, mask);
  }
}

void TurnGrammar::mask(const State& s, std::vector<uint8_t>& mask) const {
  if (text_phase(s)) {
    mask = vocab_.plain;
  } else {
    mask.assign(vocab_.bytes.size(), 0);
    // Inside a free JSON string every string-safe token that fits is allowed; only the rest is walked.
    const JsonMatcher* live = nullptr;
    if (s.phase == State::kContent && rules_.content_schema && !rules_.call_required) live = &s.json;
    if (s.phase == State::kCall && s.step != kFreeStep) {
      if (m_.family == ToolFamily::kGlm ? s.step == kGValue && s.text_chars == UINT32_MAX
                                        : s.step < program_.size() && program_[s.step].kind == Step::kArgs)
        live = &s.json;
    }
    int32_t room = live ? live->free_string_room() : -1;
    if (room >= 0) {
      for (size_t i = 0; i < mask.size(); ++i)
        if (vocab_.string_chars[i] && int32_t(vocab_.string_chars[i]) <= room) mask[i] = 1;
      walk(vocab_.unsafe, 0, s, mask);
    } else if (s.phase != State::kEnd) {
      walk(vocab_.all, 0, s, mask);
    }
  }
  for (int32_t t : vocab_.special_ids) {
    State copy = s;
    mask[size_t(t)] = feed_marker(copy, t);
  }
}

}  // namespace moesrv
