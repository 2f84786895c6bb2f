#include "server/reasoning_store.h"

#include <fmt/format.h>

namespace moesrv {

using nlohmann::json;

uint64_t ReasoningStore::turn_hash(const std::string& content, const json& calls) {
  // FNV-1a over the content and the canonical (sorted-key, compact) JSON of each call.
  std::string s = content;
  for (auto& c : calls) s += "\x1f" + c.value("name", "") + "\x1e" + c.value("arguments", json::object()).dump();
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

static json calls_for_hash(const std::vector<ParsedToolCall>& calls) {
  json out = json::array();
  for (auto& c : calls) {
    json args = json::parse(c.arguments, nullptr, false);
    out.push_back({{"name", c.name}, {"arguments", args.is_discarded() ? json(c.arguments) : args}});
  }
  return out;
}

void ReasoningStore::remember(const std::string& content, const std::vector<ParsedToolCall>& calls,
                              const std::string& reasoning) {
  if (calls.empty() || reasoning.empty()) return;
  std::vector<std::string> keys{fmt::format("h:{:x}", turn_hash(content, calls_for_hash(calls)))};
  for (auto& c : calls) keys.push_back("id:" + c.id);
  std::lock_guard lock(mu_);
  for (auto& k : keys) by_key_[k] = reasoning;
  order_.push_back(std::move(keys));
  while (order_.size() > capacity_) {
    for (auto& k : order_.front()) by_key_.erase(k);
    order_.pop_front();
  }
}

int ReasoningStore::reattach(nlohmann::ordered_json& messages, int max_turns) const {
  std::lock_guard lock(mu_);
  int seen = 0, attached = 0;
  for (size_t i = messages.size(); i-- > 0 && seen < max_turns;) {
    auto& m = messages[i];
    if (m.value("role", "") != "assistant" || !m.contains("tool_calls") || m["tool_calls"].empty()) continue;
    ++seen;
    if (m.contains("reasoning_content") && m["reasoning_content"].is_string() &&
        !m["reasoning_content"].get_ref<const std::string&>().empty())
      continue;
    const std::string* found = nullptr;
    for (auto& c : m["tool_calls"]) {
      auto it = c.contains("id") && c["id"].is_string() ? by_key_.find("id:" + c["id"].get<std::string>()) : by_key_.end();
      if (it != by_key_.end()) found = &it->second;
    }
    if (!found) {
      json calls = json::array();
      for (auto& c : m["tool_calls"])  // canonical (sorted-key) arguments: clients may reorder them
        calls.push_back({{"name", c["function"].value("name", "")}, {"arguments", json::parse(c["function"].value("arguments", nlohmann::ordered_json::object()).dump())}});
      auto it = by_key_.find(fmt::format("h:{:x}", turn_hash(m.value("content", ""), calls)));
      if (it != by_key_.end()) found = &it->second;
    }
    if (found) {
      m["reasoning_content"] = *found;
      ++attached;
    }
  }
  return attached;
}

}  // namespace moesrv
