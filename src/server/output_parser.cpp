#include "server/output_parser.h"

#include <cctype>
#include <nlohmann/json.hpp>
#include <random>

namespace moesrv {

using nlohmann::json;

namespace {

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && is_space(s[b])) ++b;
  while (e > b && is_space(s[e - 1])) --e;
  return s.substr(b, e - b);
}

std::string json_escape_body(const std::string& s) {  // JSON string literal without the quotes
  std::string q = json(s).dump(-1, ' ', false, json::error_handler_t::replace);
  return q.substr(1, q.size() - 2);
}

// Length of the longest prefix of `s` made of complete UTF-8 sequences (invalid bytes count as complete).
size_t complete_utf8_prefix(const std::string& s) {
  size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    unsigned char c = s[n - back];
    if ((c & 0xC0) == 0x80) continue;
    size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back ? n - back : n;
  }
  return n;
}

// Replaces every byte that does not start or continue a well-formed UTF-8 character with U+FFFD, so deltas are
// always valid JSON strings (a byte-level model may write any byte).
std::string valid_utf8(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    unsigned char c = (unsigned char)s[i];
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c < 0x80) len = 1;
    else if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c == 0xE0) len = 3, lo = 0xA0;
    else if (c == 0xED) len = 3, hi = 0x9F;
    else if (c >= 0xE1 && c <= 0xEF) len = 3;
    else if (c == 0xF0) len = 4, lo = 0x90;
    else if (c == 0xF4) len = 4, hi = 0x8F;
    else if (c >= 0xF1 && c <= 0xF3) len = 4;
    bool ok = len > 0 && i + len <= s.size();
    for (size_t k = 1; ok && k < len; ++k) {
      unsigned char d = (unsigned char)s[i + k];
      ok = k == 1 ? d >= lo && d <= hi : (d & 0xC0) == 0x80;
    }
    if (ok) {
      out.append(s, i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

}  // namespace

std::string new_tool_call_id() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += alnum[rng() % 62];
  return id;
}

OutputParser::OutputParser(const ChatCodec& codec, const std::vector<ToolSpec>* tools, bool start_in_reasoning)
    : codec_(codec), tools_(tools), mode_(start_in_reasoning ? Mode::kReasoning : Mode::kContent) {}

std::string OutputParser::take_utf8(std::string& bytes) {
  size_t n = complete_utf8_prefix(bytes);
  std::string out = bytes.substr(0, n);
  bytes.erase(0, n);
  return out;
}

void OutputParser::text_token(int32_t t, ChatDelta& out) {
  if (codec_.is_special(t)) return;  // never text
  bytes_ += codec_.token_bytes(t);
  emit_text(take_utf8(bytes_), out);
}

void OutputParser::flush_bytes(ChatDelta& out) {
  if (bytes_.empty()) return;
  std::string rest;
  rest.swap(bytes_);
  emit_text(rest, out);
}

void OutputParser::emit_text(std::string text, ChatDelta& out) {
  if (text.empty() || mode_ == Mode::kToolCall) return;
  text = valid_utf8(text);
  if (!segment_started_) {  // drop leading whitespace of a reasoning/content segment
    size_t b = 0;
    while (b < text.size() && is_space(text[b])) ++b;
    text.erase(0, b);
    if (text.empty()) return;
    segment_started_ = true;
  }
  size_t e = text.size();
  while (e > 0 && is_space(text[e - 1])) --e;
  if (e == 0) {
    held_space_ += text;
    return;
  }
  std::string piece = held_space_ + text.substr(0, e);
  held_space_ = text.substr(e);
  (mode_ == Mode::kReasoning ? reasoning_ : content_) += piece;
  (mode_ == Mode::kReasoning ? out.reasoning : out.content) += piece;
}

void OutputParser::end_segment() {
  held_space_.clear();
  segment_started_ = false;
}

void OutputParser::open_call(const std::string& name, ChatDelta& out) {
  calls_.push_back({new_tool_call_id(), name, ""});
  out.tool_calls.push_back({int(calls_.size()) - 1, calls_.back().id, name, ""});
}

void OutputParser::emit_args(const std::string& s, ChatDelta& out) {
  if (s.empty() || calls_.empty()) return;
  calls_.back().arguments += s;
  if (!out.tool_calls.empty() && out.tool_calls.back().index == int(calls_.size()) - 1)
    out.tool_calls.back().arguments += s;
  else out.tool_calls.push_back({int(calls_.size()) - 1, "", "", s});
}

