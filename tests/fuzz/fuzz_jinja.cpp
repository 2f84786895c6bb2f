// libFuzzer target: the Jinja interpreter (lexer, parser, evaluation) on arbitrary template sources, rendered
// with a chat-like context. moesrv::Error (syntax or evaluation errors, limits) is the expected failure.
#include <cstddef>
#include <cstdint>
#include <string>

#include "tokenizer/jinja/template.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json ctx = nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi <b>"},
                 {"role": "assistant", "content": "", "reasoning_content": "r",
                  "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": [1, 2.5, null]}}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>", "enable_thinking": false})");
  std::string source(reinterpret_cast<const char*>(data), size);
  try {
    moesrv::jinja::Template t(source);
    std::string out = t.render(ctx);
    (void)out;
  } catch (const moesrv::Error&) {
  }
  return 0;
}
