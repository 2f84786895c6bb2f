#include "server/chat_request.h"

#include <fmt/format.h>

#include "server/api_error.h"

namespace moesrv {

using json = nlohmann::ordered_json;

const ToolSpec::Property* ToolSpec::property(const std::string& key) const {
  for (auto& p : properties)
    if (p.name == key) return &p;
  return nullptr;
}

namespace {

const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

[[noreturn]] void wrong_type(const char* name, const char* expected) {
  throw bad_request(fmt::format("'{}' must be {}", name, expected), name, "invalid_type");
}

std::optional<double> number_field(const json& body, const char* name, double lo, double hi) {
  auto* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(name, "a number");
  double d = v->get<double>();
  if (d < lo || d > hi) throw bad_request(fmt::format("'{}' must be between {} and {}", name, lo, hi), name, "invalid_value");
  return d;
}

std::optional<int64_t> int_field(const json& body, const char* name, int64_t lo) {
  auto* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) wrong_type(name, "an integer");
  int64_t n = v->get<int64_t>();
  if (n < lo) throw bad_request(fmt::format("'{}' must be at least {}", name, lo), name, "invalid_value");
  return n;
}

bool bool_field(const json& body, const char* name, bool fallback) {
  auto* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_boolean()) wrong_type(name, "a boolean");
  return v->get<bool>();
}

GenerationOptions parse_generation(const json& body) {
  GenerationOptions g;
  if (auto t = number_field(body, "temperature", 0, 2)) g.sampling.temperature = float(*t);
  if (auto p = number_field(body, "top_p", 0, 1)) g.sampling.top_p = float(*p);
  if (auto k = int_field(body, "top_k", -1)) g.sampling.top_k = int(std::max<int64_t>(*k, 0));
  if (auto* s = field(body, "seed")) {
    if (!s->is_number_integer()) wrong_type("seed", "an integer");
    g.sampling.seed = uint64_t(s->get<int64_t>());
  }
  g.max_tokens = int_field(body, "max_completion_tokens", 1);
  if (!g.max_tokens) g.max_tokens = int_field(body, "max_tokens", 1);
  if (auto* s = field(body, "stop")) {
    if (s->is_string()) {
      g.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      for (auto& x : *s) {
        if (!x.is_string()) wrong_type("stop", "a string or an array of strings");
        g.stop.push_back(x.get<std::string>());
      }
      if (g.stop.size() > 4) throw bad_request("'stop' accepts at most 4 sequences", "stop");
    } else {
      wrong_type("stop", "a string or an array of strings");
    }
    std::erase(g.stop, std::string());
  }
  g.stream = bool_field(body, "stream", false);
  if (auto* so = field(body, "stream_options")) {
    if (!so->is_object()) wrong_type("stream_options", "an object");
    g.include_usage = bool_field(*so, "include_usage", false);
  }
  if (auto n = int_field(body, "n", 1); n && *n != 1) throw bad_request("only n=1 is supported", "n");
  return g;
}

// Message content may be a string, null, or an array of parts; templates get a plain string.
std::string content_text(const json& content, size_t i) {
  if (content.is_null()) return "";
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) throw bad_request(fmt::format("messages[{}].content must be a string or an array", i), "messages");
  std::string out;
  for (auto& part : content) {
    if (part.is_string()) {
      out += part.get<std::string>();
    } else if (part.is_object() && part.contains("type") && part["type"] == "text" && part.contains("text") && part["text"].is_string()) {
      out += part["text"].get<std::string>();
    } else {
      throw bad_request(fmt::format("messages[{}].content: only text parts are supported", i), "messages");
    }
  }
  return out;
}

json normalise_tool_calls(const json& calls, size_t i) {
  if (!calls.is_array()) throw bad_request(fmt::format("messages[{}].tool_calls must be an array", i), "messages");
  json out = json::array();
  for (auto& c : calls) {
    const json* fn = c.is_object() ? field(c, "function") : nullptr;
    if (!fn || !fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string())
      throw bad_request(fmt::format("messages[{}].tool_calls entries need function.name", i), "messages");
    json args = json::object();
    if (auto* a = field(*fn, "arguments")) {
      if (a->is_string()) {
        const auto& s = a->get_ref<const std::string&>();
        args = s.empty() ? json::object() : json::parse(s, nullptr, false);
        if (args.is_discarded()) throw bad_request(fmt::format("messages[{}].tool_calls arguments are not valid JSON", i), "messages");
      } else {
        args = *a;
      }
    }
    json call = c;
    call["type"] = "function";
    call["function"]["arguments"] = std::move(args);
    out.push_back(std::move(call));
  }
  return out;
}