namespace {

// ---- GLM: <think>R</think>C<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call> ----
// Values of free-text properties become JSON strings; others are parsed as JSON (falling back to a string).
class GlmParser : public OutputParser {
 public:
  GlmParser(const ChatCodec& codec, const TurnMarkers& m, const std::vector<ToolSpec>* tools, bool start)
      : OutputParser(codec, tools, start), m_(m) {}

  void push(int32_t t, ChatDelta& out) override {
    bool marker = t >= 0 && (t == m_.think_open || t == m_.think_close || t == m_.call_open || t == m_.call_close ||
                             t == m_.key_open || t == m_.key_close || t == m_.value_open || t == m_.value_close);
    if (!marker) {
      if (mode_ == Mode::kToolCall) {
        if (codec_.is_special(t)) return;
        call_bytes_ += codec_.token_bytes(t);
        on_call_text(take_utf8(call_bytes_), out);
      } else {
        text_token(t, out);
      }
      return;
    }
    if (mode_ == Mode::kToolCall) {
      if (!call_bytes_.empty()) {
        std::string rest;
        rest.swap(call_bytes_);
        on_call_text(rest, out);
      }
      if (part_ == Part::kName && t != m_.call_close) finish_name(name_, out);  // the name ends at the first marker
      if (t == m_.key_open) {
        if (part_ == Part::kValue) end_value(out);
        key_.clear();
        part_ = Part::kKey;
      } else if (t == m_.key_close) {
        part_ = Part::kBetween;
      } else if (t == m_.value_open) {
        start_value(out);
      } else if (t == m_.value_close) {
        end_value(out);
      } else if (t == m_.call_close) {
        end_call(out);
      }
      return;
    }
    flush_bytes(out);
    if (mode_ == Mode::kReasoning) {
      if (t == m_.think_close) {
        end_segment();
        mode_ = Mode::kContent;
      }
      return;  // nothing else is structure inside reasoning: not even a tool call
    }
    if (t == m_.think_open) {
      end_segment();
      mode_ = Mode::kReasoning;
    } else if (t == m_.call_open) {
      end_segment();
      mode_ = Mode::kToolCall;
      part_ = Part::kName;
      name_.clear();
      args_emitted_ = 0;
      named_ = false;
    }
  }

  void finish(ChatDelta& out) override {
    if (mode_ == Mode::kToolCall) {
      if (!call_bytes_.empty()) on_call_text(call_bytes_, out), call_bytes_.clear();
      end_call(out);
    } else {
      flush_bytes(out);
    }
    held_space_.clear();
  }

 private:
  enum class Part { kName, kBetween, kKey, kValue };

  void on_call_text(const std::string& text, ChatDelta& out) {
    if (text.empty()) return;
    switch (part_) {
      case Part::kName: {
        name_ += text;
        auto nl = name_.find('\n');
        if (nl != std::string::npos && !trim(name_.substr(0, nl)).empty()) finish_name(name_.substr(0, nl), out);
        break;
      }
      case Part::kKey: key_ += text; break;
      case Part::kValue:
        value_ += text;
        if (value_is_text_) emit_args(json_escape_body(text), out);
        break;
      case Part::kBetween: break;
    }
  }

  void finish_name(const std::string& name, ChatDelta& out) {
    if (!named_) open_call(trim(name), out);
    named_ = true;
    part_ = Part::kBetween;
  }

  void start_value(ChatDelta& out) {
    if (!named_) finish_name(name_, out);
    std::string key = trim(key_);
    const ToolSpec* spec = nullptr;
    if (tools_)
      for (auto& t : *tools_)
        if (t.name == calls_.back().name) spec = &t;
    const ToolSpec::Property* prop = spec ? spec->property(key) : nullptr;
    value_is_text_ = !spec || !prop ? true : prop->is_text();
    value_.clear();
    emit_args((args_emitted_++ ? ", " : "{") + json(key).dump(-1, ' ', false, json::error_handler_t::replace) + ": ",
              out);
    if (value_is_text_) emit_args("\"", out);
    part_ = Part::kValue;
  }

  void end_value(ChatDelta& out) {
    if (part_ != Part::kValue) return;
    if (value_is_text_) {
      emit_args("\"", out);
    } else {
      json v = json::parse(trim(value_), nullptr, false);
      if (v.is_discarded()) v = value_;
      emit_args(v.dump(-1, ' ', false, json::error_handler_t::replace), out);
    }
    part_ = Part::kBetween;
  }

