// GLM chat formatter and tool-call parser tests.
// Expected prompts are hand-checked against the official GLM chat templates: the GLM-4.5 template
// rendered with @huggingface/jinja for the V45 case, and GLM-4.7 template behaviour (also matched by
// Ollama's GLM-4.7 renderer tests) for V47.
#include <gtest/gtest.h>

#include "tokenizer/glm_chat.h"
#include "tokenizer/glm_tool_parser.h"

using namespace moesrv;
using ojson = nlohmann::ordered_json;

namespace {

const char* kWeatherTool = R"([{"type": "function", "function": {"name": "get_weather", "description": "Get weather",
  "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
  "required": ["city"]}}}])";

const std::string kToolsJsonLine =
    R"({"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}})";
const std::string kToolsHeader =
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" +
    kToolsJsonLine +
    "\n</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n";

ChatRequest tool_conversation() {
  ChatRequest r;
  r.tools = ojson::parse(kWeatherTool);
  r.messages = ojson::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Need tool.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"t\":21}"},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"t\":22}"},
    {"role": "assistant", "content": "21C.", "reasoning_content": "Got it."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "<think>\nok\n</think>\nYou're welcome."}
  ])");
  return r;
}

std::string collect(const std::vector<GlmParseEvent>& evs, GlmParseEvent::Kind kind) {
  std::string s;
  for (const auto& e : evs)
    if (e.kind == kind) s += e.text;
  return s;
}

struct Parsed {
  std::string reasoning, content;
  std::vector<GlmToolCall> calls;
};

Parsed parse_all(GlmToolCallParser& p, const std::vector<std::string>& pieces) {
  Parsed r;
  auto take = [&](const std::vector<GlmParseEvent>& evs) {
    r.reasoning += collect(evs, GlmParseEvent::Reasoning);
    r.content += collect(evs, GlmParseEvent::Content);
    for (const auto& e : evs)
      if (e.kind == GlmParseEvent::ToolCall) r.calls.push_back(e.call);
  };
  for (const auto& piece : pieces) take(p.feed(piece));
  take(p.finish());
  return r;
}

}  // namespace

TEST(GlmChat, V45MatchesOfficialTemplate) {
  ChatRequest r = tool_conversation();
  std::string expected = "[gMASK]<sop>" + kToolsHeader +
                         "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
                         "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
                         "<|system|>\nBe brief.<|user|>\nWeather?<|assistant|>\n<think></think>\nChecking."
                         "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                         "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
                         "<|observation|>\n<tool_response>\n{\"t\":21}\n</tool_response>\n<tool_response>\n{\"t\":22}\n</tool_response>"
                         "<|assistant|>\n<think></think>\n21C.<|user|>\nThanks<|assistant|>\n<think>ok</think>\nYou're welcome."
                         "<|assistant|>";
  EXPECT_EQ(format_glm_chat(r, {GlmStyle::V45}), expected);

  r.kwargs["enable_thinking"] = false;
  std::string no_think = expected;
  no_think.replace(no_think.find("Weather?"), 8, "Weather?/nothink");
  no_think.replace(no_think.find("Thanks"), 6, "Thanks/nothink");
  no_think += "\n<think></think>";
  EXPECT_EQ(format_glm_chat(r, {GlmStyle::V45}), no_think);
}

TEST(GlmChat, V47Layout) {
  ChatRequest r = tool_conversation();
  std::string expected = "[gMASK]<sop>" + kToolsHeader +
                         "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
                         "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
                         "<|system|>Be brief.<|user|>Weather?<|assistant|></think>Checking."
                         "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
                         "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
                         "<|observation|><tool_response>{\"t\":21}</tool_response><tool_response>{\"t\":22}</tool_response>"
                         "<|assistant|></think>21C.<|user|>Thanks<|assistant|><think>ok</think>You're welcome."
                         "<|assistant|><think>";
  EXPECT_EQ(format_glm_chat(r), expected);

  // clear_thinking=false keeps reasoning of earlier turns; enable_thinking=false closes the think block.
  r.kwargs = {{"clear_thinking", false}, {"enable_thinking", false}};
  std::string kept = expected;
  kept.replace(kept.find("</think>Checking."), 17, "<think>Need tool.</think>Checking.");
  kept.replace(kept.find("</think>21C."), 12, "<think>Got it.</think>21C.");
  kept.replace(kept.size() - 7, 7, "</think>");
  EXPECT_EQ(format_glm_chat(r), kept);
}

