// libFuzzer target: the tool-call output parsers (GLM, Qwen3, DeepSeek-V3) and the turn grammar on arbitrary
// model output. The first byte picks the format and the rules; the rest is text whose special-token spellings
// become marker tokens. Checks: parsers never crash and emit valid UTF-8; the grammar's mask agrees with
// advance() on every token along the path.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "server/output_parser.h"
#include "server/turn_grammar.h"
#include "server_test_doubles.h"

using namespace moesrv;
using moesrv::testing::ByteCodec;
using moesrv::testing::TestFormat;

namespace {
const char* kTools = R"([
  {"type":"function","function":{"name":"read","parameters":{"type":"object","properties":{"path":{"type":"string","maxLength":8}},"required":["path"]}}},
  {"type":"function","function":{"name":"set","parameters":{"type":"object","properties":{"n":{"type":"integer"},
    "mode":{"enum":["a","b"]},"o":{"type":"object","properties":{"x":{"type":["boolean","null"]}}},"l":{"type":"array","items":{"type":"number"}}},"required":["n"]}}}])";
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const ByteCodec codecs[3] = {ByteCodec(TestFormat::kGlm), ByteCodec(TestFormat::kQwen3),
                                      ByteCodec(TestFormat::kDeepSeek)};
  static const VocabText vocabs[3] = {VocabText(codecs[0]), VocabText(codecs[1]), VocabText(codecs[2])};
  static const std::vector<ToolSpec> tools = parse_tools(nlohmann::ordered_json::parse(kTools));
  uint8_t sel = data[0];
  const ByteCodec& codec = codecs[sel % 3];
  const VocabText& vocab = vocabs[sel % 3];
  TurnMarkers markers = TurnMarkers::detect(codec);
  std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  std::vector<int32_t> ids = codec.encode(text);

  bool in_reasoning = sel & 8;
  auto parser = OutputParser::create(codec, markers, &tools, in_reasoning);
  for (int32_t t : ids) {
    ChatDelta d;
    parser->push(t, d);
    for (auto* s : {&d.content, &d.reasoning})
      if (nlohmann::json::parse(nlohmann::json(*s).dump(), nullptr, false).is_discarded()) abort();
  }
  ChatDelta d;
  parser->finish(d);

  TurnRules rules;
  rules.calls_allowed = sel & 16;
  rules.call_required = rules.calls_allowed && (sel & 32);
  rules.strict_calls = sel & 64;
  rules.max_calls = (sel & 128) ? 1 : 0;
  rules.start_in_reasoning = in_reasoning;
  if ((sel & 4) && !rules.calls_allowed) rules.content_schema = JsonSchema::any_object();
  TurnGrammar g(markers, tools, rules, vocab);
  auto s = g.initial();
  std::vector<uint8_t> mask;
  for (size_t i = 0; i < ids.size() && i < 64; ++i) {
    g.mask(s, mask);
    auto copy = s;
    bool ok = g.advance(copy, ids[i]);
    if (ok != bool(mask[size_t(ids[i])])) abort();  // the mask and the automaton disagree
    if (!ok) break;
    s = copy;
  }
  return 0;
}
