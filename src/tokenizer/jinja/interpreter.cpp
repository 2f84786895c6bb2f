#include "tokenizer/jinja/interpreter.h"

#include <algorithm>
#include <cmath>

#include "tokenizer/jinja/builtins.h"
#include "util/error.h"

namespace moesrv::jinja {
namespace {

constexpr int kMaxDepth = 200;

[[noreturn]] void runtime_error(const Expr& e, const std::string& what) {
  fail("jinja: {} (line {})", what, e.line);
}

Value arith(const Expr& e, const std::string& op, const Value& a, const Value& b) {
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      check_size(a.str().size() + b.str().size(), kMaxStringBytes, "a string of bytes");
      return Value(a.str() + b.str());
    }
    if (a.is_array() && b.is_array()) {
      Array r = a.array();
      r.insert(r.end(), b.array().begin(), b.array().end());
      return Value(std::move(r));
    }
  }
  if (op == "*" && a.is_string() && b.is_int()) {
    if (b.as_int() > 0)
      check_size(size_t(b.as_int()) * std::max<size_t>(a.str().size(), 1), kMaxStringBytes,
                 "a repeated string of bytes");
    // Doubling copies: a 64 MiB string of one repeated byte takes 26 copies, not 64 million appends.
    size_t total = b.as_int() > 0 ? size_t(b.as_int()) * a.str().size() : 0;
    std::string r;
    r.reserve(total);
    if (total > 0) r = a.str();
    while (r.size() < total) r.append(r, 0, std::min(r.size(), total - r.size()));
    return Value(std::move(r));
  }
  bool nums = (a.is_number() || a.is_bool()) && (b.is_number() || b.is_bool());
  if (!nums) runtime_error(e, "unsupported operands for '" + op + "': " + a.type_name() + " and " + b.type_name());
  bool ints = !(a.type() == Value::Type::Float || b.type() == Value::Type::Float);
  if (op == "/") {
    if (b.as_double() == 0) runtime_error(e, "division by zero");
    return Value(a.as_double() / b.as_double());
  }
  if (ints) {
    int64_t x = a.as_int(), y = b.as_int();
    if (op == "+") return Value(x + y);
    if (op == "-") return Value(x - y);
    if (op == "*") return Value(x * y);
    if (op == "**") return y >= 0 ? Value(int64_t(std::llround(std::pow(double(x), double(y))))) : Value(std::pow(double(x), double(y)));
    if (y == 0) runtime_error(e, "division by zero");
    int64_t q = x / y, r = x % y;
    if (r != 0 && ((r < 0) != (y < 0))) {
      --q;
      r += y;
    }
    return op == "//" ? Value(q) : Value(r);
  }
  double x = a.as_double(), y = b.as_double();
  if (op == "+") return Value(x + y);
  if (op == "-") return Value(x - y);
  if (op == "*") return Value(x * y);
  if (op == "**") return Value(std::pow(x, y));
  if (y == 0) runtime_error(e, "division by zero");
  if (op == "//") return Value(std::floor(x / y));
  return Value(x - y * std::floor(x / y));
}

bool contains(const Value& hay, const Value& needle) {
  if (hay.is_string()) return needle.is_string() && hay.str().find(needle.str()) != std::string::npos;
  if (hay.is_array()) {
    for (const auto& v : hay.array())
      if (v == needle) return true;
    return false;
  }
  if (hay.is_object()) return needle.is_string() && hay.object().find(needle.str()) != nullptr;
  return false;
}

}  // namespace

Interpreter::Interpreter(const Object& globals)
    : deadline_(std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                       std::chrono::duration<double>(kMaxRenderSeconds))),
      last_check_(std::chrono::steady_clock::now()) {
  scopes_.emplace_back();
  for (auto& [k, v] : builtin_globals().items) scopes_.back()[k] = v;
  for (const auto& [k, v] : globals.items) scopes_.back()[k] = v;
  scopes_.emplace_back();  // template-level variables
}

Interpreter::~Interpreter() {
  for (Value& c : mutated_) {
    if (c.is_object()) c.object().items.clear();
    else if (c.is_array()) c.array().clear();
  }
}

