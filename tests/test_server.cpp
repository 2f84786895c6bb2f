// End-to-end tests of the OpenAI-compatible server over loopback HTTP, with a scripted engine.
#include <gtest/gtest.h>
#include <httplib.h>

#include <csignal>
#include <future>

#include "server/http_server.h"
#include "server_test_client.h"
#include "server_test_doubles.h"

using namespace moesrv;
using namespace moesrv::testing;
using nlohmann::json;

namespace {

const json kWeatherTool = json::parse(R"({"type":"function","function":{"name":"get_weather",
  "description":"Weather for a city","parameters":{"type":"object","properties":{
  "city":{"type":"string"},"days":{"type":"integer"}},"required":["city"]}}})");

struct Harness {
  ByteCodec codec;
  std::unique_ptr<ScriptedEngine> engine;
  std::unique_ptr<HttpServer> server;
  int port = 0;
  Harness(Policy policy, ServerOptions opt = {}, int64_t max_ctx = 4096) {
    std::signal(SIGPIPE, SIG_IGN);
    engine = std::make_unique<ScriptedEngine>(codec, std::move(policy), max_ctx);
    opt.port = 0;
    server = std::make_unique<HttpServer>(*engine, codec, opt);
    port = server->start();
  }
  httplib::Client client() {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(30, 0);
    return c;
  }
  json post(const std::string& path, const json& body, int* status = nullptr) {
    auto c = client();
    auto res = c.Post(path.c_str(), body.dump(), "application/json");
    EXPECT_TRUE(res);
    if (!res) return {};
    if (status) *status = res->status;
    return json::parse(res->body);
  }
};

json user(const std::string& text) { return {{"role", "user"}, {"content", text}}; }

const char* kReasonThenCall =
    "\n<think>The user wants weather.</think>\nLet me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
    "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>";

}  // namespace

TEST(Server, ModelsHealthMetricsAndUnknownRoute) {
  Harness h(script_policy(ByteCodec{}, "hi"), {.served_name = "glm-test"});
  auto c = h.client();
  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->status, 200);
  auto m = json::parse(models->body);
  EXPECT_EQ(m["object"], "list");
  EXPECT_EQ(m["data"][0]["id"], "glm-test");
  EXPECT_EQ(m["data"][0]["object"], "model");
  EXPECT_EQ(c.Get("/v1/models/glm-test")->status, 200);
  EXPECT_EQ(c.Get("/v1/models/other")->status, 404);
  EXPECT_EQ(json::parse(c.Get("/health")->body)["status"], "ok");
  auto metrics = c.Get("/metrics");
  EXPECT_NE(metrics->body.find("moesrv_requests_total 0"), std::string::npos);
  EXPECT_NE(metrics->body.find("moesrv_queue_depth"), std::string::npos);
  EXPECT_NE(metrics->body.find("moesrv_prefix_cache_hit_tokens_total"), std::string::npos);
  auto missing = c.Get("/v1/nope");
  EXPECT_EQ(missing->status, 404);
  EXPECT_TRUE(json::parse(missing->body)["error"].contains("message"));
}

