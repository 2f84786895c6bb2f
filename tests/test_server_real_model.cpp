// The server with the real pieces: the CPU engine on an hf-tiny GLM model (vocab 1024) and the real
// tokenizer + GLM chat formatter, using the tiny byte-level BPE fixture (tests/fixtures/server).
#include <gtest/gtest.h>
#include <httplib.h>

#include <csignal>
#include <filesystem>

#include "backend/cpu/cpu_engine.h"
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
