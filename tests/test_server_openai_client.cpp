// The official `openai` Node client against the server (scripted engine): streaming, tool-call deltas,
// usage, errors. Skipped when node/npm or the package is unavailable (e.g. offline).
#include <gtest/gtest.h>

#include <csignal>

#include "server/http_server.h"
#include "server_test_doubles.h"
#include "server_test_node.h"

using namespace moesrv;
using namespace moesrv::testing;
using nlohmann::json;

TEST(ServerOpenAIClient, StreamingToolsAndErrors) {
  std::string dir = openai_node_dir();
  if (dir.empty()) MOESRV_E2E_SKIP("node/npm or the openai package is unavailable");
  std::signal(SIGPIPE, SIG_IGN);
  ByteCodec codec;
  ScriptedEngine engine(codec, script_policy(codec,
      "<think>Need the weather.</think>Checking.<tool_call>get_weather\n<arg_key>city</arg_key>"
      "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>", "<|observation|>"));
  ServerOptions opt;
  opt.port = 0;
  HttpServer server(engine, codec, opt);
  int port = server.start();
  int rc = 0;
  std::string script = std::string(MOESRV_SOURCE_DIR) + "/tests/fixtures/server/openai_client_check.cjs";
  std::string out = run_command("OPENAI_DIR='" + dir + "' BASE_URL=http://127.0.0.1:" + std::to_string(port) +
                                    "/v1 timeout 120 node '" + script + "' 2>&1",
                                &rc);
  ASSERT_EQ(rc, 0) << out;
  size_t at = out.find("{\"models\"");
  ASSERT_NE(at, std::string::npos) << out;
  json r = json::parse(out.substr(at));
  EXPECT_EQ(r["models"], json({"scripted"}));
  EXPECT_EQ(r["reasoning"], "Need the weather.");
  EXPECT_EQ(r["content"], "Checking.");
  EXPECT_EQ(r["finish"], "tool_calls");
  ASSERT_EQ(r["calls"].size(), 1u);
  EXPECT_EQ(r["calls"][0]["name"], "get_weather");
  EXPECT_EQ(json::parse(r["calls"][0]["arguments"].get<std::string>()), json({{"city", "Paris"}, {"days", 2}}));
  EXPECT_GT(r["usage"]["completion_tokens"], 0);
  EXPECT_EQ(r["whole"]["finish_reason"], "tool_calls");
  EXPECT_EQ(r["whole"]["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(r["error_status"], 400);
}
