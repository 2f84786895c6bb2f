// Unit tests of the strict tool-call grammar, the JSON prefix validator and the GLM output parser.
#include <gtest/gtest.h>

#include "server/glm_output_parser.h"
#include "server/json_prefix_validator.h"
#include "server/tool_call_grammar.h"
#include "server_test_doubles.h"

using namespace moesrv;
using moesrv::testing::ByteCodec;
using nlohmann::json;

static bool json_ok(const std::string& s, const std::string& type = "") {
  JsonPrefixValidator v(type);
  for (char c : s)
    if (!v.feed(c)) return false;
  return v.complete();
}

TEST(JsonPrefixValidator, AcceptsValidJsonOnly) {
  for (auto* s : {"0", "-1.5e+3", "true", "null", "\"a\\\"b\\u00e9\"", "[]", "{}", " [1, {\"a\": [null, false]}] ",
                  "{\"k\":\"v\",\"n\":2}"})
    EXPECT_TRUE(json_ok(s)) << s;
  for (auto* s : {"01", "1.", "tru", "[1,]", "{\"a\" 1}", "{a:1}", "\"open", "[1 2]", "1 2", "{\"a\":1,}", "-"})
    EXPECT_FALSE(json_ok(s)) << s;
  EXPECT_TRUE(json_ok("42", "integer"));
  EXPECT_FALSE(json_ok("4.2", "integer"));
  EXPECT_TRUE(json_ok("4.2", "number"));
  EXPECT_FALSE(json_ok("\"x\"", "number"));
  EXPECT_TRUE(json_ok("false", "boolean"));
  EXPECT_FALSE(json_ok("[1]", "object"));
  EXPECT_TRUE(json_ok("[1]", "array"));
}

namespace {
struct GrammarFixture : ::testing::Test {
  ByteCodec codec;
  VocabText vocab{codec};
  std::vector<ToolSpec> tools = parse_tools(json::parse(R"([
    {"type":"function","function":{"name":"read","parameters":{"properties":{"path":{"type":"string"}},"required":["path"]}}},
    {"type":"function","function":{"name":"read_lines","parameters":{"properties":{"path":{"type":"string"},
      "start":{"type":"integer"},"opts":{"type":"object"}},"required":["path","start"]}}}])"));
  // Feeds a whole text through the grammar (after <tool_call>); false at the first rejected token.
  bool accepts(const ToolCallGrammar& g, const std::string& text) {
    ToolCallGrammar::State s;
    for (int32_t t : codec.encode(text))
      if (!g.advance(s, t, vocab)) return false;
    return s.phase == ToolCallGrammar::State::kDone;
  }
};
}  // namespace

TEST_F(GrammarFixture, NamesKeysValuesAndRequired) {
  ToolCallGrammar g(tools, {}, GlmMarkers::from(codec));
  EXPECT_TRUE(accepts(g, "read\n<arg_key>path</arg_key>\n<arg_value>a.txt</arg_value>\n</tool_call>"));
  EXPECT_TRUE(accepts(g, "read_lines<arg_key>start</arg_key><arg_value>10</arg_value><arg_key>path</arg_key><arg_value>x</arg_value></tool_call>"));
  EXPECT_TRUE(accepts(g, "read_lines\n<arg_key>path</arg_key><arg_value>x</arg_value><arg_key>start</arg_key><arg_value> 3 </arg_value>"
                         "<arg_key>opts</arg_key><arg_value>{\"a\": [1]}</arg_value></tool_call>"));
  EXPECT_FALSE(accepts(g, "reed\n"));                                                                      // unknown tool
  EXPECT_FALSE(accepts(g, "read\n<arg_key>file</arg_key>"));                                               // unknown key
  EXPECT_FALSE(accepts(g, "read\n</tool_call>"));                                                          // missing required
  EXPECT_FALSE(accepts(g, "read_lines<arg_key>path</arg_key><arg_value>x</arg_value><arg_key>start</arg_key><arg_value>ten</arg_value>"));
  EXPECT_FALSE(accepts(g, "read<arg_key>path</arg_key><arg_value>x</arg_value><arg_key>path</arg_key>"));  // repeated key
  EXPECT_FALSE(accepts(g, "read<arg_key>path</arg_key><arg_value>x<|endoftext|>"));                        // no early end
  ToolCallGrammar named(tools, {"read_lines"}, GlmMarkers::from(codec));
  EXPECT_FALSE(accepts(named, "read\n<arg_key>path</arg_key><arg_value>a</arg_value></tool_call>"));
}

TEST_F(GrammarFixture, MaskAllowsExactlyTheValidContinuations) {
  ToolCallGrammar g(tools, {}, GlmMarkers::from(codec));
  ToolCallGrammar::State s;
  std::vector<uint8_t> mask;
  g.mask(s, vocab, mask);
  EXPECT_TRUE(mask['r']);
  EXPECT_FALSE(mask['x']);
  EXPECT_FALSE(mask[size_t(*codec.special_id("</tool_call>"))]);
  for (int32_t t : codec.encode("read")) ASSERT_TRUE(g.advance(s, t, vocab));
  g.mask(s, vocab, mask);
  EXPECT_TRUE(mask['_'] && mask['\n'] && mask[size_t(*codec.special_id("<arg_key>"))]);
  EXPECT_FALSE(mask[size_t(*codec.special_id("</tool_call>"))]);  // "path" is required
  EXPECT_FALSE(mask['x']);
}

TEST(GlmOutputParser, SplitsChannelsAndStreamsArguments) {
  ByteCodec codec;
  auto tools = parse_tools(json::parse(R"([{"type":"function","function":{"name":"f","parameters":{"properties":{
      "s":{"type":"string"},"n":{"type":"integer"}}}}}])"));
  GlmOutputParser p(codec, &tools, false);
  ChatDelta all;
  std::string args;
  for (int32_t t : codec.encode("\n<think>\nplan it\n</think>\n\nHi there \n<tool_call>f\n<arg_key>s</arg_key>\n"
                                "<arg_value>line \"1\"\nline 2</arg_value>\n<arg_key>n</arg_key>\n<arg_value>7</arg_value>\n</tool_call>")) {
    ChatDelta d;
    p.push(t, d);
    all.reasoning += d.reasoning;
    all.content += d.content;
    for (auto& c : d.tool_calls) args += c.arguments;
  }
  ChatDelta d;
  p.finish(d);
  EXPECT_EQ(all.reasoning, "plan it");
  EXPECT_EQ(all.content, "Hi there");
  ASSERT_EQ(p.tool_calls().size(), 1u);
  EXPECT_EQ(p.tool_calls()[0].name, "f");
  EXPECT_EQ(json::parse(args), json({{"s", "line \"1\"\nline 2"}, {"n", 7}}));
  EXPECT_EQ(args, p.tool_calls()[0].arguments);
}

TEST(GlmOutputParser, SplitUtf8IsReassembled) {
  ByteCodec codec;
  GlmOutputParser p(codec, nullptr, false);
  std::string text;
  for (unsigned char c : std::string("h\xC3\xA9llo \xE2\x82\xAC")) {  // byte tokens split the characters
    ChatDelta d;
    p.push(int32_t(c), d);
    EXPECT_TRUE(json(d.content).dump().size() > 0);  // always valid UTF-8
    text += d.content;
  }
  EXPECT_EQ(text, "h\xC3\xA9llo \xE2\x82\xAC");
}