TEST(GlmChat, SimpleTurns) {
  ChatRequest r;
  r.messages = ojson::parse(R"([{"role": "user", "content": "Hello"}])");
  EXPECT_EQ(format_glm_chat(r), "[gMASK]<sop><|user|>Hello<|assistant|><think>");
  r.messages = ojson::parse(R"([{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "How are you?"}])");
  EXPECT_EQ(format_glm_chat(r), "[gMASK]<sop><|user|>Hi<|assistant|></think>Hello there<|user|>How are you?<|assistant|><think>");
  r.add_generation_prompt = false;
  EXPECT_EQ(format_glm_chat(r, {GlmStyle::V45}),
            "[gMASK]<sop><|user|>\nHi<|assistant|>\n<think></think>\nHello there<|user|>\nHow are you?");
}

TEST(GlmToolParser, ReasoningContentAndTypedToolCall) {
  GlmToolCallParser p(nlohmann::json::parse(kWeatherTool));
  Parsed r = parse_all(p, {"Let me check the weather.</think>Sure.<tool_call>get_weather<arg_key>city</arg_key>"
                           "<arg_value>123</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"});
  EXPECT_EQ(r.reasoning, "Let me check the weather.");
  EXPECT_EQ(r.content, "Sure.");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "get_weather");
  EXPECT_EQ(r.calls[0].arguments, R"({"city":"123","days":3})");  // city is a string per schema
}

TEST(GlmToolParser, BooleanAndObjectArguments) {
  auto tools = nlohmann::json::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
    "properties": {"flag": {"type": "boolean"}, "cfg": {"type": "object"}, "s": {"type": ["string"]}}}}}])");
  GlmToolCallParser p(tools, false);
  Parsed r = parse_all(p, {"<tool_call>f<arg_key>flag</arg_key><arg_value>True</arg_value><arg_key>cfg</arg_key>"
                           "<arg_value> {\"k\": 1.5} </arg_value><arg_key>s</arg_key><arg_value>true</arg_value></tool_call>"});
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments, R"({"flag":true,"cfg":{"k":1.5},"s":"true"})");
}

TEST(GlmToolParser, TagsSplitAcrossPiecesAtEveryPosition) {
  std::string text =
      "Thinking hard.</think>\n\nAnswer part.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
      "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n<tool_call>unknown_tool<arg_key>opts</arg_key>"
      "<arg_value>{\"a\": [1, true]}</arg_value><arg_key>note</arg_key><arg_value>free text</arg_value></tool_call>";
  for (size_t chunk = 1; chunk <= 7; ++chunk) {
    std::vector<std::string> pieces;
    for (size_t i = 0; i < text.size(); i += chunk) pieces.push_back(text.substr(i, chunk));
    GlmToolCallParser p(nlohmann::json::parse(kWeatherTool));
    Parsed r = parse_all(p, pieces);
    EXPECT_EQ(r.reasoning, "Thinking hard.") << chunk;
    EXPECT_EQ(r.content, "Answer part.") << chunk;
    ASSERT_EQ(r.calls.size(), 2u) << chunk;
    EXPECT_EQ(r.calls[0].arguments, R"({"city":"New York","days":2})");
    EXPECT_EQ(r.calls[1].name, "unknown_tool");
    EXPECT_EQ(r.calls[1].arguments, R"({"opts":{"a":[1,true]},"note":"free text"})");
  }
}

TEST(GlmToolParser, ContentModeAndPartialTagsAtEnd) {
  GlmToolCallParser p(nullptr, /*in_reasoning=*/false);
  auto ev = p.feed("a < b and x <thi");
  EXPECT_EQ(collect(ev, GlmParseEvent::Content), "a < b and x");  // "<thi" held back (may be <think>)
  ev = p.feed("nk>");
  EXPECT_EQ(collect(ev, GlmParseEvent::Content), "");
  ev = p.feed("hmm</think>done <tool");
  EXPECT_EQ(collect(ev, GlmParseEvent::Reasoning), "hmm");
  EXPECT_EQ(collect(ev, GlmParseEvent::Content), "done");
  ev = p.finish();
  EXPECT_EQ(collect(ev, GlmParseEvent::Content), " <tool");  // not a tag after all
}

TEST(GlmToolParser, UnterminatedToolCallBecomesContent) {
  GlmToolCallParser p(nullptr, false);
  Parsed r = parse_all(p, {"x<tool_call>f<arg_key>a</arg_key>"});
  EXPECT_TRUE(r.calls.empty());
  EXPECT_EQ(r.content, "x<tool_call>f<arg_key>a</arg_key>");
}
