// A parsed Jinja template, rendered with a context object.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "tokenizer/jinja/ast.h"

namespace moesrv::jinja {

class Template {
 public:
  explicit Template(const std::string& source);  // throws moesrv::Error on syntax errors
  // `context` must be a JSON object; its members become template variables.
  std::string render(const nlohmann::ordered_json& context) const;
  std::string render(const Object& context) const;

 private:
  Body body_;
};

}  // namespace moesrv::jinja
