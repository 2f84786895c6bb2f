// Helpers for driving a running server over loopback HTTP in tests.
#pragma once
#include <httplib.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moesrv::testing {

struct SseResult {
  int status = 0;
  std::vector<nlohmann::json> events;  // parsed "data:" payloads, [DONE] excluded
  bool done = false;                   // saw data: [DONE]
  std::string raw;
};

inline SseResult post_stream(httplib::Client& cli, const std::string& path, const nlohmann::json& body) {
  SseResult r;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.response_handler = [&](const httplib::Response& res) {
    r.status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    r.raw.append(data, n);
    return true;
  };
  auto res = cli.send(req);
  if (res && r.status == 0) r.status = res->status;
  if (res && r.raw.empty()) r.raw = res->body;
  size_t pos = 0;
  while ((pos = r.raw.find("data: ", pos)) != std::string::npos) {
    size_t end = r.raw.find("\n\n", pos);
    std::string payload = r.raw.substr(pos + 6, end - pos - 6);
    pos = end;
    if (payload == "[DONE]") r.done = true;
    else r.events.push_back(nlohmann::json::parse(payload));
  }
  return r;
}

// Joins the streamed chat deltas back into one message: {content, reasoning_content, tool_calls[]}.
inline nlohmann::json join_chat_deltas(const std::vector<nlohmann::json>& events, std::string* finish = nullptr) {
  nlohmann::json msg = {{"content", ""}, {"reasoning_content", ""}, {"tool_calls", nlohmann::json::array()}};
  for (auto& e : events) {
    if (!e.contains("choices") || e["choices"].empty()) continue;
    auto& ch = e["choices"][0];
    if (finish && ch["finish_reason"].is_string()) *finish = ch["finish_reason"];
    auto& d = ch["delta"];
    if (d.contains("content") && d["content"].is_string()) msg["content"] = msg["content"].get<std::string>() + d["content"].get<std::string>();
    if (d.contains("reasoning_content")) msg["reasoning_content"] = msg["reasoning_content"].get<std::string>() + d["reasoning_content"].get<std::string>();
    if (d.contains("tool_calls"))
      for (auto& tc : d["tool_calls"]) {
        size_t i = tc["index"];
        auto& calls = msg["tool_calls"];
        while (calls.size() <= i) calls.push_back({{"id", ""}, {"type", ""}, {"function", {{"name", ""}, {"arguments", ""}}}});
        if (tc.contains("id")) calls[i]["id"] = tc["id"];
        if (tc.contains("type")) calls[i]["type"] = tc["type"];
        if (tc["function"].contains("name")) calls[i]["function"]["name"] = tc["function"]["name"];
        if (tc["function"].contains("arguments"))
          calls[i]["function"]["arguments"] = calls[i]["function"]["arguments"].get<std::string>() + tc["function"]["arguments"].get<std::string>();
      }
  }
  return msg;
}

}  // namespace moesrv::testing
