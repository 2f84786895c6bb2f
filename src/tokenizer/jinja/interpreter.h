// Tree-walking Jinja interpreter (the subset chat templates use).
#pragma once
#include <string>
#include <unordered_map>
#include <vector>

#include "tokenizer/jinja/ast.h"

namespace moesrv::jinja {

class Interpreter {
 public:
  explicit Interpreter(const Object& globals);
  std::string render(const Body& body);

  Value eval(const Expr& e);
  // Calls a callable value (functions, macros).
  Value call(const Value& fn, std::vector<Value>& args, KwArgs& kwargs);
  // Evaluates `operand is name(args)`; public for filters like selectattr.
  bool test(const std::string& name, const Value& operand, std::vector<Value>& args);
  Value filter(const std::string& name, const Value& operand, std::vector<Value>& args, KwArgs& kwargs);

 private:
  enum class Flow { Normal, Break, Continue };
  Flow exec(const Body& body, std::string& out);
  Flow exec_for(const Stmt& s, std::string& out);
  void exec_set(const Stmt& s);
  Value define_macro(const Stmt& s);
  Value binary(const Expr& e);
  Value lookup(const std::string& name) const;
  void assign(const std::string& name, Value v) { scopes_.back()[name] = std::move(v); }
  void eval_args(const Expr& e, size_t first, std::vector<Value>& args, KwArgs& kwargs);

  std::vector<std::unordered_map<std::string, Value>> scopes_;
  int depth_ = 0;
};

}  // namespace moesrv::jinja
