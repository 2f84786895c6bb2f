// The server with the real pieces: the CPU engine on an hf-tiny GLM model (vocab 1024) and the real
// tokenizer + GLM chat formatter, using the tiny byte-level BPE fixture (tests/fixtures/server).
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <csignal>
#include <filesystem>

#include "backend/cpu/cpu_engine.h"
#include "mtp_test_model.h"
#include "server/http_server.h"
#include "server/tokenizer_codec.h"
#include "server_test_client.h"
#include "server_test_node.h"

using namespace moesrv;
using namespace moesrv::testing;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kModel = std::string(MOESRV_TESTDATA) + "/hf-tiny/glm4_moe";
const std::string kTokenizer = std::string(MOESRV_SOURCE_DIR) + "/tests/fixtures/server/tiny_glm_tokenizer";

struct RealServer : ::testing::Test {
  static void SetUpTestSuite() {
    std::signal(SIGPIPE, SIG_IGN);
    if (!fs::exists(kModel + "/model.safetensors")) return;
    engine = CpuEngine::open(kModel).release();
    codec = new TokenizerCodec(kTokenizer, kModel);
    ServerOptions opt;
    opt.port = 0;
    opt.served_name = "tiny-glm";
    opt.strict_tools = true;
    server = new HttpServer(*engine, *codec, opt);
    port = server->start();
  }
  static void TearDownTestSuite() {
    delete server;
    delete codec;
    delete engine;
  }
  void SetUp() override {
    if (!server) MOESRV_E2E_SKIP("no hf-tiny model at " << kModel);
  }
  json post(const json& body, int* status = nullptr) {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(120, 0);
    auto res = c.Post("/v1/chat/completions", body.dump(), "application/json");
    EXPECT_TRUE(res);
    if (!res) return {};
    if (status) *status = res->status;
    return json::parse(res->body);
  }
  static inline CpuEngine* engine = nullptr;
  static inline TokenizerCodec* codec = nullptr;
  static inline HttpServer* server = nullptr;
  static inline int port = 0;
};

}  // namespace

TEST_F(RealServer, FixtureTokenizerMatchesTheModel) {
  EXPECT_EQ(codec->vocab_size(), 1024);
  EXPECT_EQ(engine->vocab_size(), 1024);
  EXPECT_EQ(codec->format(), ChatFormat::kGlm47);
  auto ids = codec->encode("[gMASK]<sop><|user|>hello world<|assistant|>");
  EXPECT_EQ(ids[0], *codec->special_id("[gMASK]"));
  std::string text;
  for (int32_t t : ids) text += codec->token_bytes(t);
  EXPECT_EQ(text, "[gMASK]<sop><|user|>hello world<|assistant|>");
}

TEST_F(RealServer, GreedyChatIsDeterministicAndCachesThePrefix) {
  json body = {{"messages", {{{"role", "user"}, {"content", "Say hello."}}}}, {"max_tokens", 12}, {"temperature", 0}};
  int status = 0;
  json a = post(body, &status);
  ASSERT_EQ(status, 200) << a.dump();
  EXPECT_EQ(a["model"], "tiny-glm");
  EXPECT_GT(a["usage"]["prompt_tokens"], 5);
  EXPECT_LE(a["usage"]["completion_tokens"], 12);
  json b = post(body);
  EXPECT_EQ(a["choices"][0]["message"], b["choices"][0]["message"]);
  EXPECT_EQ(b["usage"]["prompt_tokens_details"]["cached_tokens"], b["usage"]["prompt_tokens"].get<int>() - 1);
  // Seeded sampling is reproducible too.
  body["temperature"] = 1.0;
  body["seed"] = 7;
  EXPECT_EQ(post(body)["choices"][0]["message"], post(body)["choices"][0]["message"]);
}

TEST_F(RealServer, StreamingMatchesNonStreaming) {
  json body = {{"messages", {{{"role", "user"}, {"content", "Count to three."}}}}, {"max_tokens", 10}, {"temperature", 0}};
  json whole = post(body);
  body["stream"] = true;
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(120, 0);
  auto s = post_stream(c, "/v1/chat/completions", body);
  EXPECT_TRUE(s.done);
  std::string finish;
  json joined = join_chat_deltas(s.events, &finish);
  auto& msg = whole["choices"][0]["message"];
  EXPECT_EQ(joined["content"], msg["content"].is_null() ? json("") : msg["content"]);
  EXPECT_EQ(joined["reasoning_content"], msg.value("reasoning_content", ""));
  EXPECT_EQ(finish, whole["choices"][0]["finish_reason"]);
}

