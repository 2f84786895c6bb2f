#include "server/tool_call_grammar.h"

namespace moesrv {

static bool ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

ToolCallGrammar::ToolCallGrammar(const std::vector<ToolSpec>& tools, const std::vector<std::string>& names,
                                 GlmMarkers markers)
    : tools_(tools), m_(markers) {
  for (size_t i = 0; i < tools.size(); ++i) {
    bool ok = names.empty();
    for (auto& n : names) ok |= n == tools[i].name;
    if (ok) allowed_.push_back(int(i));
  }
}

bool ToolCallGrammar::required_done(const State& s) const {
  const ToolSpec& t = tools_[size_t(s.tool)];
  for (auto& r : t.required) {
    bool given = false;
    for (size_t p = 0; p < t.properties.size() && p < 64; ++p)
      if (t.properties[p].name == r) given = s.used >> p & 1;
    if (!given && t.property(r)) return false;
  }
  return true;
}

bool ToolCallGrammar::key_possible(const State& s) const {
  const ToolSpec& t = tools_[size_t(s.tool)];
  if (t.properties.empty()) return true;  // free-form arguments
  for (size_t p = 0; p < t.properties.size() && p < 64; ++p)
    if (!(s.used >> p & 1)) return true;
  return false;
}

bool ToolCallGrammar::feed_char(State& s, char c) const {
  switch (s.phase) {
    case State::kName: {
      if (c == '\n' && s.tool >= 0) { s.phase = State::kAfterName; s.spaces = 1; return true; }
      std::string next = s.text + c;
      s.tool = -1;
      bool prefix = false;
      for (int i : allowed_) {
        const std::string& n = tools_[size_t(i)].name;
        if (n.compare(0, next.size(), next) == 0) prefix = true;
        if (n == next) s.tool = i;
      }
      s.text = std::move(next);
      return prefix;
    }
    case State::kAfterName:
    case State::kAfterKey:
    case State::kAfterValue:
      return ws(c) && ++s.spaces <= kMaxSpaces;
    case State::kKey: {
      const ToolSpec& t = tools_[size_t(s.tool)];
      std::string next = s.text + c;
      if (t.properties.empty()) {  // free-form: any plain key
        s.text = std::move(next);
        return c != '\n' && c != '<';
      }
      bool prefix = false;
      for (size_t p = 0; p < t.properties.size() && p < 64; ++p)
        if (!(s.used >> p & 1) && t.properties[p].name.compare(0, next.size(), next) == 0) prefix = true;
      s.text = std::move(next);
      return prefix;
    }
    case State::kValue:
      return s.text_value || s.json.feed(c);
    case State::kDone:
      return false;
  }
  return false;
}

bool ToolCallGrammar::feed_marker(State& s, int32_t t) const {
  s.spaces = 0;
  auto start_key = [&] {
    s.phase = State::kKey;
    s.text.clear();
    return true;
  };
  auto end_call = [&] {
    if (!required_done(s)) return false;
    s.phase = State::kDone;
    return true;
  };
  switch (s.phase) {
    case State::kName:
      if (s.tool < 0) return false;
      [[fallthrough]];
    case State::kAfterName:
      if (t == m_.key_open) return key_possible(s) && start_key();
      return t == m_.tool_close && end_call();
    case State::kKey: {
      if (t != m_.key_close || s.text.empty()) return false;
      const ToolSpec& tool = tools_[size_t(s.tool)];
      s.prop = -1;
      for (size_t p = 0; p < tool.properties.size() && p < 64; ++p)
        if (tool.properties[p].name == s.text) s.prop = int(p);
      if (s.prop < 0 && !tool.properties.empty()) return false;
      s.phase = State::kAfterKey;
      return true;
    }
    case State::kAfterKey: {
      if (t != m_.value_open) return false;
      const ToolSpec& tool = tools_[size_t(s.tool)];
      std::string type = s.prop >= 0 ? tool.properties[size_t(s.prop)].json_type : "";
      s.text_value = s.prop < 0 || tool.properties[size_t(s.prop)].is_text();
      s.json = JsonPrefixValidator(type);
      s.phase = State::kValue;
      return true;
    }
    case State::kValue:
      if (t != m_.value_close || !(s.text_value || s.json.complete())) return false;
      if (s.prop >= 0) s.used |= uint64_t(1) << s.prop;
      s.phase = State::kAfterValue;
      return true;
    case State::kAfterValue:
      if (t == m_.key_open) return key_possible(s) && start_key();
      return t == m_.tool_close && end_call();
    case State::kDone:
      return false;
  }
  return false;
}

bool ToolCallGrammar::advance(State& s, int32_t token, const VocabText& vocab) const {
  if (token < 0 || size_t(token) >= vocab.bytes.size()) return false;
  if (vocab.special[size_t(token)]) return feed_marker(s, token);
  const std::string& text = vocab.bytes[size_t(token)];
  if (text.empty()) return false;
  for (char c : text)
    if (!feed_char(s, c)) return false;
  return true;
}

void ToolCallGrammar::mask(const State& s, const VocabText& vocab, std::vector<uint8_t>& mask) const {
  mask.assign(vocab.bytes.size(), 0);
  bool any_text = s.phase == State::kValue && s.text_value;  // free text: every plain token fits
  for (size_t i = 0; i < vocab.bytes.size(); ++i) {
    if (vocab.special[i]) {
      State copy = s;
      mask[i] = feed_marker(copy, int32_t(i));
    } else if (any_text) {
      mask[i] = !vocab.bytes[i].empty();
    } else {
      const std::string& text = vocab.bytes[i];
      if (text.empty()) continue;
      State copy = s;  // cheap: short strings, small JSON stack
      bool ok = true;
      for (char c : text)
        if (!(ok = feed_char(copy, c))) break;
      mask[i] = ok;
    }
  }
}

}  // namespace moesrv
