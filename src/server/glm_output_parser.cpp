#include "server/glm_output_parser.h"

#include <nlohmann/json.hpp>
#include <random>

namespace moesrv {

using nlohmann::json;

GlmMarkers GlmMarkers::from(const ChatCodec& codec) {
  auto id = [&](const char* s) { return codec.special_id(s).value_or(-1); };
  return {id("<think>"), id("</think>"), id("<tool_call>"), id("</tool_call>"),
          id("<arg_key>"), id("</arg_key>"), id("<arg_value>"), id("</arg_value>")};
}

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

std::string new_call_id() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += alnum[rng() % 62];
  return id;
}

// Length of the longest prefix of `s` made of complete UTF-8 sequences (invalid bytes count as complete).
size_t complete_utf8_prefix(const std::string& s) {
  size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    unsigned char c = s[n - back];
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back ? n - back : n;
  }
  return n;
}

}  // namespace

GlmOutputParser::GlmOutputParser(const ChatCodec& codec, const std::vector<ToolSpec>* tools, bool start_in_reasoning)
    : codec_(codec), tools_(tools), m_(GlmMarkers::from(codec)),
      mode_(start_in_reasoning ? Mode::kReasoning : Mode::kContent) {}

std::string GlmOutputParser::take_utf8() {
  size_t n = complete_utf8_prefix(bytes_);
  std::string out = bytes_.substr(0, n);
  bytes_.erase(0, n);
  return out;
}

void GlmOutputParser::push(int32_t t, ChatDelta& out) {
  bool marker = t >= 0 && (t == m_.think_open || t == m_.think_close || t == m_.tool_open || t == m_.tool_close ||
                           t == m_.key_open || t == m_.key_close || t == m_.value_open || t == m_.value_close);
  if (!marker) {
    bytes_ += codec_.token_bytes(t);
    on_text(take_utf8(), out);
    return;
  }
  if (!bytes_.empty()) {  // a marker ends any partial character
    std::string rest;
    rest.swap(bytes_);
    on_text(rest, out);
  }
  if (mode_ == Mode::kToolCall) {
    if (part_ == ToolPart::kName) finish_name(name_, out);  // the name ends at the first marker
    if (t == m_.key_open) {
      if (part_ == ToolPart::kValue) end_value(out);
      key_.clear();
      part_ = ToolPart::kKey;
    } else if (t == m_.key_close) {
      part_ = ToolPart::kBetween;
    } else if (t == m_.value_open) {
      start_value(out);
    } else if (t == m_.value_close) {
      end_value(out);
    } else if (t == m_.tool_close) {
      end_tool_call(out);
    }
    return;
  }
  if (t == m_.think_open) {
    flush_segment(out);
    mode_ = Mode::kReasoning;
  } else if (t == m_.think_close) {
    flush_segment(out);
    mode_ = Mode::kContent;
  } else if (t == m_.tool_open) {
    flush_segment(out);
    mode_ = Mode::kToolCall;
    part_ = ToolPart::kName;
    name_.clear();
    args_emitted_ = 0;
    calls_.push_back({new_call_id(), "", ""});
  }
  // Stray argument markers outside a tool call are dropped.
}

void GlmOutputParser::on_text(const std::string& text, ChatDelta& out) {
  if (text.empty()) return;
  if (mode_ != Mode::kToolCall) return emit_text(text, out);
  switch (part_) {
    case ToolPart::kName: {
      name_ += text;
      auto nl = name_.find('\n');
      if (nl != std::string::npos && !trim(name_.substr(0, nl)).empty()) finish_name(name_.substr(0, nl), out);
      break;
    }
    case ToolPart::kKey: key_ += text; break;
    case ToolPart::kValue:
      value_ += text;
      if (value_is_text_) emit_args(json_escape_body(text), out);
      break;
    case ToolPart::kBetween: break;  // newlines between elements
  }
}

void GlmOutputParser::emit_text(std::string text, ChatDelta& out) {
  if (!segment_started_) {  // drop leading whitespace of a reasoning/content segment
    size_t b = 0;
    while (b < text.size() && is_space(text[b])) ++b;
    text.erase(0, b);
    if (text.empty()) return;
    segment_started_ = true;
  }
  size_t e = text.size();
  while (e > 0 && is_space(text[e - 1])) --e;
  std::string piece = e == 0 ? std::string() : held_space_ + text.substr(0, e);
  if (e == 0) {
    held_space_ += text;
    return;
  }
  held_space_ = text.substr(e);
  auto& channel = mode_ == Mode::kReasoning ? out.reasoning : out.content;
  (mode_ == Mode::kReasoning ? reasoning_ : content_) += piece;
  channel += piece;
}

void GlmOutputParser::flush_segment(ChatDelta&) {
  held_space_.clear();  // trailing whitespace before a marker is formatting, not text
  segment_started_ = false;
}

void GlmOutputParser::emit_args(const std::string& s, ChatDelta& out) {
  calls_.back().arguments += s;
  if (!out.tool_calls.empty() && out.tool_calls.back().index == int(calls_.size()) - 1) {
    out.tool_calls.back().arguments += s;
  } else {
    out.tool_calls.push_back({int(calls_.size()) - 1, "", "", s});
  }
}

void GlmOutputParser::start_value(ChatDelta& out) {
  std::string key = trim(key_);
  const ToolSpec* spec = nullptr;
  if (tools_)
    for (auto& t : *tools_)
      if (t.name == calls_.back().name) spec = &t;
  const ToolSpec::Property* prop = spec ? spec->property(key) : nullptr;
  value_is_text_ = prop && prop->is_text();
  value_.clear();
  emit_args((args_emitted_++ ? ", " : "{") + json(key).dump(-1, ' ', false, json::error_handler_t::replace) + ": ", out);
  if (value_is_text_) emit_args("\"", out);
  part_ = ToolPart::kValue;
}

void GlmOutputParser::end_value(ChatDelta& out) {
  if (part_ != ToolPart::kValue) return;
  if (value_is_text_) {
    emit_args("\"", out);
  } else {
    json v = json::parse(trim(value_), nullptr, false);
    if (v.is_discarded()) v = value_;
    emit_args(v.dump(-1, ' ', false, json::error_handler_t::replace), out);
  }
  part_ = ToolPart::kBetween;
}

void GlmOutputParser::finish_name(const std::string& name, ChatDelta& out) {
  calls_.back().name = trim(name);
  part_ = ToolPart::kBetween;
  out.tool_calls.push_back({int(calls_.size()) - 1, calls_.back().id, calls_.back().name, ""});
}

void GlmOutputParser::end_tool_call(ChatDelta& out) {
  if (part_ == ToolPart::kName) finish_name(name_, out);
  end_value(out);
  emit_args(args_emitted_ ? "}" : "{}", out);
  mode_ = Mode::kContent;
  segment_started_ = false;
  held_space_.clear();
}

void GlmOutputParser::finish(ChatDelta& out) {
  if (!bytes_.empty()) {
    std::string rest;
    rest.swap(bytes_);
    on_text(rest, out);
  }
  if (mode_ == Mode::kToolCall) end_tool_call(out);
  held_space_.clear();
}

}  // namespace moesrv