TEST_F(RealServer, StrictNamedToolCallWithRealVocabulary) {
  json tool = json::parse(R"({"type":"function","function":{"name":"set_flag",
    "parameters":{"type":"object","properties":{"flag":{"type":"boolean"}},"required":["flag"]}}})");
  json body = {{"messages", {{{"role", "user"}, {"content", "Set the flag."}}}}, {"tools", {tool}},
               {"tool_choice", {{"type", "function"}, {"function", {{"name", "set_flag"}}}}},
               {"max_tokens", 128}, {"temperature", 0}, {"chat_template_kwargs", {{"enable_thinking", false}}}};
  json r = post(body);
  auto& msg = r["choices"][0]["message"];
  ASSERT_TRUE(msg.contains("tool_calls")) << r.dump();
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "set_flag");
  // Every path through the grammar is bounded (names, keys, whitespace runs), so even a random model
  // completes the call well within the budget, with a JSON boolean.
  json args = json::parse(msg["tool_calls"][0]["function"]["arguments"].get<std::string>());
  EXPECT_TRUE(args["flag"].is_boolean()) << r.dump();
}

// The same server with MTP drafts (glm4_moe with a random MTP block: the main weights are the fixture's) answers
// greedy requests, a strict tool call (grammar masks per drafted position) included, as the plain server does, and
// counts its drafting on /metrics. Its draft policy chooses 0..3 drafts per step.
TEST_F(RealServer, SpeculativeServerAnswersAsThePlainOne) {
  const std::string dir = copy_with_mtp(kModel, "server_glm4_moe", 99, false);
  auto mtp_engine = CpuEngine::open(dir);
  fs::remove_all(dir);
  ASSERT_NE(mtp_engine->mtp(), nullptr);
  ServerOptions opt;
  opt.port = 0;
  opt.served_name = "tiny-glm";
  opt.strict_tools = true;
  opt.speculative = 3;
  HttpServer spec(*mtp_engine, *codec, opt);
  const int spec_port = spec.start();
  json tool = json::parse(R"({"type":"function","function":{"name":"set_flag",
    "parameters":{"type":"object","properties":{"flag":{"type":"boolean"}},"required":["flag"]}}})");
  for (const json& body :
       {json{{"messages", {{{"role", "user"}, {"content", "Say hello."}}}}, {"max_tokens", 12}, {"temperature", 0}},
        json{{"messages", {{{"role", "user"}, {"content", "Set the flag."}}}},
             {"tools", {tool}},
             {"tool_choice", {{"type", "function"}, {"function", {{"name", "set_flag"}}}}},
             {"max_tokens", 64},
             {"temperature", 0},
             {"chat_template_kwargs", {{"enable_thinking", false}}}}}) {
    httplib::Client c("127.0.0.1", spec_port);
    c.set_read_timeout(120, 0);
    auto res = c.Post("/v1/chat/completions", body.dump(), "application/json");
    ASSERT_TRUE(res && res->status == 200) << (res ? res->body : "no response");
    json a = json::parse(res->body), b = post(body);
    for (json* r : {&a, &b}) {  // tool call ids are random
      json& msg = (*r)["choices"][0]["message"];
      if (msg.contains("tool_calls"))
        for (json& call : msg["tool_calls"]) call.erase("id");
    }
    EXPECT_EQ(a["choices"][0]["message"], b["choices"][0]["message"]) << a.dump() << "\n" << b.dump();
    EXPECT_EQ(a["usage"]["completion_tokens"], b["usage"]["completion_tokens"]);
  }
  httplib::Client c("127.0.0.1", spec_port);
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m && m->status == 200);
  EXPECT_EQ(m->body.find("moesrv_speculative_steps_total 0\n"), std::string::npos) << m->body;
  EXPECT_NE(m->body.find("moesrv_speculative_draft_tokens_total"), std::string::npos);
  // mtp:3 drafts 0..3 per step by the draft policy, which warms up with two plain steps.
  EXPECT_NE(m->body.find("moesrv_speculative_plain_steps_total"), std::string::npos);
  EXPECT_EQ(m->body.find("moesrv_speculative_plain_steps_total 0\n"), std::string::npos) << m->body;
  EXPECT_NE(m->body.find("moesrv_speculative_draft_length"), std::string::npos);
  spec.stop();
}

