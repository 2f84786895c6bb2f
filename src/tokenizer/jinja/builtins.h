// Jinja built-in filters, tests, methods of str/list/dict, and global functions.
#pragma once
#include <string>
#include <vector>

#include "tokenizer/jinja/value.h"

namespace moesrv::jinja {

class Interpreter;

// Each returns false (via `found`) when no builtin has that name.
Value apply_filter(Interpreter& in, const std::string& name, Value operand, std::vector<Value>& args, KwArgs& kwargs,
                   bool& found);
bool apply_test(Interpreter& in, const std::string& name, const Value& operand, std::vector<Value>& args,
                bool& found);
Value call_method(const Value& self, const std::string& name, std::vector<Value>& args, KwArgs& kwargs, bool& found);
// Globals every template sees: raise_exception, namespace, range, dict, strftime_now.
Object builtin_globals();

// Python-style helpers shared with the interpreter.
std::string py_strip(const std::string& s, const Value& chars, bool left, bool right);
Value py_slice(const Value& seq, const Value& start, const Value& stop, const Value& step);

}  // namespace moesrv::jinja
