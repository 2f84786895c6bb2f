// libFuzzer target: OpenAI request parsing (chat and completions bodies, tools and response_format schemas),
// then the schema matchers fed with the input's text. Any exception other than ApiError is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "server/api_error.h"
#include "server/chat_request.h"
#include "server/json_schema.h"

using namespace moesrv;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  auto body = nlohmann::ordered_json::parse(text, nullptr, false);
  if (body.is_discarded()) return 0;
  try {
    ChatCompletionRequest r = parse_chat_request(body);
    // Each compiled schema must accept its own example-free probing without crashing.
    for (auto& t : r.tool_specs) {
      JsonMatcher m(t.schema.get(), t.schema->root());
      for (char c : text)
        if (!m.feed(c)) break;
      (void)m.complete();
    }
    if (r.response_schema) {
      JsonMatcher m(r.response_schema.get(), r.response_schema->root());
      for (char c : text)
        if (!m.feed(c)) break;
    }
  } catch (const ApiError&) {
  }
  try {
    parse_completion_request(body);
  } catch (const ApiError&) {
  }
  // A body that is a schema: compile it and match its own text.
  try {
    auto s = JsonSchema::compile(nlohmann::json::parse(text));
    JsonMatcher m(s.get(), s->root());
    for (char c : text)
      if (!m.feed(c)) break;
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