namespace {
json chat(int port, const json& body) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(300, 0);
  auto res = c.Post("/v1/chat/completions", body.dump(), "application/json");
  EXPECT_TRUE(res && res->status == 200) << (res ? res->body : "no response");
  return res ? json::parse(res->body) : json();
}
int64_t cached(const json& r) { return r["usage"]["prompt_tokens_details"]["cached_tokens"]; }
int64_t prompt_tokens(const json& r) { return r["usage"]["prompt_tokens"]; }
}  // namespace

// Hybrid models (linear-attention layers with recurrent + conv state, resumable only at checkpoints) behind the
// fixture tokenizer (vocab 1024 too). A resubmitted prompt reuses all but its last token and answers as a cold
// server does; a follow-up turn reuses at least the first turn's prompt and also answers as a cold server does.
class HybridServer : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::signal(SIGPIPE, SIG_IGN);
    const std::string dir = std::string(MOESRV_TESTDATA) + "/hf-tiny/" + GetParam();
    if (!fs::exists(dir + "/model.safetensors")) MOESRV_E2E_SKIP("no hf-tiny model at " << dir);
    engine = CpuEngine::open(dir);
    codec = std::make_unique<TokenizerCodec>(kTokenizer, dir);
  }
  // A fresh server (its own, empty prefix cache) on the shared engine.
  std::unique_ptr<HttpServer> serve(int& port) {
    ServerOptions opt;
    opt.port = 0;
    auto s = std::make_unique<HttpServer>(*engine, *codec, opt);
    port = s->start();
    return s;
  }
  std::unique_ptr<CpuEngine> engine;
  std::unique_ptr<TokenizerCodec> codec;
};

TEST_P(HybridServer, SamePromptTwiceHitsAndAnswersAsAColdServer) {
  std::string question;
  for (int i = 0; i < 24; ++i)
    question += "Item " + std::to_string(i) + ": the quick brown fox jumps over the lazy dog. ";
  json body = {{"messages", {{{"role", "user"}, {"content", question}}}}, {"max_tokens", 16}, {"temperature", 0}};
  int warm_port = 0, cold_port = 0;
  auto warm = serve(warm_port);
  json a = chat(warm_port, body), b = chat(warm_port, body);
  const int64_t n = prompt_tokens(a);
  EXPECT_GT(n, 400);
  EXPECT_EQ(cached(a), 0);
  EXPECT_EQ(prompt_tokens(b), n);
  EXPECT_GE(cached(b), n - 1) << b.dump();
  EXPECT_EQ(b["choices"][0]["message"], a["choices"][0]["message"]);
  auto cold = serve(cold_port);
  json c = chat(cold_port, body);
  EXPECT_EQ(cached(c), 0);
  EXPECT_EQ(c["choices"][0]["message"], a["choices"][0]["message"]);

  // The next turn: the first prompt, the answer, a new question. Its rendering shares with the first prompt all
  // that a KV cache could reuse (the template re-renders the end of the first prompt, e.g. an opened <think>);
  // the hybrid state resumes there too (the checkpoint before the prompt's last token, or the one after it).
  auto ids = [&](const json& messages) {
    return codec->encode(codec->render_chat(nlohmann::ordered_json::parse(messages.dump()),
                                            nlohmann::ordered_json::array(), nlohmann::ordered_json::object()));
  };
  const auto first = ids(body["messages"]);
  ASSERT_EQ(int64_t(first.size()), n);  // rendered as the server does
  body["messages"].push_back(a["choices"][0]["message"]);
  body["messages"].push_back({{"role", "user"}, {"content", "And the next item?"}});
  const auto next = ids(body["messages"]);
  const int64_t shared = std::mismatch(first.begin(), first.end(), next.begin(), next.end()).first - first.begin();
  EXPECT_GE(shared, n - 1);
  json d = chat(warm_port, body);
  EXPECT_EQ(prompt_tokens(d), int64_t(next.size()));
  EXPECT_EQ(cached(d), shared) << d.dump();
  EXPECT_LT(cached(d), prompt_tokens(d));
  int fresh_port = 0;
  auto fresh = serve(fresh_port);
  json f = chat(fresh_port, body);
  EXPECT_EQ(cached(f), 0);
  EXPECT_EQ(d["choices"][0]["message"], f["choices"][0]["message"]);
}

INSTANTIATE_TEST_SUITE_P(Models, HybridServer, ::testing::Values("glm5_next", "qwen3_next"));
