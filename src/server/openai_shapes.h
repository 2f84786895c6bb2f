// Builders for OpenAI response objects (chat.completion, chat.completion.chunk, text_completion, usage).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/output_parser.h"

namespace moesrv::openai {

struct Usage {
  int64_t prompt = 0, completion = 0, cached = 0, reasoning = 0;
  nlohmann::json to_json() const;
};

std::string random_id(const std::string& prefix);  // e.g. "chatcmpl-" + 24 random characters

struct ResponseHeader {
  std::string id, model;
  int64_t created = 0;
};

// `logprobs`: an array of content logprob entries (null: the choice's logprobs is null).
nlohmann::json chat_chunk(const ResponseHeader& h, const nlohmann::json& delta, const nlohmann::json& finish_reason,
                          bool include_usage_field, const nlohmann::json& logprobs = nullptr);
nlohmann::json chat_delta(const ChatDelta& d);  // {"reasoning_content":..,"content":..,"tool_calls":[..]}
nlohmann::json chat_message(const std::string& content, const std::string& reasoning,
                            const std::vector<ParsedToolCall>& calls);
nlohmann::json chat_completion(const ResponseHeader& h, const nlohmann::json& message, const std::string& finish_reason,
                               const Usage& u, const nlohmann::json& logprobs = nullptr);
nlohmann::json text_choice(const std::string& text, const nlohmann::json& finish_reason,
                           const nlohmann::json& logprobs = nullptr);
nlohmann::json text_completion(const ResponseHeader& h, const nlohmann::json& choice, const nlohmann::json& usage);

inline std::string sse(const nlohmann::json& j) {
  return "data: " + j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n\n";
}

}  // namespace moesrv::openai
