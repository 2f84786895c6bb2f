#include "tokenizer/jinja/template.h"

#include "tokenizer/jinja/interpreter.h"
#include "tokenizer/jinja/lexer.h"
#include "tokenizer/jinja/parser.h"
#include "util/error.h"

namespace moesrv::jinja {

namespace {
// Templates come from model packages and requests: every failure inside them (a bad literal, a missing argument to
// a builtin, ...) is reported as moesrv::Error, never as a stray standard exception.
template <class F>
auto guarded(F f) {
  try {
    return f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("jinja: {}", e.what());
  }
}
}  // namespace

Template::Template(const std::string& source) : body_(guarded([&] { return parse(lex(source)); })) {}

std::string Template::render(const nlohmann::ordered_json& context) const {
  MOESRV_CHECK(context.is_object(), "jinja: render context must be an object");
  return render(Value::from_json(context).object());
}

std::string Template::render(const Object& context) const {
  return guarded([&] {
    RenderMemory memory;  // (declared first: the interpreter's values are freed while it counts)
    Interpreter in(context);
    return in.render(body_);
  });
}

}  // namespace moesrv::jinja
