#include "tokenizer/jinja/parser.h"

#include "util/error.h"

namespace moesrv::jinja {
namespace {

class Parser {
 public:
  explicit Parser(const std::vector<Token>& t) : t_(t) {}

  Body parse_all() {
    Body body = parse_body({});
    if (peek().kind != Token::Eof) error("unexpected tag");
    return body;
  }

 private:
  const Token& peek(size_t k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Token& next() { return t_[std::min(i_++, t_.size() - 1)]; }
  [[noreturn]] void error(const std::string& what) const {
    fail("jinja: {} at line {} (near '{}')", what, peek().line, peek().text);
  }
  bool is_op(const char* op, size_t k = 0) const { return peek(k).kind == Token::Op && peek(k).text == op; }
  bool is_name(const char* n, size_t k = 0) const { return peek(k).kind == Token::Name && peek(k).text == n; }
  void expect_op(const char* op) {
    if (!is_op(op)) error(std::string("expected '") + op + "'");
    ++i_;
  }
  void expect_name(const char* n) {
    if (!is_name(n)) error(std::string("expected '") + n + "'");
    ++i_;
  }
  std::string name() {
    if (peek().kind != Token::Name) error("expected a name");
    return next().text;
  }
  void expect_block_end() {
    if (peek().kind != Token::BlockEnd) error("expected '%}'");
    ++i_;
  }

  static StmtPtr new_stmt(Stmt::Kind kind, int line) {
    auto s = std::make_shared<Stmt>();
    s->kind = kind;
    s->line = line;
    return s;
  }

  // Parses statements until a block tag whose keyword is in `stops` (left unconsumed).
  Body parse_body(const std::vector<std::string>& stops) {
    Body body;
    while (true) {
      const Token& tok = peek();
      if (tok.kind == Token::Eof) {
        if (!stops.empty()) error("missing '{% " + stops.back() + " %}'");
        return body;
      }
      if (tok.kind == Token::Text) {
        auto s = new_stmt(Stmt::Text, tok.line);
        s->text = tok.text;
        body.push_back(s);
        ++i_;
      } else if (tok.kind == Token::VarBegin) {
        ++i_;
        auto s = new_stmt(Stmt::Output, tok.line);
        s->expr = expression();
        if (peek().kind != Token::VarEnd) error("expected '}}'");
        ++i_;
        body.push_back(s);
      } else if (tok.kind == Token::BlockBegin) {
        const Token& kw = peek(1);
        for (const auto& stop : stops)
          if (kw.kind == Token::Name && kw.text == stop) return body;
        ++i_;
        body.push_back(statement());
      } else {
        error("unexpected token");
      }
    }
  }

  StmtPtr statement() {
    int line = peek().line;
    std::string kw = name();
    auto s = new_stmt(Stmt::Text, line);
    if (kw == "if") {
      s->kind = Stmt::If;
      s->conds.push_back(expression());
      expect_block_end();
      while (true) {
        s->bodies.push_back(parse_body({"elif", "else", "endif"}));
        ++i_;  // BlockBegin
        std::string k = name();
        if (k == "elif") {
          s->conds.push_back(expression());
          expect_block_end();
        } else if (k == "else") {
          expect_block_end();
          s->bodies.push_back(parse_body({"endif"}));
          ++i_;
          expect_name("endif");
          expect_block_end();
          break;
        } else {
          expect_block_end();
          break;
        }
      }
    } else if (kw == "for") {
      s->kind = Stmt::For;
      s->targets.push_back(name());
      while (is_op(",")) {
        ++i_;
        s->targets.push_back(name());
      }
      expect_name("in");
      s->expr = ternary_free_or();
      if (is_name("if")) {
        ++i_;
        s->cond = ternary_free_or();
      }
      if (is_name("recursive")) error("recursive loops are not supported");
      expect_block_end();
      s->bodies.push_back(parse_body({"else", "endfor"}));
      ++i_;
      if (name() == "else") {
        expect_block_end();
        s->bodies.push_back(parse_body({"endfor"}));
        ++i_;
        expect_name("endfor");
      }
      expect_block_end();
    } else if (kw == "set") {
      s->kind = Stmt::Set;
      s->targets.push_back(name());
      if (is_op(".")) {
        ++i_;
        s->targets.push_back(name());
        s->set_attribute = true;
      }
      while (is_op(",")) {
        ++i_;
        s->targets.push_back(name());
      }
      if (is_op("=")) {
        ++i_;
        s->expr = expression();
        expect_block_end();
      } else {
        expect_block_end();
        s->bodies.push_back(parse_body({"endset"}));
        ++i_;
        expect_name("endset");
        expect_block_end();
      }
    } else if (kw == "macro") {
      s->kind = Stmt::Macro;
      s->text = name();
      expect_op("(");
      while (!is_op(")")) {
        std::string p = name();
        ExprPtr def;
        if (is_op("=")) {
          ++i_;
          def = expression();
        }
        s->params.emplace_back(p, def);
        if (is_op(",")) ++i_;
      }
      ++i_;
      expect_block_end();
      s->bodies.push_back(parse_body({"endmacro"}));
      ++i_;
      expect_name("endmacro");
      expect_block_end();
    } else if (kw == "break" || kw == "continue") {
      s->kind = kw == "break" ? Stmt::Break : Stmt::Continue;
      expect_block_end();
    } else if (kw == "generation") {
      s->kind = Stmt::Passthrough;
      expect_block_end();
      s->bodies.push_back(parse_body({"endgeneration"}));
      ++i_;
      expect_name("endgeneration");
      expect_block_end();
    } else {
      --i_;
      error("unsupported statement '" + kw + "'");
    }
    return s;
  }

  ExprPtr make(Expr::Kind k, int line, std::vector<ExprPtr> args = {}, std::string nm = "") {
    auto e = std::make_shared<Expr>();
    e->kind = k;
    e->line = line;
    e->args = std::move(args);
    e->name = std::move(nm);
    return e;
  }

  // expression := or ['if' or ['else' expression]]
  ExprPtr expression() {
    ExprPtr e = or_expr();
    while (is_name("if")) {
      int line = peek().line;
      ++i_;
      ExprPtr cond = or_expr();
      ExprPtr other;
      if (is_name("else")) {
        ++i_;
        other = or_expr();
      }
      e = make(Expr::Cond, line, {e, cond, other});
    }
    return e;
  }
  // For-loop iterables stop before a trailing `if` filter.
  ExprPtr ternary_free_or() { return or_expr(); }

  ExprPtr or_expr() {
    ExprPtr e = and_expr();
    while (is_name("or")) {
      int line = next().line;
      e = make(Expr::Binary, line, {e, and_expr()}, "or");
    }
    return e;
  }
  ExprPtr and_expr() {
    ExprPtr e = not_expr();
    while (is_name("and")) {
      int line = next().line;
      e = make(Expr::Binary, line, {e, not_expr()}, "and");
    }
    return e;
  }
  ExprPtr not_expr() {
    if (is_name("not")) {
      int line = next().line;
      return make(Expr::Unary, line, {not_expr()}, "not");
    }
    return compare();
  }
  ExprPtr compare() {
    ExprPtr e = additive();
    while (true) {
      int line = peek().line;
      std::string op;
      if (peek().kind == Token::Op &&
          (peek().text == "==" || peek().text == "!=" || peek().text == "<" || peek().text == ">" ||
           peek().text == "<=" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        ++i_;
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        i_ += 2;
        op = "not in";
      } else {
        return e;
      }
      e = make(Expr::Binary, line, {e, additive()}, op);
    }
  }
  ExprPtr additive() {
    ExprPtr e = concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = next();
      e = make(Expr::Binary, t.line, {e, concat()}, t.text);
    }
    return e;
  }
  ExprPtr concat() {
    ExprPtr e = multiplicative();
    while (is_op("~")) {
      int line = next().line;
      e = make(Expr::Binary, line, {e, multiplicative()}, "~");
    }
    return e;
  }
  ExprPtr multiplicative() {
    ExprPtr e = power();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      e = make(Expr::Binary, t.line, {e, power()}, t.text);
    }
    return e;
  }
  ExprPtr power() {
    ExprPtr e = unary();
    while (is_op("**")) {
      int line = next().line;
      e = make(Expr::Binary, line, {e, unary()}, "**");
    }
    return e;
  }
  ExprPtr unary() {
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      return make(Expr::Unary, t.line, {unary()}, t.text);
    }
    return filtered(postfix(primary()));
  }
  // Filters (`|`) and tests (`is`) bind tighter than every operator except postfix access.
  ExprPtr filtered(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        int line = next().line;
        ExprPtr f = make(Expr::Filter, line, {e}, name());
        if (is_op("(")) call_args(*f);
        e = postfix(f);
      } else if (is_name("is")) {
        int line = next().line;
        ExprPtr t = make(Expr::Test, line, {e});
        if (is_name("not")) {
          ++i_;
          t->negate = true;
        }
        t->name = name();
        if (is_op("(")) {
          call_args(*t);
        } else if (peek().kind == Token::String || peek().kind == Token::Int || peek().kind == Token::Float ||
                   (peek().kind == Token::Name && !is_name("and") && !is_name("or") && !is_name("else") &&
                    !is_name("if") && !is_name("is") && !is_name("in") && !is_name("not"))) {
          t->args.push_back(postfix(primary()));  // `x is divisibleby 3`, `x is sameas none`
        }
        e = t;
      } else {
        return e;
      }
    }
  }
  void call_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().kind == Token::Name && is_op("=", 1)) {
        std::string k = name();
        ++i_;
        e.kwargs.emplace_back(k, expression());
      } else {
        e.args.push_back(expression());
      }
      if (!is_op(")")) expect_op(",");
    }
    ++i_;
  }
  ExprPtr postfix(ExprPtr e) {
    while (true) {
      int line = peek().line;
      if (is_op(".")) {
        ++i_;
        if (peek().kind == Token::Int) {
          e = make(Expr::Index, line, {e, literal(Value(int64_t(std::stoll(next().text))))});
        } else {
          e = make(Expr::Attr, line, {e}, name());
        }
      } else if (is_op("[")) {
        ++i_;
        ExprPtr parts[3];
        int n = 0;
        bool slice = false;
        while (!is_op("]")) {
          if (is_op(":")) {
            ++i_;
            slice = true;
            if (++n > 2) error("too many ':' in slice");
            continue;
          }
          parts[n] = expression();
        }
        ++i_;
        if (!slice && !parts[0]) error("empty subscript");
        e = slice ? make(Expr::Slice, line, {e, parts[0], parts[1], parts[2]}) : make(Expr::Index, line, {e, parts[0]});
      } else if (is_op("(")) {
        ExprPtr c = make(Expr::Call, line, {e});
        call_args(*c);
        e = c;
      } else {
        return e;
      }
    }
  }
  ExprPtr literal(Value v) {
    auto e = make(Expr::Literal, peek().line);
    e->value = std::move(v);
    return e;
  }
  ExprPtr primary() {
    const Token& t = peek();
    switch (t.kind) {
      case Token::String: {
        std::string s = next().text;
        while (peek().kind == Token::String) s += next().text;  // adjacent literals concatenate
        return literal(Value(s));
      }
      case Token::Int: return literal(Value(int64_t(std::stoll(next().text))));
      case Token::Float: return literal(Value(std::stod(next().text)));
      case Token::Name: {
        std::string n = next().text;
        if (n == "true" || n == "True") return literal(Value(true));
        if (n == "false" || n == "False") return literal(Value(false));
        if (n == "none" || n == "None") return literal(Value::none());
        return make(Expr::Name, t.line, {}, n);
      }
      case Token::Op: {
        int line = t.line;
        if (t.text == "(") {
          ++i_;
          if (is_op(")")) {
            ++i_;
            return make(Expr::Tuple, line);
          }
          ExprPtr e = expression();
          if (is_op(",")) {
            std::vector<ExprPtr> items{e};
            while (is_op(",")) {
              ++i_;
              if (is_op(")")) break;
              items.push_back(expression());
            }
            e = make(Expr::Tuple, line, items);
          }
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          ++i_;
          ExprPtr e = make(Expr::List, line);
          while (!is_op("]")) {
            e->args.push_back(expression());
            if (!is_op("]")) expect_op(",");
          }
          ++i_;
          return e;
        }
        if (t.text == "{") {
          ++i_;
          ExprPtr e = make(Expr::Dict, line);
          while (!is_op("}")) {
            e->args.push_back(expression());
            expect_op(":");
            e->args.push_back(expression());
            if (!is_op("}")) expect_op(",");
          }
          ++i_;
          return e;
        }
        error("unexpected operator");
      }
      default: error("unexpected token");
    }
  }

  const std::vector<Token>& t_;
  size_t i_ = 0;
};

}  // namespace

Body parse(const std::vector<Token>& tokens) { return Parser(tokens).parse_all(); }

}  // namespace moesrv::jinja