  void end_call(ChatDelta& out) {
    if (!named_) finish_name(name_, out);
    end_value(out);
    emit_args(args_emitted_ ? "}" : "{}", out);
    mode_ = Mode::kContent;
    end_segment();
  }

  TurnMarkers m_;
  std::string call_bytes_;
  Part part_ = Part::kName;
  std::string name_, key_, value_;
  bool value_is_text_ = false, named_ = false;
  int args_emitted_ = 0;
};

// Streams the JSON of an arguments value as it is written: waits for its first character, then forwards
// characters until the value is complete (strings and nesting tracked). Text around it is ignored.
struct JsonValueStream {
  bool containers_only = false;  // DeepSeek: skip the ```json fence up to the first { or [
  int depth = 0;
  bool started = false, done = false, in_str = false, esc = false;
  char kind = 0;  // '{', '[', '"' or 's' (scalar)
  std::string scalar;
  // Returns the characters of `c` that belong to the value ("" or c); `ended` when the value completed before c.
  bool feed(char c, bool& ended) {
    ended = false;
    if (done) return false;
    if (!started) {
      if (is_space(c)) return false;
      if (containers_only && c != '{' && c != '[') return false;
      started = true;
      kind = c == '{' || c == '[' ? c : c == '"' ? '"' : 's';
      if (kind == '"') in_str = true;
      else if (kind != 's') depth = 1;
      return true;
    }
    if (kind == 's') {
      if (is_space(c) || c == ',' || c == '}' || c == ']' || c == '`') return done = ended = true, false;
      return true;
    }
    if (in_str) {
      if (esc) esc = false;
      else if (c == '\\') esc = true;
      else if (c == '"') {
        in_str = false;
        if (kind == '"') done = true;
      }
      return true;
    }
    if (c == '"') in_str = true;
    else if (c == '{' || c == '[') ++depth;
    else if (c == '}' || c == ']') {
      if (--depth == 0) done = true;
    }
    return true;
  }
};

// ---- Qwen3 (Hermes): <tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>
// ---- DeepSeek-V3:
// <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
class JsonCallParser : public OutputParser {
 public:
  JsonCallParser(const ChatCodec& codec, const TurnMarkers& m, const std::vector<ToolSpec>* tools, bool start)
      : OutputParser(codec, tools, start), m_(m), deepseek_(m.family == ToolFamily::kDeepSeekV3) {}

  void push(int32_t t, ChatDelta& out) override {
    bool structure = t >= 0 && (t == m_.think_open || t == m_.think_close || t == m_.call_open || t == m_.call_close ||
                                t == m_.item_open || t == m_.item_close || t == m_.sep);
    if (!structure) {
      if (mode_ != Mode::kToolCall) return text_token(t, out);
      if (codec_.is_special(t)) return;
      call_bytes_ += codec_.token_bytes(t);
      std::string text = take_utf8(call_bytes_);
      for (char c : text) call_char(c, out);
      return;
    }
    if (mode_ == Mode::kToolCall) {
      for (char c : call_bytes_) call_char(c, out);
      call_bytes_.clear();
      if (deepseek_) {
        if (t == m_.item_open) begin_item();
        else if (t == m_.sep) part_ = Part::kName, name_.clear();
        else if (t == m_.item_close) end_item(out);
        else if (t == m_.call_close) end_item(out), mode_ = Mode::kContent, end_segment();
      } else if (t == m_.call_close) {
        end_item(out);
        mode_ = Mode::kContent;
        end_segment();
      }
      return;
    }
    flush_bytes(out);
    if (mode_ == Mode::kReasoning) {
      if (t == m_.think_close) end_segment(), mode_ = Mode::kContent;
      return;  // a call marker inside reasoning is not a call
    }
    if (t == m_.think_open) {
      end_segment();
      mode_ = Mode::kReasoning;
    } else if (t == m_.call_open) {
      end_segment();
      mode_ = Mode::kToolCall;
      if (deepseek_) part_ = Part::kNone, open_ = false;
      else begin_item();
    }
  }

  void finish(ChatDelta& out) override {
    if (mode_ == Mode::kToolCall) {
      for (char c : call_bytes_) call_char(c, out);
      call_bytes_.clear();
      end_item(out);
    } else {
      flush_bytes(out);
    }
    held_space_.clear();
  }

 private:
  enum class Part { kNone, kType, kName, kArgs, kBody };

  void begin_item() {
    open_ = true;
    named_ = false;
    name_.clear();
    pending_args_.clear();
    args_ = JsonValueStream{};
    args_.containers_only = true;
    args_text_.clear();
    body_ = Body{};
    part_ = deepseek_ ? Part::kType : Part::kBody;
  }