json normalise_messages(const json* messages) {
  if (!messages) throw bad_request("'messages' is required", "messages", "missing_required_parameter");
  if (!messages->is_array() || messages->empty()) throw bad_request("'messages' must be a non-empty array", "messages");
  json out = json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw bad_request(fmt::format("messages[{}] needs a string 'role'", i), "messages");
    std::string role = m["role"];
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant" && role != "tool")
      throw bad_request(fmt::format("messages[{}].role '{}' is not supported", i, role), "messages");
    json n = m;
    n["role"] = role;
    n["content"] = content_text(m.value("content", json()), i);
    if (auto* rc = field(m, "reasoning_content"); rc && !rc->is_string())
      throw bad_request(fmt::format("messages[{}].reasoning_content must be a string", i), "messages");
    if (auto* tc = field(m, "tool_calls")) n["tool_calls"] = normalise_tool_calls(*tc, i);
    else n.erase("tool_calls");
    out.push_back(std::move(n));
  }
  return out;
}

std::optional<std::string> model_field(const json& body) {
  auto* m = field(body, "model");
  if (!m) return std::nullopt;
  if (!m->is_string()) wrong_type("model", "a string");
  return m->get<std::string>();
}

void parse_response_format(const json& rf, ChatCompletionRequest& r) {
  auto invalid = [](const std::string& why) {
    return bad_request("response_format: " + why, "response_format", "invalid_response_format");
  };
  if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string())
    throw invalid("must be an object with a string 'type'");
  std::string type = rf["type"];
  if (type == "text") return;
  if (type == "json_object") {
    r.response_format = type;
    r.response_schema = JsonSchema::any_object();
    return;
  }
  if (type != "json_schema") throw invalid("'type' must be text, json_object or json_schema");
  const json* js = field(rf, "json_schema");
  if (!js || !js->is_object()) throw invalid("json_schema must be an object with a 'schema'");
  const json* schema = field(*js, "schema");
  if (schema && !schema->is_object() && !schema->is_boolean())
    throw invalid("json_schema.schema must be a JSON schema object");
  try {
    r.response_schema = schema ? JsonSchema::compile(nlohmann::json::parse(schema->dump())) : JsonSchema::any_value();
  } catch (const std::exception& e) {
    throw invalid(std::string("json_schema.schema: ") + e.what());
  }
  r.response_format = type;
}

}  // namespace

std::vector<ToolSpec> parse_tools(const json& tools) {
  if (!tools.is_array()) throw bad_request("'tools' must be an array", "tools");
  std::vector<ToolSpec> specs;
  for (size_t i = 0; i < tools.size(); ++i) {
    auto invalid = [&](const std::string& why) { return bad_request(fmt::format("tools[{}]: {}", i, why), "tools", "invalid_tool_schema"); };
    const json& t = tools[i];
    if (!t.is_object() || (t.contains("type") && t["type"] != "function")) throw invalid("only function tools are supported");
    const json* fn = field(t, "function");
    if (!fn || !fn->is_object()) throw invalid("missing 'function' object");
    if (!fn->contains("name") || !(*fn)["name"].is_string() || (*fn)["name"].get<std::string>().empty())
      throw invalid("function.name must be a non-empty string");
    if (const json* d = field(*fn, "description"); d && !d->is_string() && !d->is_null())
      throw invalid("function.description must be a string");
    ToolSpec spec{(*fn)["name"].get<std::string>(), {}, {}, nullptr};
    for (auto& other : specs)
      if (other.name == spec.name) throw invalid(fmt::format("duplicate function name '{}'", spec.name));
    // No parameters: the function takes none (OpenAI), so its arguments are {}.
    json params = json{{"type", "object"}, {"properties", json::object()}, {"additionalProperties", false}};
    if (const json* p = field(*fn, "parameters")) {
      if (!p->is_object()) throw invalid("function.parameters must be a JSON schema object");
      params = *p;
      if (!params.contains("type")) params["type"] = "object";
      if (params["type"] != "object") throw invalid("function.parameters must describe an object");
    }
    if (const json* props = field(params, "properties")) {
      if (!props->is_object()) throw invalid("parameters.properties must be an object");
      for (auto& [key, schema] : props->items())
        if (!schema.is_object() && !schema.is_boolean())
          throw invalid(fmt::format("property '{}' must be a schema object", key));
    }
    try {
      spec.schema = JsonSchema::compile(nlohmann::json::parse(params.dump()));
    } catch (const std::exception& e) {
      throw invalid(std::string("parameters: ") + e.what());
    }
    const JsonSchema::Node& root = spec.schema->node(spec.schema->root());
    if (const json* props = field(params, "properties")) {
      for (auto& [key, schema] : props->items()) {
        std::string escaped = json(key).dump();
        int k = JsonSchema::key_index(root, escaped.substr(1, escaped.size() - 2));
        bool text = k < 0 || json_value_is_text(spec.schema->node(root.key_nodes[size_t(k)]));
        spec.properties.push_back({key, text});
      }
    }
    if (const json* req = field(params, "required"))
      for (auto& r : *req) spec.required.push_back(r.get<std::string>());
    specs.push_back(std::move(spec));
  }
  return specs;
}