TEST(Server, ChatNonStreamingReasoningToolCall) {
  ByteCodec codec;
  Harness h(script_policy(codec, kReasonThenCall, "<|observation|>"));
  json r = h.post("/v1/chat/completions", {{"model", "x"}, {"messages", {user("weather in Paris?")}},
                                           {"tools", {kWeatherTool}}, {"temperature", 0}, {"unknown_field", 1}});
  EXPECT_TRUE(r["id"].get<std::string>().starts_with("chatcmpl-"));
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["model"], "scripted");
  EXPECT_TRUE(r["created"].is_number_integer());
  auto& choice = r["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  auto& msg = choice["message"];
  EXPECT_EQ(msg["role"], "assistant");
  EXPECT_EQ(msg["reasoning_content"], "The user wants weather.");
  EXPECT_EQ(msg["content"], "Let me check.");
  ASSERT_EQ(msg["tool_calls"].size(), 1u);
  auto& call = msg["tool_calls"][0];
  EXPECT_TRUE(call["id"].get<std::string>().starts_with("call_"));
  EXPECT_EQ(call["type"], "function");
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>()), json({{"city", "Paris"}, {"days", 3}}));
  auto& u = r["usage"];
  EXPECT_GT(u["prompt_tokens"], 0);
  EXPECT_EQ(u["completion_tokens"], codec.encode(kReasonThenCall).size() + 1);  // + the end token
  EXPECT_EQ(u["total_tokens"], u["prompt_tokens"].get<int>() + u["completion_tokens"].get<int>());
  EXPECT_EQ(u["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(u["completion_tokens_details"]["reasoning_tokens"], codec.encode("The user wants weather.</think>").size());
}

TEST(Server, ChatStreamingDeltasAndUsage) {
  ByteCodec codec;
  Harness h(script_policy(codec, kReasonThenCall, "<|observation|>"));
  auto c = h.client();
  auto r = post_stream(c, "/v1/chat/completions",
                       {{"messages", {user("weather?")}}, {"tools", {kWeatherTool}}, {"stream", true},
                        {"stream_options", {{"include_usage", true}}}});
  EXPECT_EQ(r.status, 200);
  ASSERT_GE(r.events.size(), 4u);
  EXPECT_TRUE(r.done);
  auto& first = r.events.front();
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  for (auto& e : r.events) EXPECT_EQ(e["id"], first["id"]);
  std::string finish;
  json msg = join_chat_deltas(r.events, &finish);
  EXPECT_EQ(finish, "tool_calls");
  EXPECT_EQ(msg["reasoning_content"], "The user wants weather.");
  EXPECT_EQ(msg["content"], "Let me check.");
  ASSERT_EQ(msg["tool_calls"].size(), 1u);
  EXPECT_EQ(msg["tool_calls"][0]["type"], "function");
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(msg["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json({{"city", "Paris"}, {"days", 3}}));
  // Usage arrives in a final chunk with no choices; earlier chunks carry usage: null.
  auto& last = r.events.back();
  EXPECT_TRUE(last["choices"].empty());
  EXPECT_GT(last["usage"]["completion_tokens"], 0);
  EXPECT_TRUE(r.events[1]["usage"].is_null());
  // Several reasoning deltas: it really streams.
  int reasoning_chunks = 0;
  for (auto& e : r.events)
    if (!e["choices"].empty() && e["choices"][0]["delta"].contains("reasoning_content")) ++reasoning_chunks;
  EXPECT_GT(reasoning_chunks, 5);
}

TEST(Server, ReasoningBudgetForcesEndOfThinking) {
  ByteCodec codec;
  int32_t think_close = *codec.special_id("</think>");
  Policy endless_thinking = [&codec, think_close](const std::vector<int32_t>& gen) -> Preferences {
    auto it = std::find(gen.begin(), gen.end(), think_close);
    if (it == gen.end()) return {{gen.empty() ? *codec.special_id("<think>") : int32_t('r'), 10.f}};
    size_t after = size_t(gen.end() - it) - 1;
    std::string answer = "done";
    return {{after < answer.size() ? int32_t(answer[after]) : *codec.special_id("<|endoftext|>"), 10.f}};
  };
  Harness h(endless_thinking, {.reasoning_budget = 8});
  json r = h.post("/v1/chat/completions", {{"messages", {user("think")}}, {"max_tokens", 100}});
  auto& msg = r["choices"][0]["message"];
  EXPECT_EQ(msg["reasoning_content"], "rrrrrrrr");
  EXPECT_EQ(msg["content"], "done");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r["usage"]["completion_tokens_details"]["reasoning_tokens"], 9);  // 8 + the forced </think>
  auto metrics = h.client().Get("/metrics")->body;
  EXPECT_NE(metrics.find("moesrv_reasoning_budget_forced_total 1"), std::string::npos);
}

TEST(Server, ReasoningStartedByThePrompt) {
  ByteCodec codec;
  Harness h(script_policy(codec, "<think>plan</think>answer"));  // generated includes the prompt's <think>
  json r = h.post("/v1/chat/completions", {{"messages", {user("q")}}, {"chat_template_kwargs", {{"think_in_prompt", true}}}});
  EXPECT_EQ(r["choices"][0]["message"]["reasoning_content"], "plan");
  EXPECT_EQ(r["choices"][0]["message"]["content"], "answer");
}

TEST(Server, StrictToolsConstrainNameKeysAndValues) {
  ByteCodec codec;
  const char* sloppy =
      "<tool_call>get_wether\n<arg_key>cityy</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
      "<arg_value>three</arg_value>\n</tool_call>";
  Preferences fallback = {{int32_t('7'), -50.f}, {int32_t('\n'), -60.f}};
  json body = {{"messages", {user("weather?")}}, {"tools", {kWeatherTool}}};
  {
    Harness loose(script_policy(codec, sloppy, "<|observation|>", fallback));
    json r = loose.post("/v1/chat/completions", body);
    auto& call = r["choices"][0]["message"]["tool_calls"][0];
    EXPECT_EQ(call["function"]["name"], "get_wether");
  }
  Harness strict(script_policy(codec, sloppy, "<|observation|>", fallback), {.strict_tools = true});
  json r = strict.post("/v1/chat/completions", body);
  ASSERT_EQ(r["choices"][0]["finish_reason"], "tool_calls") << r.dump();
  auto& call = r["choices"][0]["message"]["tool_calls"][0];
  EXPECT_EQ(call["function"]["name"], "get_weather");
  json args = json::parse(call["function"]["arguments"].get<std::string>());
  EXPECT_EQ(args["city"], "Paris");
  EXPECT_TRUE(args["days"].is_number_integer()) << args.dump();
}

TEST(Server, ToolChoiceNoneAndRequired) {
  ByteCodec codec;
  // The model would call a tool; with tool_choice none the <tool_call> token is masked and it answers instead.
  Preferences fallback = {{int32_t('o'), 5.f}};
  auto policy = script_policy(codec, "<tool_call>get_weather\n</tool_call>", "<|observation|>", fallback);
  Harness h(policy);
  json none = h.post("/v1/chat/completions", {{"messages", {user("q")}}, {"tools", {kWeatherTool}}, {"tool_choice", "none"}, {"max_tokens", 3}});
  EXPECT_FALSE(none["choices"][0]["message"].contains("tool_calls"));
  // A model that would rather chat: "required" forces the call.
  Harness h2(script_policy(codec, "hello", "<|endoftext|>", {{*codec.special_id("<tool_call>"), 1.f}}), {});
  json req = h2.post("/v1/chat/completions", {{"messages", {user("q")}}, {"tools", {kWeatherTool}}, {"tool_choice", "required"}, {"max_tokens", 60}});
  EXPECT_EQ(req["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_weather") << req.dump();
}

TEST(Server, StopSequencesAndMaxTokens) {
  ByteCodec codec;
  Harness h(script_policy(codec, "alpha beta gamma"));
  json r = h.post("/v1/chat/completions", {{"messages", {user("q")}}, {"stop", "gam"}});
  EXPECT_EQ(r["choices"][0]["message"]["content"], "alpha beta ");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  json l = h.post("/v1/chat/completions", {{"messages", {user("q")}}, {"max_completion_tokens", 5}});
  EXPECT_EQ(l["choices"][0]["message"]["content"], "alpha");
  EXPECT_EQ(l["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(l["usage"]["completion_tokens"], 5);
  auto c = h.client();
  auto s = post_stream(c, "/v1/chat/completions", {{"messages", {user("q")}}, {"stop", {"a b"}}, {"stream", true}});
  std::string finish;
  EXPECT_EQ(join_chat_deltas(s.events, &finish)["content"], "alph");
  EXPECT_EQ(finish, "stop");
}

TEST(Server, BadInputIsRejectedAndServerStaysUp) {
  ByteCodec codec;
  Harness h(script_policy(codec, "ok"), {}, /*max_ctx=*/64);
  auto c = h.client();
  auto expect_error = [&](const std::string& body, int status, const std::string& code = "", const std::string& param = "") {
    auto res = c.Post("/v1/chat/completions", body, "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, status) << body << " -> " << res->body;
    json e = json::parse(res->body);
    ASSERT_TRUE(e.contains("error")) << res->body;
    for (auto* k : {"message", "type", "param", "code"}) EXPECT_TRUE(e["error"].contains(k)) << k;
    if (!code.empty()) EXPECT_EQ(e["error"]["code"], code);
    if (!param.empty()) EXPECT_EQ(e["error"]["param"], param);
  };
  expect_error("{not json", 400, "invalid_json");
  expect_error("[1,2]", 400);
  expect_error(R"({"messages":[]})", 400, "", "messages");
  expect_error(R"({"messages":"hi"})", 400, "", "messages");
  expect_error(R"({"messages":[{"role":"user","content":"q"}],"temperature":"hot"})", 400, "invalid_type", "temperature");
  expect_error(R"({"messages":[{"role":"user","content":"q"}],"max_tokens":-1})", 400, "", "max_tokens");
  expect_error(R"({"messages":[{"role":"user","content":"q"}],"stream":"yes"})", 400, "", "stream");
  expect_error(R"({"messages":[{"role":"wizard","content":"q"}]})", 400);
  expect_error(R"({"messages":[{"role":"user","content":"q"}],"tools":[{"type":"function","function":{"parameters":{}}}]})",
               400, "invalid_tool_schema", "tools");
  expect_error(R"({"messages":[{"role":"user","content":"q"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"properties":[1]}}}]})",
               400, "invalid_tool_schema");
  expect_error(R"({"messages":[{"role":"user","content":"q"}],"tool_choice":{"type":"function","function":{"name":"nope"}},"tools":[]})", 400);
  expect_error(json({{"messages", {user(std::string(200, 'x'))}}}).dump(), 400, "context_length_exceeded");
  expect_error(R"({"prompt":"hi"})", 400);  // chat endpoint needs messages
  auto bad_completion = c.Post("/v1/completions", R"({"prompt":[1,99999]})", "application/json");
  EXPECT_EQ(bad_completion->status, 400);
  // Still serving.
  auto ok = c.Post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"q"}],"extra":{"x":1}})", "application/json");
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(json::parse(ok->body)["choices"][0]["message"]["content"], "ok");
  EXPECT_NE(c.Get("/metrics")->body.find("moesrv_request_errors_total 14"), std::string::npos);
}

TEST(Server, CompletionsEndpoint) {
  ByteCodec codec;
  Harness h(script_policy(codec, "world!"));
  // The scripted engine writes after <|assistant|>, so put one in the prompt.
  json r = h.post("/v1/completions", {{"prompt", "hello <|assistant|>"}, {"max_tokens", 50}});
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_TRUE(r["id"].get<std::string>().starts_with("cmpl-"));
  EXPECT_EQ(r["choices"][0]["text"], "world!");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r["usage"]["prompt_tokens"], codec.encode("hello <|assistant|>").size());
  json ids = h.post("/v1/completions", {{"prompt", codec.encode("x<|assistant|>")}, {"max_tokens", 3}});
  EXPECT_EQ(ids["choices"][0]["text"], "wor");
  EXPECT_EQ(ids["choices"][0]["finish_reason"], "length");
  auto c = h.client();
  auto s = post_stream(c, "/v1/completions", {{"prompt", "<|assistant|>"}, {"max_tokens", 50}, {"stream", true}, {"stop", "ld"}});
  std::string text, finish;
  for (auto& e : s.events) {
    text += e["choices"][0]["text"].get<std::string>();
    if (e["choices"][0]["finish_reason"].is_string()) finish = e["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(text, "wor");
  EXPECT_EQ(finish, "stop");
  EXPECT_TRUE(s.done);
}

TEST(Server, PrefixCacheReusesConversationPrefix) {
  ByteCodec codec;
  Harness h(script_policy(codec, kReasonThenCall, "<|observation|>"));
  json tools = {kWeatherTool};
  json first = h.post("/v1/chat/completions", {{"messages", {user("weather?")}}, {"tools", tools}});
  EXPECT_EQ(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  // The agent sends the turn back (without reasoning: the server re-attaches it) plus the tool result.
  json assistant = first["choices"][0]["message"];
  assistant.erase("reasoning_content");
  json messages = {user("weather?"), assistant, {{"role", "tool"}, {"tool_call_id", assistant["tool_calls"][0]["id"]}, {"content", "sunny"}}};
  int64_t before = h.engine->forwarded_tokens;
  json second = h.post("/v1/chat/completions", {{"messages", messages}, {"tools", tools}});
  int64_t prompt = second["usage"]["prompt_tokens"], cached = second["usage"]["prompt_tokens_details"]["cached_tokens"];
  EXPECT_GT(cached, first["usage"]["prompt_tokens"].get<int64_t>());  // prompt + most of the generated turn
  EXPECT_LT(cached, prompt);
  // Only the uncached part of the prompt was computed, then the generated tokens.
  EXPECT_EQ(h.engine->forwarded_tokens - before, prompt - cached + second["usage"]["completion_tokens"].get<int64_t>() - 1);
  EXPECT_NE(h.client().Get("/metrics")->body.find("moesrv_prefix_cache_hit_tokens_total " + std::to_string(cached)), std::string::npos);
}

TEST(Server, ReasoningReattachedForToolTurns) {
  ByteCodec codec;
  Harness h(script_policy(codec, kReasonThenCall, "<|observation|>"));
  json first = h.post("/v1/chat/completions", {{"messages", {user("weather?")}}, {"tools", {kWeatherTool}}});
  json assistant = first["choices"][0]["message"];
  assistant.erase("reasoning_content");
  std::string reasoning = "The user wants weather.";
  auto prompt_text = [&] {
    std::string s;
    for (int32_t t : h.engine->last_sequence()) s += codec.token_bytes(t);
    return s;
  };
  // Matched by tool-call id.
  h.post("/v1/chat/completions", {{"messages", {user("weather?"), assistant, {{"role", "tool"}, {"content", "sunny"}}}}, {"tools", {kWeatherTool}}});
  EXPECT_NE(prompt_text().find("<think>" + reasoning + "</think>Let me check."), std::string::npos) << prompt_text();
  // Matched by content hash when the client rewrote the ids (and re-serialised the arguments).
  assistant["tool_calls"][0]["id"] = "call_rewritten";
  assistant["tool_calls"][0]["function"]["arguments"] = R"({ "days": 3, "city": "Paris" })";
  h.post("/v1/chat/completions", {{"messages", {user("weather?"), assistant, {{"role", "tool"}, {"content", "rain"}}}}, {"tools", {kWeatherTool}}});
  EXPECT_NE(prompt_text().find("<think>" + reasoning + "</think>Let me check."), std::string::npos) << prompt_text();
  // A client-supplied reasoning_content wins.
  assistant["reasoning_content"] = "mine";
  h.post("/v1/chat/completions", {{"messages", {user("weather?"), assistant, {{"role", "tool"}, {"content", "hail"}}}}, {"tools", {kWeatherTool}}});
  EXPECT_NE(prompt_text().find("<think>mine</think>"), std::string::npos);
}

TEST(Server, QueueFullGives429AndTimeoutGives503) {
  ByteCodec codec;
  Harness h(script_policy(codec, std::string(40, 'z')), {.queue_max = 1, .queue_timeout_s = 30});
  h.engine->delay_ms = 20;  // ~1 s per request
  json body = {{"messages", {user("q")}}};
  auto run = [&] {
    int status = 0;
    h.post("/v1/chat/completions", body, &status);
    return status;
  };
  auto a = std::async(std::launch::async, run);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  auto b = std::async(std::launch::async, run);  // queued
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  int status = 0;
  json rejected = h.post("/v1/chat/completions", body, &status);
  EXPECT_EQ(status, 429);
  EXPECT_EQ(rejected["error"]["code"], "queue_full");
  EXPECT_EQ(a.get(), 200);
  EXPECT_EQ(b.get(), 200);

  Harness t(script_policy(codec, std::string(40, 'z')), {.queue_max = 4, .queue_timeout_s = 0.2});
  t.engine->delay_ms = 20;
  auto busy = std::async(std::launch::async, [&] { int s = 0; t.post("/v1/chat/completions", body, &s); return s; });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  json timed_out = t.post("/v1/chat/completions", body, &status);
  EXPECT_EQ(status, 503);
  EXPECT_EQ(timed_out["error"]["code"], "queue_timeout");
  EXPECT_EQ(busy.get(), 200);
}

TEST(Server, ClientDisconnectCancelsGeneration) {
  ByteCodec codec;
  Policy forever = [](const std::vector<int32_t>&) -> Preferences { return {{int32_t('x'), 10.f}}; };
  Harness h(forever);
  h.engine->delay_ms = 10;
  {
    auto c = h.client();
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/chat/completions";
    req.body = json({{"messages", {user("q")}}, {"stream", true}, {"max_tokens", 3000}}).dump();
    req.set_header("Content-Type", "application/json");
    int chunks = 0;
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 5; };  // hang up
    c.send(req);
  }
  auto start = std::chrono::steady_clock::now();
  int status = 0;
  h.engine->delay_ms = 0;
  json r = h.post("/v1/chat/completions", {{"messages", {user("q")}}, {"max_tokens", 2}}, &status);
  EXPECT_EQ(status, 200);
  double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(waited, 5.0);  // the abandoned 3000-token generation (30 s) was stopped
  EXPECT_NE(h.client().Get("/metrics")->body.find("moesrv_requests_cancelled_total 1"), std::string::npos);
}
