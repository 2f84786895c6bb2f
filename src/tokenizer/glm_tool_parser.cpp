#include "tokenizer/glm_tool_parser.h"

namespace moesrv {
namespace {

constexpr std::string_view kThinkOpen = "<think>", kThinkClose = "</think>", kCallOpen = "<tool_call>",
                           kCallClose = "</tool_call>", kKeyOpen = "<arg_key>", kKeyClose = "</arg_key>",
                           kValOpen = "<arg_value>", kValClose = "</arg_value>";

bool is_ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_ws(s.back())) s.remove_suffix(1);
  return s;
}

// Length of the longest suffix of `s` that is a proper prefix of one of `markers`.
size_t partial_marker_len(std::string_view s, std::initializer_list<std::string_view> markers) {
  size_t best = 0;
  for (auto m : markers)
    for (size_t n = std::min(s.size(), m.size() - 1); n > best; --n)
      if (s.substr(s.size() - n) == m.substr(0, n)) {
        best = n;
        break;
      }
  return best;
}

}  // namespace

GlmToolCallParser::GlmToolCallParser(const nlohmann::json& tools, bool in_reasoning)
    : tools_(tools), state_(in_reasoning ? State::Reasoning : State::Content) {}

void GlmToolCallParser::flush_pending_ws(GlmParseEvent::Kind kind, std::vector<GlmParseEvent>& out) {
  if (pending_ws_.empty()) return;
  std::string ws;
  ws.swap(pending_ws_);
  if (!out.empty() && out.back().kind == kind) out.back().text += ws;
  else out.push_back({kind, ws, {}});
}

void GlmToolCallParser::emit_text(GlmParseEvent::Kind kind, std::string_view text, std::vector<GlmParseEvent>& out) {
  if (at_segment_start_) {
    while (!text.empty() && is_ws(text.front())) text.remove_prefix(1);
    if (text.empty()) return;
    at_segment_start_ = false;
  }
  size_t body_end = text.size();
  while (body_end > 0 && is_ws(text[body_end - 1])) --body_end;
  if (body_end == 0) {  // whitespace only: hold it
    pending_ws_ += text;
    return;
  }
  flush_pending_ws(kind, out);
  if (!out.empty() && out.back().kind == kind) out.back().text += text.substr(0, body_end);
  else out.push_back({kind, std::string(text.substr(0, body_end)), {}});
  pending_ws_ = std::string(text.substr(body_end));
}

std::vector<GlmParseEvent> GlmToolCallParser::feed(std::string_view piece) {
  buf_ += piece;
  std::vector<GlmParseEvent> out;
  process(false, out);
  return out;
}

std::vector<GlmParseEvent> GlmToolCallParser::finish() {
  std::vector<GlmParseEvent> out;
  process(true, out);
  if (state_ == State::ToolCall) {  // unterminated: give the raw text back as content
    state_ = State::Content;
    emit_text(GlmParseEvent::Content, std::string(kCallOpen) + call_body_, out);
    call_body_.clear();
  }
  pending_ws_.clear();
  return out;
}

void GlmToolCallParser::process(bool final, std::vector<GlmParseEvent>& out) {
  while (!buf_.empty()) {
    if (state_ == State::ToolCall) {
      size_t close = buf_.find(kCallClose);
      if (close == std::string::npos) {
        size_t keep = final ? 0 : partial_marker_len(buf_, {kCallClose});
        call_body_ += buf_.substr(0, buf_.size() - keep);
        buf_.erase(0, buf_.size() - keep);
        return;
      }
      call_body_ += buf_.substr(0, close);
      buf_.erase(0, close + kCallClose.size());
      out.push_back({GlmParseEvent::ToolCall, "", parse_call(call_body_)});
      call_body_.clear();
      state_ = State::Content;
      at_segment_start_ = true;
      continue;
    }
    bool reasoning = state_ == State::Reasoning;
    auto kind = reasoning ? GlmParseEvent::Reasoning : GlmParseEvent::Content;
    // Earliest marker that switches state from here.
    size_t pos = std::string::npos;
    std::string_view marker;
    auto consider = [&](std::string_view m) {
      size_t p = buf_.find(m);
      if (p < pos) {
        pos = p;
        marker = m;
      }
    };
    if (reasoning) {
      consider(kThinkClose);
    } else {
      consider(kThinkOpen);
      consider(kCallOpen);
    }
    if (pos == std::string::npos) {
      size_t keep = final ? 0 : reasoning ? partial_marker_len(buf_, {kThinkClose})
                                          : partial_marker_len(buf_, {kThinkOpen, kCallOpen});
      emit_text(kind, std::string_view(buf_).substr(0, buf_.size() - keep), out);
      buf_.erase(0, buf_.size() - keep);
      return;
    }
    emit_text(kind, std::string_view(buf_).substr(0, pos), out);
    buf_.erase(0, pos + marker.size());
    pending_ws_.clear();  // whitespace before a tag is layout, not text
    at_segment_start_ = true;
    if (marker == kThinkClose) state_ = State::Content;
    else if (marker == kThinkOpen) state_ = State::Reasoning;
    else state_ = State::ToolCall;
  }
}

GlmToolCall GlmToolCallParser::parse_call(std::string_view body) const {
  GlmToolCall call;
  size_t first_key = body.find(kKeyOpen);
  call.name = std::string(trim(body.substr(0, first_key)));
  // Parameter schema of this tool, if the request listed it.
  nlohmann::json props;
  if (tools_.is_array())
    for (const auto& t : tools_) {
      const auto& fn = t.contains("function") ? t["function"] : t;
      if (fn.value("name", "") == call.name && fn.contains("parameters"))
        props = fn["parameters"].value("properties", nlohmann::json::object());
    }
  nlohmann::ordered_json args = nlohmann::ordered_json::object();
  size_t pos = first_key;
  while (pos != std::string_view::npos) {
    size_t kb = pos + kKeyOpen.size(), ke = body.find(kKeyClose, kb);
    if (ke == std::string_view::npos) break;
    std::string key(trim(body.substr(kb, ke - kb)));
    size_t vo = body.find(kValOpen, ke);
    if (vo == std::string_view::npos) break;
    size_t vb = vo + kValOpen.size(), ve = body.find(kValClose, vb);
    if (ve == std::string_view::npos) ve = body.size();
    std::string raw(body.substr(vb, ve - vb));

    std::string type;
    if (props.is_object() && props.contains(key) && props[key].is_object()) {
      const auto& t = props[key].value("type", nlohmann::json());
      if (t.is_string()) type = t.get<std::string>();
      else if (t.is_array() && t.size() == 1 && t[0].is_string()) type = t[0].get<std::string>();
    }
    std::string_view t = trim(raw);
    if (type == "string") {
      args[key] = raw;
    } else if (type == "boolean" && (t == "True" || t == "False")) {  // Python-style literals
      args[key] = t == "True";
    } else {
      try {
        args[key] = nlohmann::ordered_json::parse(t);
      } catch (const std::exception&) {
        args[key] = raw;  // not JSON (or an unknown free-text argument): keep as a string
      }
    }
    pos = ve == body.size() ? std::string_view::npos : body.find(kKeyOpen, ve);
  }
  call.arguments = args.dump();
  return call;
}

}  // namespace moesrv