  void emit_or_hold(const std::string& s, ChatDelta& out) {
    args_text_ += s;
    if (named_) emit_args(s, out);
    else pending_args_ += s;
  }

  void name_known(const std::string& name, ChatDelta& out) {
    if (named_ || trim(name).empty()) return;
    open_call(trim(name), out);
    named_ = true;
    if (!pending_args_.empty()) emit_args(pending_args_, out), pending_args_.clear();
  }

  void call_char(char c, ChatDelta& out) {
    if (!open_) return;
    switch (part_) {
      case Part::kNone:
      case Part::kType: return;
      case Part::kName:
        if (c == '\n' && !trim(name_).empty()) {
          name_known(name_, out);
          part_ = Part::kArgs;
        } else {
          name_ += c;
        }
        return;
      case Part::kArgs: {
        bool ended = false;
        if (args_.feed(c, ended)) emit_or_hold(std::string(1, c), out);
        return;
      }
      case Part::kBody: body_char(c, out); return;
    }
  }

  // The Hermes body: one JSON object; "name" and "arguments" at its top level.
  struct Body {
    int depth = 0;
    bool in_str = false, esc = false;
    enum { kOutside, kKey, kColon, kValueStart, kValue, kAfter, kDone } at = kOutside;
    std::string key, value;
    JsonValueStream stream;
  } body_;

  void body_char(char c, ChatDelta& out) {
    Body& b = body_;
    switch (b.at) {
      case Body::kOutside:
        if (c == '{') b.at = Body::kAfter;  // expect a key
        return;
      case Body::kAfter:
        if (c == '"') b.at = Body::kKey, b.key.clear(), b.esc = false;
        else if (c == '}') b.at = Body::kDone;
        return;
      case Body::kKey:
        if (b.esc) b.esc = false, b.key += c;
        else if (c == '\\') b.esc = true, b.key += c;
        else if (c == '"') b.at = Body::kColon;
        else b.key += c;
        return;
      case Body::kColon:
        if (c == ':') b.at = Body::kValueStart, b.stream = JsonValueStream{}, b.value.clear();
        return;
      case Body::kValueStart:
      case Body::kValue: {
        bool ended = false;
        bool mine = b.stream.feed(c, ended);
        if (mine) {
          b.at = Body::kValue;
          b.value += c;
          if (b.key == "arguments" && b.stream.kind != '"' && b.stream.kind != 's')
            emit_or_hold(std::string(1, c), out);
        }
        if (b.stream.done) {
          end_body_value(out);
          b.at = Body::kAfter;
          if (ended && c == '}') b.at = Body::kDone;
        }
        return;
      }
      case Body::kDone: return;
    }
  }

  void end_body_value(ChatDelta& out) {
    Body& b = body_;
    if (b.key == "name") {
      json v = json::parse(b.value, nullptr, false);
      if (v.is_string()) name_known(v.get<std::string>(), out);
    } else if (b.key == "arguments" && (b.stream.kind == '"' || b.stream.kind == 's')) {
      json v = json::parse(b.value, nullptr, false);  // arguments given as a JSON-encoded string
      if (v.is_string()) v = json::parse(v.get<std::string>(), nullptr, false);
      if (!v.is_discarded() && v.is_object()) emit_or_hold(v.dump(), out);
    }
  }

  void end_item(ChatDelta& out) {
    if (!open_) return;
    if (part_ == Part::kBody && body_.at == Body::kValue) {  // cut short: what was there
      body_.stream.done = true;
      end_body_value(out);
    }
    if (part_ == Part::kName) name_known(name_, out);
    if (named_ && args_text_.empty()) emit_args("{}", out);
    open_ = false;
    part_ = Part::kNone;
  }

  TurnMarkers m_;
  bool deepseek_;
  std::string call_bytes_;
  bool open_ = false, named_ = false;
  Part part_ = Part::kNone;
  std::string name_, pending_args_, args_text_;
  JsonValueStream args_;
};

}  // namespace

std::unique_ptr<OutputParser> OutputParser::create(const ChatCodec& codec, const TurnMarkers& m,
                                                   const std::vector<ToolSpec>* tools, bool start_in_reasoning) {
  if (m.family == ToolFamily::kGlm) return std::make_unique<GlmParser>(codec, m, tools, start_in_reasoning);
  return std::make_unique<JsonCallParser>(codec, m, tools, start_in_reasoning);
}

}  // namespace moesrv
