// Remembers the reasoning the server produced for tool-calling assistant turns, so it can be re-attached when
// a client sends the turn back without `reasoning_content` (most agents drop it). That keeps the re-rendered
// prompt identical to what the model generated (prefix-cache hits) and keeps its chain of thought.
// Keyed by tool-call ids and by a hash of the turn's content + calls; bounded, oldest evicted first.
#pragma once
#include <cstdint>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <vector>

#include "server/output_parser.h"

namespace moesrv {

class ReasoningStore {
 public:
  explicit ReasoningStore(size_t capacity = 512) : capacity_(capacity) {}
  void remember(const std::string& content, const std::vector<ParsedToolCall>& calls, const std::string& reasoning);
  // Fills in `reasoning_content` on the last `max_turns` assistant messages with tool_calls that lack it.
  // Returns how many were re-attached.
  int reattach(nlohmann::ordered_json& messages, int max_turns = 4) const;

  static uint64_t turn_hash(const std::string& content, const nlohmann::json& calls);  // calls: [{name, arguments}]

 private:
  size_t capacity_;
  std::deque<std::vector<std::string>> order_;  // keys per remembered turn, oldest first
  std::unordered_map<std::string, std::string> by_key_;
  mutable std::mutex mu_;
};

}  // namespace moesrv
