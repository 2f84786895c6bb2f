// Unit tests of constrained decoding (the JSON schema matcher and the turn grammar, for every tool-call format)
// and of the output parsers (GLM, Qwen3, DeepSeek-V3).
#include <gtest/gtest.h>

#include <random>

#include "server/json_schema.h"
#include "server/output_parser.h"
#include "server/turn_grammar.h"
#include "server_test_doubles.h"

using namespace moesrv;
using moesrv::testing::ByteCodec;
using moesrv::testing::TestFormat;
using nlohmann::json;

namespace {

bool matches(const json& schema, const std::string& text, bool* complete_out = nullptr) {
  auto s = JsonSchema::compile(schema);
  JsonMatcher m(s.get(), s->root());
  for (char c : text)
    if (!m.feed(c)) return false;
  if (complete_out) *complete_out = m.complete();
  return m.complete();
}

bool any_json(const std::string& text) { return matches(json::object(), text); }

}  // namespace

TEST(JsonMatcher, AcceptsValidJsonOnly) {
  for (auto* s : {"0", "-1.5e+3", "true", "null", "\"a\\\"b\\u00e9\"", "[]", "{}", " [1, {\"a\": [null, false]}] ",
                  "{\"k\":\"v\",\"n\":2}", "\"h\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\""})
    EXPECT_TRUE(any_json(s)) << s;
  for (auto* s : {"01", "1.", "tru", "[1,]", "{\"a\" 1}", "{a:1}", "\"open", "[1 2]", "1 2", "{\"a\":1,}", "-",
                  "\"\x01\"", "\"\xC3\"", "\"\xC0\x80\"", "\"\xED\xA0\x80\"", "\"\\x\""})
    EXPECT_FALSE(any_json(s)) << s;
  // Every accepted text parses with nlohmann::json.
  for (auto* s : {"{\"a\":[1,2,{\"b\":\"\xE2\x82\xAC\"}]}", "\"\\ud83d\\ude00\""}) {
    ASSERT_TRUE(any_json(s));
    EXPECT_FALSE(json::parse(s, nullptr, false).is_discarded());
  }
}

