#include "tokenizer/jinja/template.h"

#include "tokenizer/jinja/interpreter.h"
#include "tokenizer/jinja/lexer.h"
#include "tokenizer/jinja/parser.h"
#include "util/error.h"

namespace moesrv::jinja {

Template::Template(const std::string& source) : body_(parse(lex(source))) {}

std::string Template::render(const nlohmann::ordered_json& context) const {
  MOESRV_CHECK(context.is_object(), "jinja: render context must be an object");
  return render(Value::from_json(context).object());
}

std::string Template::render(const Object& context) const {
  Interpreter in(context);
  return in.render(body_);
}

}  // namespace moesrv::jinja