void Interpreter::note_mutation(const Value& container, const Value& value) {
  if (!value.is_object() && !value.is_array()) return;
  const void* key = container.is_object()  ? static_cast<const void*>(&container.object())
                    : container.is_array() ? static_cast<const void*>(&container.array())
                                           : nullptr;
  if (key && mutated_seen_.insert(key).second) mutated_.push_back(container);
}

void Interpreter::tick() {
  if (++ticks_ < stride_) return;
  ticks_ = 0;
  const auto now = std::chrono::steady_clock::now();
  if (now > deadline_) fail("jinja: the template ran longer than {} s", kMaxRenderSeconds);
  stride_ = now - last_check_ > std::chrono::milliseconds(1) ? 1 : std::min<uint32_t>(stride_ * 2, 1024);
  last_check_ = now;
}

std::string Interpreter::render(const Body& body) {
  std::string out;
  exec(body, out);
  return out;
}

Value Interpreter::lookup(const std::string& name) const {
  for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it)
    if (auto f = it->find(name); f != it->end()) return f->second;
  return Value();
}

Interpreter::Flow Interpreter::exec(const Body& body, std::string& out) {
  for (const auto& sp : body) {
    const Stmt& s = *sp;
    tick();
    switch (s.kind) {
      case Stmt::Text:
      case Stmt::Output:
        out += s.kind == Stmt::Text ? s.text : eval(*s.expr).to_str();
        check_size(out.size(), kMaxStringBytes, "output of bytes");
        break;
      case Stmt::If: {
        size_t i = 0;
        for (; i < s.conds.size(); ++i)
          if (eval(*s.conds[i]).truthy()) break;
        if (i < s.bodies.size()) {
          Flow f = exec(s.bodies[i], out);
          if (f != Flow::Normal) return f;
        }
        break;
      }
      case Stmt::For: {
        Flow f = exec_for(s, out);
        if (f != Flow::Normal) return f;
        break;
      }
      case Stmt::Set: exec_set(s); break;
      case Stmt::Macro: assign(s.text, define_macro(s)); break;
      case Stmt::Break: return Flow::Break;
      case Stmt::Continue: return Flow::Continue;
      case Stmt::Passthrough: {
        Flow f = exec(s.bodies[0], out);
        if (f != Flow::Normal) return f;
        break;
      }
    }
  }
  return Flow::Normal;
}

Interpreter::Flow Interpreter::exec_for(const Stmt& s, std::string& out) {
  Value iterable = eval(*s.expr);
  Array items;
  if (iterable.is_object() && s.targets.size() == 1) {
    items = iterable.iterate();  // keys
  } else {
    items = iterable.iterate();
  }
  auto bind = [&](const Value& item) {
    if (s.targets.size() == 1) {
      assign(s.targets[0], item);
      return;
    }
    if (!item.is_array() || item.array().size() != s.targets.size())
      fail("jinja: cannot unpack {} into {} loop variables (line {})", item.type_name(), s.targets.size(), s.line);
    for (size_t k = 0; k < s.targets.size(); ++k) assign(s.targets[k], item.array()[k]);
  };
  if (s.cond) {  // `for x in xs if cond`: filter first, so loop.* counts only kept items
    Array kept;
    scopes_.emplace_back();
    for (const auto& item : items) {
      tick();
      bind(item);
      if (eval(*s.cond).truthy()) kept.push_back(item);
    }
    scopes_.pop_back();
    items = std::move(kept);
  }
  if (items.empty()) {
    if (s.bodies.size() > 1) return exec(s.bodies[1], out);
    return Flow::Normal;
  }
  int64_t n = int64_t(items.size());
  for (int64_t i = 0; i < n; ++i) {
    tick();
    scopes_.emplace_back();
    Object loop;
    loop.set("index0", Value(i));
    loop.set("index", Value(i + 1));
    loop.set("revindex0", Value(n - i - 1));
    loop.set("revindex", Value(n - i));
    loop.set("first", Value(i == 0));
    loop.set("last", Value(i == n - 1));
    loop.set("length", Value(n));
    loop.set("previtem", i > 0 ? items[i - 1] : Value());
    loop.set("nextitem", i + 1 < n ? items[i + 1] : Value());
    loop.set("cycle", Value(Function([i](std::vector<Value>& args, KwArgs&) {
      return args.empty() ? Value() : args[size_t(i) % args.size()];
    })));
    assign("loop", Value(std::move(loop)));
    bind(items[i]);
    Flow f = exec(s.bodies[0], out);
    scopes_.pop_back();
    if (f == Flow::Break) break;
  }
  return Flow::Normal;
}

