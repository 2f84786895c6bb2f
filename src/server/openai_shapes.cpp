#include "server/openai_shapes.h"

#include <random>

namespace moesrv::openai {

using nlohmann::json;

json Usage::to_json() const {
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}},
          {"completion_tokens_details", {{"reasoning_tokens", reasoning}}}};
}

std::string random_id(const std::string& prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::string id = prefix;
  for (int i = 0; i < 24; ++i) id += alnum[rng() % 62];
  return id;
}

namespace {
json chat_logprobs(const json& content) {
  return content.is_null() ? json(nullptr) : json{{"content", content}, {"refusal", nullptr}};
}
}  // namespace

json chat_chunk(const ResponseHeader& h, const json& delta, const json& finish_reason, bool include_usage_field,
                const json& logprobs) {
  json chunk = {{"id", h.id},
                {"object", "chat.completion.chunk"},
                {"created", h.created},
                {"model", h.model},
                {"system_fingerprint", nullptr},
                {"choices", json::array({{{"index", 0},
                                          {"delta", delta},
                                          {"logprobs", chat_logprobs(logprobs)},
                                          {"finish_reason", finish_reason}}})}};
  if (include_usage_field) chunk["usage"] = nullptr;
  return chunk;
}

json chat_delta(const ChatDelta& d) {
  json delta = json::object();
  if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
  if (!d.content.empty()) delta["content"] = d.content;
  if (!d.tool_calls.empty()) {
    json calls = json::array();
    for (auto& c : d.tool_calls) {
      json call = {{"index", c.index}};
      json fn = {{"arguments", c.arguments}};
      if (!c.id.empty()) {
        call["id"] = c.id;
        call["type"] = "function";
        fn["name"] = c.name;
      }
      call["function"] = fn;
      calls.push_back(std::move(call));
    }
    delta["tool_calls"] = std::move(calls);
  }
  return delta;
}

json chat_message(const std::string& content, const std::string& reasoning, const std::vector<ParsedToolCall>& calls) {
  json msg = {{"role", "assistant"}, {"content", content.empty() && !calls.empty() ? json(nullptr) : json(content)}};
  if (!reasoning.empty()) msg["reasoning_content"] = reasoning;
  if (!calls.empty()) {
    json tc = json::array();
    for (auto& c : calls)
      tc.push_back({{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    msg["tool_calls"] = std::move(tc);
  }
  return msg;
}

json chat_completion(const ResponseHeader& h, const json& message, const std::string& finish_reason, const Usage& u,
                     const json& logprobs) {
  return {{"id", h.id},
          {"object", "chat.completion"},
          {"created", h.created},
          {"model", h.model},
          {"system_fingerprint", nullptr},
          {"choices", json::array({{{"index", 0},
                                    {"message", message},
                                    {"logprobs", chat_logprobs(logprobs)},
                                    {"finish_reason", finish_reason}}})},
          {"usage", u.to_json()}};
}

json text_choice(const std::string& text, const json& finish_reason, const json& logprobs) {
  return {{"text", text}, {"index", 0}, {"logprobs", logprobs}, {"finish_reason", finish_reason}};
}

json text_completion(const ResponseHeader& h, const json& choice, const json& usage) {
  json r = {{"id", h.id}, {"object", "text_completion"}, {"created", h.created}, {"model", h.model},
            {"system_fingerprint", nullptr}, {"choices", json::array({choice})}};
  if (!usage.is_null()) r["usage"] = usage;
  return r;
}

}  // namespace moesrv::openai