ChatCompletionRequest parse_chat_request(const json& body) {
  if (!body.is_object()) throw bad_request("request body must be a JSON object");
  ChatCompletionRequest r;
  r.messages = normalise_messages(field(body, "messages"));
  r.gen = parse_generation(body);
  if (auto* tools = field(body, "tools")) {
    r.tool_specs = parse_tools(*tools);
    r.tools = *tools;
  }
  if (auto* tc = field(body, "tool_choice")) {
    if (tc->is_string()) {
      std::string s = *tc;
      if (s == "auto") r.tool_choice = ToolChoice::kAuto;
      else if (s == "none") r.tool_choice = ToolChoice::kNone;
      else if (s == "required") r.tool_choice = ToolChoice::kRequired;
      else throw bad_request("'tool_choice' must be auto, none, required or a named function", "tool_choice");
    } else if (tc->is_object() && tc->contains("function") && (*tc)["function"].is_object() &&
               (*tc)["function"].contains("name") && (*tc)["function"]["name"].is_string()) {
      r.tool_choice = ToolChoice::kNamed;
      r.tool_choice_name = (*tc)["function"]["name"];
      bool known = false;
      for (auto& s : r.tool_specs) known |= s.name == r.tool_choice_name;
      if (!known) throw bad_request(fmt::format("tool_choice names unknown tool '{}'", r.tool_choice_name), "tool_choice");
    } else {
      wrong_type("tool_choice", "a string or {\"type\":\"function\",\"function\":{\"name\":...}}");
    }
    if (r.tool_choice != ToolChoice::kAuto && r.tool_choice != ToolChoice::kNone && r.tool_specs.empty())
      throw bad_request("'tool_choice' requires 'tools'", "tool_choice");
  }
  if (auto* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) wrong_type("chat_template_kwargs", "an object");
    r.template_kwargs = *kw;
  }
  r.model = model_field(body);
  r.parallel_tool_calls = bool_field(body, "parallel_tool_calls", true);
  if (auto* rf = field(body, "response_format")) parse_response_format(*rf, r);
  r.logprobs.enabled = bool_field(body, "logprobs", false);
  if (auto n = int_field(body, "top_logprobs", 0)) {
    if (*n > 20) throw bad_request("'top_logprobs' must be between 0 and 20", "top_logprobs", "invalid_value");
    if (!r.logprobs.enabled && *n > 0)
      throw bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs", "invalid_value");
    r.logprobs.top = int(*n);
  }
  return r;
}

CompletionRequest parse_completion_request(const json& body) {
  if (!body.is_object()) throw bad_request("request body must be a JSON object");
  CompletionRequest r;
  r.model = model_field(body);
  if (auto n = int_field(body, "logprobs", 0)) {
    if (*n > 20) throw bad_request("'logprobs' must be between 0 and 20", "logprobs", "invalid_value");
    r.logprobs = {true, int(*n)};
  }
  const json* p = field(body, "prompt");
  if (!p) throw bad_request("'prompt' is required", "prompt", "missing_required_parameter");
  const json* prompt = p;
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) prompt = &(*p)[0];
  if (prompt->is_string()) {
    r.prompt_text = prompt->get<std::string>();
  } else if (prompt->is_array() && !prompt->empty()) {
    for (auto& t : *prompt) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0) wrong_type("prompt", "a string or an array of token ids");
      r.prompt_ids.push_back(t.get<int32_t>());
    }
  } else {
    wrong_type("prompt", "a string or an array of token ids");
  }
  r.gen = parse_generation(body);
  return r;
}

}  // namespace moesrv