void Interpreter::exec_set(const Stmt& s) {
  Value v;
  if (s.expr) {
    v = eval(*s.expr);
  } else {
    std::string body;
    exec(s.bodies[0], body);
    v = Value(body);
  }
  if (s.set_attribute) {
    Value target = lookup(s.targets[0]);
    if (!target.is_object()) fail("jinja: cannot set attribute on '{}' (line {})", target.type_name(), s.line);
    note_mutation(target, v);
    target.object().set(s.targets[1], std::move(v));
    return;
  }
  if (s.targets.size() == 1) {
    assign(s.targets[0], std::move(v));
    return;
  }
  if (!v.is_array() || v.array().size() != s.targets.size())
    fail("jinja: cannot unpack into {} names (line {})", s.targets.size(), s.line);
  for (size_t k = 0; k < s.targets.size(); ++k) assign(s.targets[k], v.array()[k]);
}

Value Interpreter::define_macro(const Stmt& s) {
  const Stmt* macro = &s;
  return Value(Function([this, macro](std::vector<Value>& args, KwArgs& kwargs) {
    scopes_.emplace_back();
    for (size_t k = 0; k < macro->params.size(); ++k) {
      const auto& [pname, def] = macro->params[k];
      Value v;
      if (k < args.size()) v = args[k];
      else if (def) v = eval(*def);
      for (auto& [kn, kv] : kwargs)
        if (kn == pname) v = kv;
      assign(pname, v);
    }
    Array varargs(args.size() > macro->params.size() ? args.begin() + macro->params.size() : args.end(), args.end());
    assign("varargs", Value(std::move(varargs)));
    std::string out;
    exec(macro->bodies[0], out);
    scopes_.pop_back();
    return Value(out);
  }));
}

void Interpreter::eval_args(const Expr& e, size_t first, std::vector<Value>& args, KwArgs& kwargs) {
  for (size_t k = first; k < e.args.size(); ++k) args.push_back(eval(*e.args[k]));
  for (const auto& [n, ex] : e.kwargs) kwargs.emplace_back(n, eval(*ex));
}

Value Interpreter::call(const Value& fn, std::vector<Value>& args, KwArgs& kwargs) {
  if (!fn.is_function()) fail("jinja: '{}' is not callable", fn.type_name());
  if (++depth_ > kMaxDepth) fail("jinja: recursion too deep");
  Value r = fn.function()(args, kwargs);
  --depth_;
  return r;
}

bool Interpreter::test(const std::string& name, const Value& operand, std::vector<Value>& args) {
  bool found = false;
  bool r = apply_test(*this, name, operand, args, found);
  if (!found) fail("jinja: unknown test '{}'", name);
  return r;
}

Value Interpreter::filter(const std::string& name, const Value& operand, std::vector<Value>& args, KwArgs& kwargs) {
  bool found = false;
  Value r = apply_filter(*this, name, operand, args, kwargs, found);
  if (found) return r;
  Value macro = lookup(name);  // not Jinja, but harmless: lets templates use macros as filters
  if (macro.is_function()) {
    std::vector<Value> all{operand};
    all.insert(all.end(), args.begin(), args.end());
    return call(macro, all, kwargs);
  }
  fail("jinja: unknown filter '{}'", name);
}

