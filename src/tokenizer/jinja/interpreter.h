// Tree-walking Jinja interpreter (the subset chat templates use).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tokenizer/jinja/ast.h"

namespace moesrv::jinja {

// A render that runs longer than this fails (a template looping over large values); real chat templates render a
// 4,000-message transcript in about 30 ms.
constexpr double kMaxRenderSeconds = 5.0;

class Interpreter {
 public:
  explicit Interpreter(const Object& globals);
  ~Interpreter();  // empties the containers of note_mutation (reference cycles such as `set ns.x = ns`)
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;
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

  // A container that was given a container value in this render (attribute set, update, append, extend): it may
  // now hold a reference cycle, which shared ownership never frees, so the destructor empties it.
  void note_mutation(const Value& container, const Value& value);
  // Counts one evaluation, statement or loop iteration; compares the clock with the render's deadline every
  // stride_ of them. The stride doubles up to 1,024 while the intervals stay under a millisecond and drops to 1
  // after a longer one (evaluations that each sort or scan a large value).
  void tick();

  std::chrono::steady_clock::time_point deadline_, last_check_;
  uint32_t ticks_ = 0, stride_ = 1;

  std::vector<std::unordered_map<std::string, Value>> scopes_;
  int depth_ = 0;
  std::vector<Value> mutated_;
  std::unordered_set<const void*> mutated_seen_;
};

}  // namespace moesrv::jinja