TEST(JsonMatcher, SchemaTypesRequiredEnumsAndNesting) {
  json schema = json::parse(R"({"type":"object","properties":{
      "city":{"type":"string","maxLength":5},
      "unit":{"enum":["c","f"]},
      "days":{"type":"integer"},
      "tags":{"type":"array","items":{"type":"string"},"maxItems":2},
      "loc":{"type":"object","properties":{"lat":{"type":"number"}},"required":["lat"]},
      "note":{"type":["string","null"]}},
    "required":["city","days"]})");
  EXPECT_TRUE(matches(schema, R"({"city":"Paris","days":3})"));
  EXPECT_TRUE(
      matches(schema, R"({"days":3,"city":"Oslo","unit":"f","tags":["a","b"],"loc":{"lat":-1.5e2},"note":null})"));
  EXPECT_FALSE(matches(schema, R"({"city":"Paris"})"));                            // days required
  EXPECT_FALSE(matches(schema, R"({"city":"Lisbon","days":3})"));                  // maxLength
  EXPECT_FALSE(matches(schema, R"({"city":"P","days":3.5})"));                     // integer
  EXPECT_FALSE(matches(schema, R"({"city":"P","days":"3"})"));                     // type
  EXPECT_FALSE(matches(schema, R"({"city":"P","days":3,"unit":"k"})"));            // enum
  EXPECT_FALSE(matches(schema, R"({"city":"P","days":3,"tags":["a","b","c"]})"));  // maxItems
  EXPECT_FALSE(matches(schema, R"({"city":"P","days":3,"loc":{}})"));              // nested required
  EXPECT_FALSE(matches(schema, R"({"city":"P","days":3,"other":1})"));             // undeclared key
  EXPECT_FALSE(matches(schema, R"({"city":"P","city":"Q","days":3})"));            // repeated key
  EXPECT_TRUE(matches(json::parse(R"({"enum":[1,12,"x"]})"), "12"));
  EXPECT_TRUE(matches(json::parse(R"({"enum":[1,12,"x"]})"), "1"));
  EXPECT_FALSE(matches(json::parse(R"({"enum":[1,12,"x"]})"), "2"));
  // additionalProperties, $ref/$defs (recursive), anyOf.
  EXPECT_TRUE(matches(json::parse(R"({"type":"object","properties":{"a":{}},"additionalProperties":true})"),
                      R"({"a":1,"b":[2]})"));
  json tree = json::parse(R"({"$defs":{"node":{"type":"object","properties":{"v":{"type":"integer"},
      "kids":{"type":"array","items":{"$ref":"#/$defs/node"}}},"required":["v"]}},"$ref":"#/$defs/node"})");
  EXPECT_TRUE(matches(tree, R"({"v":1,"kids":[{"v":2},{"v":3,"kids":[]}]})"));
  EXPECT_FALSE(matches(tree, R"({"v":1,"kids":[{"w":2}]})"));
  json any_of = json::parse(R"({"anyOf":[{"type":"integer"},{"type":"string","enum":["auto"]}]})");
  EXPECT_TRUE(matches(any_of, "5"));
  EXPECT_TRUE(matches(any_of, "\"auto\""));
  EXPECT_FALSE(matches(any_of, "\"manual\""));
  EXPECT_THROW(JsonSchema::compile(json::parse(R"({"type":"wizard"})")), std::invalid_argument);
  EXPECT_THROW(JsonSchema::compile(json::parse(R"({"$ref":"#/$defs/missing"})")), std::invalid_argument);
}

TEST(JsonMatcher, EveryPathIsBounded) {
  auto s = JsonSchema::any_value();
  JsonMatcher m(s.get(), s->root());
  ASSERT_TRUE(m.feed('1'));
  int digits = 1;
  while (m.feed('1')) ++digits;
  EXPECT_EQ(digits, JsonMatcher::kMaxDigits);
  JsonMatcher w(s.get(), s->root());
  int spaces = 0;
  while (w.feed(' ')) ++spaces;
  EXPECT_EQ(spaces, JsonMatcher::kMaxSpaces);
}

// ---- the turn grammar ----

namespace {

const char* kTools = R"([
  {"type":"function","function":{"name":"read","parameters":{"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}}},
  {"type":"function","function":{"name":"read_lines","parameters":{"type":"object","properties":{"path":{"type":"string"},
    "start":{"type":"integer"},"mode":{"enum":["fast","slow"]},"opts":{"type":"object","properties":{"n":{"type":"boolean"}}}},
    "required":["path","start"]}}}])";

struct Turn {
  ByteCodec codec;
  VocabText vocab{codec};
  TurnMarkers markers = TurnMarkers::detect(codec);
  std::vector<ToolSpec> tools = parse_tools(json::parse(kTools));
  explicit Turn(TestFormat f = TestFormat::kGlm) : codec(f) {}
  TurnGrammar grammar(TurnRules r) { return TurnGrammar(markers, tools, std::move(r), vocab); }
  // Feeds `text` (special-token text allowed) token by token; returns the tokens accepted before a rejection.
  size_t accepted(const TurnGrammar& g, const std::string& text, TurnGrammar::State* out = nullptr) {
    auto s = g.initial();
    auto ids = codec.encode(text);
    size_t n = 0;
    for (; n < ids.size(); ++n)
      if (!g.advance(s, ids[n])) break;
    if (out) *out = s;
    return n;
  }
  bool accepts(const TurnGrammar& g, const std::string& text) { return accepted(g, text) == codec.encode(text).size(); }
  // Brute force: the mask must equal "advance() accepts this token" for every token.
  void check_mask(const TurnGrammar& g, const TurnGrammar::State& s) {
    std::vector<uint8_t> mask;
    g.mask(s, mask);
    for (int32_t t = 0; t < int32_t(vocab.bytes.size()); ++t) {
      auto copy = s;
      ASSERT_EQ(bool(mask[size_t(t)]), g.advance(copy, t)) << "token " << t << " '" << vocab.bytes[size_t(t)] << "'";
    }
  }
};

TurnRules strict_auto() {
  TurnRules r;
  r.calls_allowed = true;
  r.strict_calls = true;
  return r;
}

}  // namespace

TEST(TurnGrammar, GlmStrictCalls) {
  Turn t;
  auto g = t.grammar(strict_auto());
  EXPECT_TRUE(t.accepts(
      g, "Sure.<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>a.txt</arg_value>\n</tool_call><|endoftext|>"));
  EXPECT_TRUE(
      t.accepts(g,
                "<tool_call>read_lines<arg_key>start</arg_key><arg_value>10</arg_value><arg_key>path</arg_key>"
                "<arg_value>x</arg_value><arg_key>mode</arg_key><arg_value>slow</arg_value><arg_key>opts</arg_key>"
                "<arg_value>{\"n\": true}</arg_value></tool_call>\n<tool_call>read<arg_key>path</arg_key>"
                "<arg_value>y</arg_value></tool_call><|endoftext|>"));
  EXPECT_FALSE(t.accepts(g, "<tool_call>reed\n"));                                                 // unknown tool
  EXPECT_FALSE(t.accepts(g, "<tool_call>read\n<arg_key>file</arg_key>"));                          // unknown key
  EXPECT_FALSE(t.accepts(g, "<tool_call>read\n</tool_call>"));                                     // required missing
  EXPECT_FALSE(t.accepts(g, "<tool_call>read_lines<arg_key>start</arg_key><arg_value>ten"));       // integer
  EXPECT_FALSE(t.accepts(g, "<tool_call>read_lines<arg_key>mode</arg_key><arg_value>medium"));     // enum
  EXPECT_FALSE(t.accepts(g, "<tool_call>read_lines<arg_key>opts</arg_key><arg_value>{\"x\":1}"));  // nested schema
  EXPECT_FALSE(t.accepts(g, "<tool_call>read<arg_key>path</arg_key><arg_value>x</arg_value><arg_key>path</arg_key>"));
  // No end of turn anywhere inside a call.
  EXPECT_FALSE(t.accepts(g, "<tool_call>read<arg_key>path</arg_key><arg_value>x<|endoftext|>"));
  EXPECT_FALSE(t.accepts(g, "<tool_call>read<|endoftext|>"));
  // After a call: another call or the end, no text.
  EXPECT_FALSE(t.accepts(g, "<tool_call>read<arg_key>path</arg_key><arg_value>x</arg_value></tool_call>more"));
}

TEST(TurnGrammar, ToolChoiceParallelAndReasoning) {
  Turn t;
  const std::string call = "<tool_call>read<arg_key>path</arg_key><arg_value>x</arg_value></tool_call>";
  // none: no call can start (tools stay in the prompt).
  TurnRules none;
  auto g_none = t.grammar(none);
  EXPECT_TRUE(t.accepts(g_none, "Just text.<|endoftext|>"));
  EXPECT_FALSE(t.accepts(g_none, call));
  // required: the turn cannot end in reasoning or in text; reasoning must close before the call.
  TurnRules req = strict_auto();
  req.call_required = true;
  req.start_in_reasoning = true;
  auto g_req = t.grammar(req);
  EXPECT_FALSE(t.accepts(g_req, "thinking<|endoftext|>"));
  EXPECT_FALSE(t.accepts(g_req, "thinking<tool_call>"));  // no call inside reasoning
  EXPECT_FALSE(t.accepts(g_req, "thinking</think>Hello"));
  EXPECT_TRUE(t.accepts(g_req, "thinking</think>" + call + "<|endoftext|>"));
  TurnGrammar::State s;
  t.accepted(g_req, "plan</think>", &s);
  std::vector<uint8_t> mask;
  g_req.mask(s, mask);
  EXPECT_EQ(std::count(mask.begin(), mask.end(), 1), 1);  // only <tool_call>
  EXPECT_TRUE(mask[size_t(*t.codec.special_id("<tool_call>"))]);
  // named: only that function.
  TurnRules named = req;
  named.tools = {1};
  auto g_named = t.grammar(named);
  EXPECT_FALSE(t.accepts(g_named, "p</think>" + call));
  // parallel_tool_calls false: one call, then only the end.
  TurnRules single = strict_auto();
  single.max_calls = 1;
  auto g_single = t.grammar(single);
  EXPECT_TRUE(t.accepts(g_single, call + "<|endoftext|>"));
  EXPECT_FALSE(t.accepts(g_single, call + "\n" + call));
  // Not strict: the body is free, but the end of turn is still not allowed inside it.
  TurnRules loose;
  loose.calls_allowed = true;
  auto g_loose = t.grammar(loose);
  EXPECT_TRUE(t.accepts(g_loose, "<tool_call>anything\n<arg_key>k</arg_key></tool_call><|endoftext|>"));
  EXPECT_FALSE(t.accepts(g_loose, "<tool_call>anything<|endoftext|>"));
  // Stray special tokens are never allowed in text.
  EXPECT_FALSE(t.accepts(g_loose, "hi<sop>"));
}

TEST(TurnGrammar, Qwen3AndDeepSeekFormats) {
  Turn q(TestFormat::kQwen3);
  ASSERT_EQ(q.markers.family, ToolFamily::kQwen3);
  auto gq = q.grammar(strict_auto());
  EXPECT_TRUE(
      q.accepts(gq,
                "<think>hmm</think>\n\n<tool_call>\n{\"name\": \"read_lines\", \"arguments\": {\"path\": \"a\", "
                "\"start\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"read\", \"arguments\": {\"path\": \"b\"}}\n"
                "</tool_call><|im_end|>"));
  EXPECT_FALSE(q.accepts(gq, "<tool_call>\n{\"name\": \"read\", \"arguments\": {}}"));             // path required
  EXPECT_FALSE(q.accepts(gq, "<tool_call>\n{\"name\": \"write\""));                                // unknown
  EXPECT_FALSE(q.accepts(gq, "<tool_call>\n{\"name\": \"read\", \"arguments\": {\"path\": 1}}"));  // type
  EXPECT_FALSE(q.accepts(gq, "<tool_call>\n{\"name\": \"read\", \"arguments\": {\"path\": \"a<|im_end|>"));

  Turn d(TestFormat::kDeepSeek);
  ASSERT_EQ(d.markers.family, ToolFamily::kDeepSeekV3);
  auto gd = d.grammar(strict_auto());
  const std::string one =
      "<｜tool▁call▁begin｜>function<｜tool▁sep｜>read\n```json\n{\"path\": \"a\"}\n```<｜tool▁call▁end｜>";
  EXPECT_TRUE(
      d.accepts(gd, "Ok<｜tool▁calls▁begin｜>" + one + "\n" + one + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"));
  EXPECT_FALSE(d.accepts(gd, "<｜tool▁calls▁begin｜>" + one + "<｜end▁of▁sentence｜>"));  // the section must close
  EXPECT_FALSE(d.accepts(gd, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read\n```json\n{}"));
  TurnRules single = strict_auto();
  single.max_calls = 1;
  auto gd1 = d.grammar(single);
  EXPECT_FALSE(d.accepts(gd1, "<｜tool▁calls▁begin｜>" + one + "\n" + one));
}

TEST(TurnGrammar, ResponseFormatJson) {
  Turn t;
  TurnRules r;
  r.content_schema = JsonSchema::compile(
      json::parse(R"({"type":"object","properties":{"answer":{"type":"integer"}},"required":["answer"]})"));
  r.start_in_reasoning = true;
  auto g = t.grammar(r);
  EXPECT_TRUE(t.accepts(g, "let me see</think>\n{\"answer\": 42}\n<|endoftext|>"));
  EXPECT_FALSE(t.accepts(g, "x<|endoftext|>"));                        // cannot end inside reasoning
  EXPECT_FALSE(t.accepts(g, "x</think>The answer"));                   // content must be JSON
  EXPECT_FALSE(t.accepts(g, "x</think>{\"answer\": 1<|endoftext|>"));  // nor end before it is complete
  EXPECT_FALSE(t.accepts(g, "x</think>{\"answer\": 1} more"));
}

TEST(TurnGrammar, MaskAgreesWithAdvanceEverywhere) {
  // Random walks through each format's grammar; at every step the trie-walked mask equals brute force.
  for (auto f : {TestFormat::kGlm, TestFormat::kQwen3, TestFormat::kDeepSeek}) {
    Turn t(f);
    for (bool strict : {true, false}) {
      TurnRules r = strict_auto();
      r.strict_calls = strict;
      r.call_required = true;
      r.start_in_reasoning = true;
      auto g = t.grammar(r);
      std::mt19937 rng(7);
      for (int walk = 0; walk < 4; ++walk) {
        auto s = g.initial();
        for (int step = 0; step < 60 && s.phase != TurnGrammar::State::kEnd; ++step) {
          t.check_mask(g, s);
          if (::testing::Test::HasFatalFailure()) return;
          std::vector<uint8_t> mask;
          g.mask(s, mask);
          std::vector<int32_t> ok;
          for (size_t i = 0; i < mask.size(); ++i)
            if (mask[i]) ok.push_back(int32_t(i));
          ASSERT_FALSE(ok.empty()) << "dead end";
          // Prefer structure tokens so walks get into calls.
          int32_t pick = ok[rng() % ok.size()];
          for (int32_t id : ok)
            if (t.codec.is_special(id) && rng() % 2) pick = id;
          ASSERT_TRUE(g.advance(s, pick));
        }
      }
    }
  }
}

// tokens_to_end is a real way to the end: from every state of random walks (reasoning, a forced call of each
// format, JSON content), some token brings it down by exactly one, and following such tokens ends the turn in
// exactly that many steps. This is what lets the decoder close a forced call within max_tokens.
TEST(TurnGrammar, TokensToEndIsAWayToTheEnd) {
  auto schema = JsonSchema::compile(json::parse(R"({"type":"object","properties":{"a":{"type":"array",
    "items":{"type":"string","minLength":2},"minItems":2},"b":{"enum":["xy","z"]}},"required":["a","b"]})"));
  for (auto f : {TestFormat::kGlm, TestFormat::kQwen3, TestFormat::kDeepSeek})
    for (bool json_content : {false, true}) {
      Turn t(f);
      TurnRules r = strict_auto();
      r.call_required = !json_content;
      if (json_content) r.content_schema = schema;
      r.start_in_reasoning = t.markers.think_close >= 0;  // the DeepSeek test vocabulary has no </think>
      auto g = t.grammar(r);
      std::mt19937 rng(5);
      for (int walk = 0; walk < 3; ++walk) {
        auto s = g.initial();
        for (int step = 0; step < 40 && s.phase != TurnGrammar::State::kEnd; ++step) {
          auto closing = s;
          uint32_t d = g.tokens_to_end(closing);
          ASSERT_LT(d, JsonSchema::kFar) << family_name(t.markers.family) << " step " << step;
          for (uint32_t left = d; left > 0; --left) {
            bool found = false;
            for (int32_t tok = 0; tok < int32_t(t.vocab.bytes.size()) && !found; ++tok) {
              auto next = closing;
              if (g.advance(next, tok) && g.tokens_to_end(next) == left - 1) closing = next, found = true;
            }
            ASSERT_TRUE(found) << family_name(t.markers.family) << " step " << step << ": stuck " << left
                               << " from end";
          }
          EXPECT_EQ(closing.phase, TurnGrammar::State::kEnd);
          std::vector<uint8_t> mask;
          g.mask(s, mask);
          std::vector<int32_t> ok;
          for (size_t i = 0; i < mask.size(); ++i)
            if (mask[i]) ok.push_back(int32_t(i));
          int32_t pick = ok[rng() % ok.size()];
          for (int32_t id : ok)
            if (t.codec.is_special(id) && rng() % 2) pick = id;
          ASSERT_TRUE(g.advance(s, pick));
        }
      }
    }
}

// ---- output parsers ----

namespace {
struct Parsed {
  std::string reasoning, content, args;
  std::vector<ParsedToolCall> calls;
  std::vector<ToolCallDelta> deltas;
};
Parsed parse(const ByteCodec& codec, const std::string& text, const std::vector<ToolSpec>* tools,
             bool in_reasoning = false) {
  auto p = OutputParser::create(codec, TurnMarkers::detect(codec), tools, in_reasoning);
  Parsed r;
  auto take = [&](const ChatDelta& d) {
    r.reasoning += d.reasoning;
    r.content += d.content;
    for (auto& c : d.tool_calls) r.deltas.push_back(c);
  };
  for (int32_t t : codec.encode(text)) {
    ChatDelta d;
    p->push(t, d);
    take(d);
  }
  ChatDelta d;
  p->finish(d);
  take(d);
  r.calls = p->tool_calls();
  return r;
}
}  // namespace

TEST(OutputParser, GlmSplitsChannelsAndStreamsArguments) {
  ByteCodec codec;
  auto tools = parse_tools(json::parse(R"([{"type":"function","function":{"name":"f","parameters":{"properties":{
      "s":{"type":"string"},"n":{"type":"integer"}}}}}])"));
  auto r =
      parse(codec,
            "\n<think>\nplan it\n</think>\n\nHi there \n<tool_call>f\n<arg_key>s</arg_key>\n"
            "<arg_value>line \"1\"\nline 2</arg_value>\n<arg_key>n</arg_key>\n<arg_value>7</arg_value>\n</tool_call>",
            &tools);
  EXPECT_EQ(r.reasoning, "plan it");
  EXPECT_EQ(r.content, "Hi there");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "f");
  std::string args;
  for (auto& d : r.deltas) args += d.arguments;
  EXPECT_EQ(json::parse(args), json({{"s", "line \"1\"\nline 2"}, {"n", 7}}));
  EXPECT_EQ(args, r.calls[0].arguments);
  EXPECT_GT(r.deltas.size(), 3u);  // streamed in pieces
}

TEST(OutputParser, NothingInsideReasoningIsACallAndSpecialTokensNeverLeak) {
  for (auto f : {TestFormat::kGlm, TestFormat::kQwen3}) {
    ByteCodec codec(f);
    auto r = parse(codec, "<think>maybe <tool_call>read\n</tool_call> no</think>Answer<|endoftext|>", nullptr);
    EXPECT_TRUE(r.calls.empty());
    EXPECT_EQ(r.content, "Answer");
    EXPECT_EQ(r.reasoning.find("<tool_call>"), std::string::npos);
  }
  ByteCodec glm;
  EXPECT_EQ(parse(glm, "a<sop>b[gMASK]c", nullptr).content, "abc");
  ByteCodec qwen(TestFormat::kQwen3);
  EXPECT_EQ(parse(qwen, "x<|vision_pad|>y", nullptr).content, "xy");
}

TEST(OutputParser, Qwen3CallsStreamTheirArguments) {
  ByteCodec codec(TestFormat::kQwen3);
  auto r = parse(codec,
                 "<think>\nneed files\n</think>\n\nReading.\n<tool_call>\n{\"name\": \"read\", \"arguments\": "
                 "{\"path\": \"a \\\"b\\\"\", \"n\": [1, {\"x\": \"}\"}]}}\n</tool_call>\n<tool_call>\n"
                 "{\"arguments\": {\"k\": 1}, \"name\": \"second\"}\n</tool_call>",
                 nullptr);
  EXPECT_EQ(r.reasoning, "need files");
  EXPECT_EQ(r.content, "Reading.");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0].name, "read");
  EXPECT_EQ(json::parse(r.calls[0].arguments), json::parse(R"({"path": "a \"b\"", "n": [1, {"x": "}"}]})"));
  EXPECT_EQ(r.calls[1].name, "second");  // arguments before the name are held until it is known
  EXPECT_EQ(json::parse(r.calls[1].arguments), json({{"k", 1}}));
  ASSERT_FALSE(r.deltas.empty());
  EXPECT_EQ(r.deltas[0].name, "read");
  EXPECT_FALSE(r.deltas[0].id.empty());
  int arg_deltas = 0;
  for (auto& d : r.deltas) arg_deltas += d.index == 0 && !d.arguments.empty();
  EXPECT_GT(arg_deltas, 10);  // character by character with a byte tokenizer
}

TEST(OutputParser, DeepSeekCalls) {
  ByteCodec codec(TestFormat::kDeepSeek);
  auto r =
      parse(codec,
            "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read\n```json\n"
            "{\"path\": \"x.txt\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>list\n```json\n"
            "{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            nullptr);
  EXPECT_EQ(r.content, "Let me look.");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0].name, "read");
  EXPECT_EQ(json::parse(r.calls[0].arguments), json({{"path", "x.txt"}}));
  EXPECT_EQ(r.calls[1].name, "list");
  EXPECT_EQ(json::parse(r.calls[1].arguments), json::object());
}

TEST(OutputParser, SplitUtf8IsReassembled) {
  ByteCodec codec;
  auto p = OutputParser::create(codec, TurnMarkers::detect(codec), nullptr, false);
  std::string text;
  for (unsigned char c : std::string("h\xC3\xA9llo \xE2\x82\xAC")) {  // byte tokens split the characters
    ChatDelta d;
    p->push(int32_t(c), d);
    EXPECT_FALSE(json::parse(json(d.content).dump(), nullptr, false).is_discarded());
    text += d.content;
  }
  EXPECT_EQ(text, "h\xC3\xA9llo \xE2\x82\xAC");
}