Value Interpreter::binary(const Expr& e) {
  const std::string& op = e.name;
  if (op == "and") {
    Value a = eval(*e.args[0]);
    return a.truthy() ? eval(*e.args[1]) : a;
  }
  if (op == "or") {
    Value a = eval(*e.args[0]);
    return a.truthy() ? a : eval(*e.args[1]);
  }
  Value a = eval(*e.args[0]), b = eval(*e.args[1]);
  if (op == "==") return Value(a == b);
  if (op == "!=") return Value(a != b);
  if (op == "<") return Value(Value::compare(a, b) < 0);
  if (op == ">") return Value(Value::compare(a, b) > 0);
  if (op == "<=") return Value(Value::compare(a, b) <= 0);
  if (op == ">=") return Value(Value::compare(a, b) >= 0);
  if (op == "in") return Value(contains(b, a));
  if (op == "not in") return Value(!contains(b, a));
  if (op == "~") {
    std::string r = a.to_str() + b.to_str();
    check_size(r.size(), kMaxStringBytes, "a string of bytes");
    return Value(std::move(r));
  }
  return arith(e, op, a, b);
}

Value Interpreter::eval(const Expr& e) {
  tick();
  switch (e.kind) {
    case Expr::Literal: return e.value;
    case Expr::Name: return lookup(e.name);
    case Expr::List:
    case Expr::Tuple: {
      Array a;
      for (const auto& x : e.args) a.push_back(eval(*x));
      return Value(std::move(a));
    }
    case Expr::Dict: {
      Object o;
      for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
        Value key = eval(*e.args[k]);
        o.set(key.to_str(), eval(*e.args[k + 1]));
      }
      return Value(std::move(o));
    }
    case Expr::Attr: return eval(*e.args[0]).get(e.name);
    case Expr::Index: return eval(*e.args[0]).get(eval(*e.args[1]));
    case Expr::Slice: {
      auto part = [&](int k) { return e.args[k] ? eval(*e.args[k]) : Value::none(); };
      return py_slice(eval(*e.args[0]), part(1), part(2), part(3));
    }
    case Expr::Call: {
      std::vector<Value> args;
      KwArgs kwargs;
      const Expr& callee = *e.args[0];
      if (callee.kind == Expr::Attr) {  // method call: obj.method(...)
        Value self = eval(*callee.args[0]);
        Value member = self.get(callee.name);
        eval_args(e, 1, args, kwargs);
        if (member.is_function()) return call(member, args, kwargs);
        bool found = false;
        for (const Value& a : args) note_mutation(self, a);  // (update, append, extend: a may now be inside self)
        Value r = call_method(self, callee.name, args, kwargs, found);
        if (!found) runtime_error(e, "'" + self.type_name() + "' has no method '" + callee.name + "'");
        return r;
      }
      Value fn = eval(callee);
      eval_args(e, 1, args, kwargs);
      if (!fn.is_function())
        runtime_error(e, callee.kind == Expr::Name ? "'" + callee.name + "' is undefined or not callable"
                                                   : "value is not callable");
      return call(fn, args, kwargs);
    }
    case Expr::Filter: {
      std::vector<Value> args;
      KwArgs kwargs;
      Value operand = eval(*e.args[0]);
      eval_args(e, 1, args, kwargs);
      return filter(e.name, operand, args, kwargs);
    }
    case Expr::Test: {
      std::vector<Value> args;
      KwArgs kwargs;
      Value operand = eval(*e.args[0]);
      eval_args(e, 1, args, kwargs);
      return Value(test(e.name, operand, args) != e.negate);
    }
    case Expr::Unary: {
      Value v = eval(*e.args[0]);
      if (e.name == "not") return Value(!v.truthy());
      if (!v.is_number()) runtime_error(e, "bad operand for unary " + e.name);
      if (e.name == "+") return v;
      return v.is_int() ? Value(-v.as_int()) : Value(-v.as_double());
    }
    case Expr::Binary: return binary(e);
    case Expr::Cond: {
      if (eval(*e.args[1]).truthy()) return eval(*e.args[0]);
      return e.args[2] ? eval(*e.args[2]) : Value();
    }
  }
  return Value();
}

}  // namespace moesrv::jinja
