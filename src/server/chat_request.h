// Parsing and validation of OpenAI request bodies. Unknown fields are ignored; known fields with the wrong
// type or value raise ApiError 400 naming the parameter.
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "server/json_schema.h"
#include "serving/sampler.h"

namespace moesrv {

// One function tool: its name, its compiled parameter schema and, per declared property, whether GLM writes
// values as free text (strings, untyped, string enums) or as JSON.
struct ToolSpec {
  std::string name;
  struct Property {
    std::string name;
    bool text = true;
    bool is_text() const { return text; }
  };
  std::vector<Property> properties;
  std::vector<std::string> required;
  std::shared_ptr<const JsonSchema> schema;  // the arguments object
  const Property* property(const std::string& key) const;
};

enum class ToolChoice { kAuto, kNone, kRequired, kNamed };

struct GenerationOptions {
  SamplingParams sampling;
  std::optional<int64_t> max_tokens;
  std::vector<std::string> stop;
  bool stream = false, include_usage = false;
};

struct LogprobOptions {
  bool enabled = false;
  int top = 0;  // alternatives per token (chat top_logprobs, completions logprobs)
};

struct ChatCompletionRequest {
  std::optional<std::string> model;
  nlohmann::ordered_json messages;  // normalised (key order kept: it is what the model saw): content is a string, tool_call arguments are objects
  nlohmann::ordered_json tools = nlohmann::ordered_json::array();  // as sent (OpenAI tool objects)
  std::vector<ToolSpec> tool_specs;
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string tool_choice_name;  // kNamed
  bool parallel_tool_calls = true;
  std::string response_format = "text";               // text | json_object | json_schema
  std::shared_ptr<const JsonSchema> response_schema;  // json_object / json_schema
  LogprobOptions logprobs;
  nlohmann::ordered_json template_kwargs = nlohmann::ordered_json::object();
  GenerationOptions gen;
};

struct CompletionRequest {
  std::optional<std::string> model;
  LogprobOptions logprobs;
  std::optional<std::string> prompt_text;
  std::vector<int32_t> prompt_ids;  // when the prompt was given as token ids
  GenerationOptions gen;
};

ChatCompletionRequest parse_chat_request(const nlohmann::ordered_json& body);
CompletionRequest parse_completion_request(const nlohmann::ordered_json& body);
std::vector<ToolSpec> parse_tools(const nlohmann::ordered_json& tools);  // throws ApiError on invalid schemas

}  // namespace moesrv
