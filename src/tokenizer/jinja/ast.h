// Jinja syntax tree.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/jinja/value.h"

namespace moesrv::jinja {

struct Expr;
using ExprPtr = std::shared_ptr<Expr>;

struct Expr {
  enum Kind {
    Literal,   // value
    Name,      // name
    List,      // args
    Tuple,     // args
    Dict,      // args: key0, value0, key1, value1, ...
    Attr,      // args[0].name
    Index,     // args[0][args[1]]
    Slice,     // args[0][args[1]:args[2]:args[3]] (null parts allowed)
    Call,      // args[0](args[1..], kwargs)
    Filter,    // args[0] | name(args[1..], kwargs)
    Test,      // args[0] is [not] name(args[1..])
    Unary,     // name in {"not", "-", "+"}; args[0]
    Binary,    // args[0] name args[1]; name is the operator ("and", "or", "in", "not in", "==", "~", ...)
    Cond,      // args[0] if args[1] else args[2] (args[2] may be null)
  };
  Kind kind;
  int line = 0;
  std::string name;
  Value value;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  bool negate = false;
};

struct Stmt;
using StmtPtr = std::shared_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  enum Kind {
    Text,      // text
    Output,    // expr
    If,        // conds[i] -> bodies[i]; bodies.back() is the else body when bodies.size() > conds.size()
    For,       // targets in expr [if cond]: bodies[0]; else: bodies[1]
    Set,       // targets[0] (targets[1] = attribute, or several names for tuple unpacking) = expr, or block body
    Macro,     // name(params = defaults): bodies[0]
    Break,
    Continue,
    Passthrough,  // {% generation %} etc.: renders bodies[0]
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr, cond;
  std::vector<ExprPtr> conds;
  std::vector<Body> bodies;
  std::vector<std::string> targets;
  bool set_attribute = false;
  std::vector<std::pair<std::string, ExprPtr>> params;  // macro parameters with optional defaults
};

}  // namespace moesrv::jinja
