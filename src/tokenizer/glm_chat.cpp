#include "tokenizer/glm_chat.h"

#include "tokenizer/jinja/value.h"
#include "util/error.h"

namespace moesrv {
namespace {

using ojson = nlohmann::ordered_json;

// Python json.dumps(ensure_ascii=False) formatting, as the templates' tojson produces.
std::string py_json(const ojson& j) { return jinja::Value::from_json(j).to_json(); }

std::string strip(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\n\r\f\v"), e = s.find_last_not_of(" \t\n\r\f\v");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::string strip_newlines_left(const std::string& s) { return s.substr(std::min(s.find_first_not_of('\n'), s.size())); }
std::string strip_newlines_right(const std::string& s) {
  size_t e = s.find_last_not_of('\n');
  return e == std::string::npos ? "" : s.substr(0, e + 1);
}

// String content, or the text parts of a content array.
std::string visible_text(const ojson& content) {
  if (content.is_string()) return content.get<std::string>();
  if (content.is_null()) return "";
  if (content.is_array()) {
    std::string out;
    for (const auto& part : content) {
      if (part.is_string()) out += part.get<std::string>();
      else if (part.is_object() && part.value("type", "") == "text") out += part.value("text", "");
    }
    return out;
  }
  return content.dump();
}

void append_tools(std::string& out, const ojson& tools, GlmStyle style) {
  out +=
      "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
      "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n";
  for (const auto& t : tools) out += py_json(t) + "\n";
  out += "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n";
  if (style == GlmStyle::V45) {
    out +=
        "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
        "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>";
  } else {
    out +=
        "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
        "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>";
  }
}

void append_tool_call(std::string& out, const ojson& call, GlmStyle style) {
  const ojson& fn = call.contains("function") ? call["function"] : call;
  std::string name = fn.value("name", "");
  ojson args = fn.contains("arguments") ? fn["arguments"] : ojson::object();
  if (args.is_string()) {
    std::string raw = args.get<std::string>();
    try {
      args = raw.empty() ? ojson::object() : ojson::parse(raw);
    } catch (const std::exception&) {
      fail("GLM chat: arguments of tool call '{}' are not valid JSON", name);
    }
  }
  if (!args.is_object()) fail("GLM chat: arguments of tool call '{}' must be a JSON object", name);
  const char* sep = style == GlmStyle::V45 ? "\n" : "";
  out += style == GlmStyle::V45 ? "\n<tool_call>" : "<tool_call>";
  out.append(name).append(sep);
  for (auto it = args.begin(); it != args.end(); ++it) {
    std::string v = it.value().is_string() ? it.value().get<std::string>() : py_json(it.value());
    out.append("<arg_key>").append(it.key()).append("</arg_key>").append(sep);
    out.append("<arg_value>").append(v).append("</arg_value>").append(sep);
  }
  out += "</tool_call>";
}

}  // namespace

std::string format_glm_chat(const ChatRequest& req, GlmChatOptions opt) {
  if (req.kwargs.contains("enable_thinking") && req.kwargs["enable_thinking"].is_boolean())
    opt.enable_thinking = req.kwargs["enable_thinking"].get<bool>();
  if (req.kwargs.contains("clear_thinking") && req.kwargs["clear_thinking"].is_boolean())
    opt.clear_thinking = req.kwargs["clear_thinking"].get<bool>();
  const bool v45 = opt.style == GlmStyle::V45;
  const ojson& msgs = req.messages;

  std::string out = "[gMASK]<sop>";
  if (req.tools.is_array() && !req.tools.empty()) append_tools(out, req.tools, opt.style);

  long last_user = -1;
  for (size_t i = 0; i < msgs.size(); ++i)
    if (msgs[i].value("role", "") == "user") last_user = long(i);

  for (size_t i = 0; i < msgs.size(); ++i) {
    const ojson& m = msgs[i];
    std::string role = m.value("role", "");
    std::string content = visible_text(m.contains("content") ? m["content"] : ojson());
    if (role == "system") {
      out += v45 ? "<|system|>\n" : "<|system|>";
      out += content;
    } else if (role == "user") {
      out += v45 ? "<|user|>\n" : "<|user|>";
      out += content;
      if (v45 && !opt.enable_thinking && !content.ends_with("/nothink")) out += "/nothink";
    } else if (role == "assistant") {
      bool has_reasoning = false;
      std::string reasoning;
      if (m.contains("reasoning_content") && m["reasoning_content"].is_string()) {
        has_reasoning = true;
        reasoning = m["reasoning_content"].get<std::string>();
      } else if (size_t end = content.find("</think>"); end != std::string::npos) {
        has_reasoning = true;
        std::string before = strip_newlines_right(content.substr(0, end));
        size_t open = before.rfind("<think>");
        reasoning = strip_newlines_left(open == std::string::npos ? before : before.substr(open + 7));
        content = strip_newlines_left(content.substr(content.rfind("</think>") + 8));
      }
      bool keep = (long(i) > last_user || !opt.clear_thinking);
      out += "<|assistant|>";
      if (v45) {
        std::string r = strip(reasoning), c = strip(content);
        out += "\n<think>";
        if (keep) out += r;
        out += "</think>";
        if (!c.empty()) out.append("\n").append(c);
      } else {
        if (keep && has_reasoning) out.append("<think>").append(reasoning);
        out += "</think>";
        out += strip(content);
      }
      if (m.contains("tool_calls") && m["tool_calls"].is_array())
        for (const auto& call : m["tool_calls"]) append_tool_call(out, call, opt.style);
    } else if (role == "tool" || role == "observation") {
      if (i == 0 || msgs[i - 1].value("role", "") != role) out += "<|observation|>";
      out += v45 ? "\n<tool_response>\n" : "<tool_response>";
      out += content;
      out += v45 ? "\n</tool_response>" : "</tool_response>";
    } else {
      fail("GLM chat: unsupported message role '{}'", role);
    }
  }
  if (req.add_generation_prompt) {
    out += "<|assistant|>";
    if (v45) out += opt.enable_thinking ? "" : "\n<think></think>";
    else out += opt.enable_thinking ? "<think>" : "</think>";
  }
  return out;
}

}  // namespace moesrv
