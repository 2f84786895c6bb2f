#include "tokenizer/jinja/lexer.h"

#include <cctype>

#include "tokenizer/utf8.h"
#include "util/error.h"

namespace moesrv::jinja {
namespace {

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

class Lexer {
 public:
  explicit Lexer(const std::string& src) : s_(src) {}

  std::vector<Token> run() {
    if (!s_.empty() && s_.back() == '\n') s_.pop_back();  // keep_trailing_newline=False
    if (!s_.empty() && s_.back() == '\r') s_.pop_back();
    std::string text;
    bool strip_next_text = false;
    while (pos_ < s_.size()) {
      size_t open = s_.find('{', pos_);
      while (open != std::string::npos && open + 1 < s_.size() && s_[open + 1] != '{' && s_[open + 1] != '%' &&
             s_[open + 1] != '#')
        open = s_.find('{', open + 1);
      if (open == std::string::npos || open + 1 >= s_.size()) {
        text += s_.substr(pos_);
        pos_ = s_.size();
        break;
      }
      text += s_.substr(pos_, open - pos_);
      count_lines(pos_, open);
      char kind = s_[open + 1];
      size_t p = open + 2;
      char modifier = p < s_.size() ? s_[p] : 0;
      if (modifier == '-' || modifier == '+') ++p;
      // Whitespace control on the text before the tag.
      if (modifier == '-') {
        while (!text.empty() && is_ws(text.back())) text.pop_back();
      } else if (modifier != '+' && kind != '{') {
        lstrip_block(text, open);
      }
      if (strip_next_text) {
        size_t k = 0;
        while (k < text.size() && is_ws(text[k])) ++k;
        text.erase(0, k);
      }
      flush_text(text, strip_next_text);
      strip_next_text = false;
      pos_ = p;
      if (kind == '#') {
        size_t close = s_.find("#}", pos_);
        if (close == std::string::npos) fail("jinja: unclosed comment at line {}", line_);
        bool minus = close > pos_ && s_[close - 1] == '-';
        count_lines(pos_, close);
        pos_ = close + 2;
        if (minus) strip_next_text = true;
        else trim_block_newline();
        continue;
      }
      if (kind == '%' && raw_block()) continue;
      out_.push_back({kind == '{' ? Token::VarBegin : Token::BlockBegin, "", line_});
      bool minus = lex_expression(kind == '{' ? '}' : '%');
      out_.push_back({kind == '{' ? Token::VarEnd : Token::BlockEnd, "", line_});
      if (minus) strip_next_text = true;
      else if (kind == '%') trim_block_newline();
    }
    if (strip_next_text) {
      size_t k = 0;
      while (k < text.size() && is_ws(text[k])) ++k;
      text.erase(0, k);
    }
    flush_text(text, strip_next_text);
    out_.push_back({Token::Eof, "", line_});
    return std::move(out_);
  }

 private:
  void count_lines(size_t a, size_t b) {
    for (size_t i = a; i < b && i < s_.size(); ++i) line_ += s_[i] == '\n';
  }
  void flush_text(std::string& text, bool) {
    if (!text.empty()) out_.push_back({Token::Text, text, line_});
    text.clear();
  }
  // lstrip_blocks: drop spaces/tabs between the line start (in the source) and a block tag.
  void lstrip_block(std::string& text, size_t open) {
    size_t k = open;
    while (k > 0 && (s_[k - 1] == ' ' || s_[k - 1] == '\t')) --k;
    if (k != 0 && s_[k - 1] != '\n') return;
    size_t n = open - k;
    while (n > 0 && !text.empty() && (text.back() == ' ' || text.back() == '\t')) {
      text.pop_back();
      --n;
    }
  }
  // trim_blocks: drop the first newline after a block tag.
  void trim_block_newline() {
    if (pos_ < s_.size() && s_[pos_] == '\n') {
      ++pos_;
      ++line_;
    } else if (pos_ + 1 < s_.size() && s_[pos_] == '\r' && s_[pos_ + 1] == '\n') {
      pos_ += 2;
      ++line_;
    }
  }
  // {% raw %}...{% endraw %}: emitted verbatim.
  bool raw_block() {
    size_t p = pos_;
    while (p < s_.size() && is_ws(s_[p])) ++p;
    if (s_.compare(p, 3, "raw") != 0) return false;
    p += 3;
    while (p < s_.size() && is_ws(s_[p])) ++p;
    if (p < s_.size() && s_[p] == '-') ++p;
    if (s_.compare(p, 2, "%}") != 0) return false;
    size_t body = p + 2, end = s_.find("endraw", body);
    if (end == std::string::npos) fail("jinja: unclosed raw block at line {}", line_);
    size_t tag = s_.rfind("{%", end);
    size_t close = s_.find("%}", end);
    if (tag == std::string::npos || tag < body || close == std::string::npos)
      fail("jinja: malformed endraw tag at line {}", line_);
    out_.push_back({Token::Text, s_.substr(body, tag - body), line_});
    count_lines(pos_, close);
    pos_ = close + 2;
    return true;
  }

  // Lexes expression tokens up to the closing `}}` / `%}`; returns true if it was `-}}` / `-%}`.
  bool lex_expression(char close) {
    int depth = 0;
    while (true) {
      while (pos_ < s_.size() && is_ws(s_[pos_])) line_ += s_[pos_++] == '\n';
      if (pos_ >= s_.size()) fail("jinja: unclosed tag at line {}", line_);
      char c = s_[pos_];
      if (c == '-' && s_.compare(pos_ + 1, 1, std::string(1, close)) == 0 && pos_ + 2 < s_.size() &&
          s_[pos_ + 2] == '}' && depth == 0) {
        pos_ += 3;
        return true;
      }
      if (c == close && pos_ + 1 < s_.size() && s_[pos_ + 1] == '}' && depth == 0) {
        pos_ += 2;
        return false;
      }
      if (c == '\'' || c == '"') {
        out_.push_back({Token::String, lex_string(c), line_});
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t b = pos_;
        while (pos_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '_')) ++pos_;
        bool is_float = false;
        if (pos_ + 1 < s_.size() && s_[pos_] == '.' && std::isdigit(static_cast<unsigned char>(s_[pos_ + 1]))) {
          is_float = true;
          ++pos_;
          while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
        }
        if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
          is_float = true;
          ++pos_;
          if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
          while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
        }
        std::string num = s_.substr(b, pos_ - b);
        std::erase(num, '_');
        out_.push_back({is_float ? Token::Float : Token::Int, num, line_});
      } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t b = pos_;
        while (pos_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '_')) ++pos_;
        out_.push_back({Token::Name, s_.substr(b, pos_ - b), line_});
      } else {
        static const char* two[] = {"**", "//", "==", "!=", "<=", ">="};
        std::string op(1, c);
        for (const char* t : two)
          if (s_.compare(pos_, 2, t) == 0) op = t;
        if (op.size() == 1 && std::string_view("+-*/%~<>=.,:|()[]{}!").find(c) == std::string_view::npos)
          fail("jinja: unexpected character '{}' at line {}", c, line_);
        if (op == "(" || op == "[" || op == "{") ++depth;
        if (op == ")" || op == "]" || op == "}") --depth;
        pos_ += op.size();
        out_.push_back({Token::Op, op, line_});
      }
    }
  }

  std::string lex_string(char q) {
    std::string out;
    ++pos_;
    while (pos_ < s_.size() && s_[pos_] != q) {
      char c = s_[pos_++];
      if (c != '\\' || pos_ >= s_.size()) {
        line_ += c == '\n';
        out += c;
        continue;
      }
      char e = s_[pos_++];
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case '0': out += '\0'; break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case '\n': break;
        case 'u':
        case 'x': {
          size_t n = e == 'u' ? 4 : 2;
          uint32_t cp = 0;
          for (size_t k = 0; k < n; ++k) {
            char h = pos_ + k < s_.size() ? s_[pos_ + k] : '\0';
            int d = h >= '0' && h <= '9'   ? h - '0'
                    : h >= 'a' && h <= 'f' ? h - 'a' + 10
                    : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                           : -1;
            if (d < 0) fail("jinja: invalid \\{} escape at line {}", e, line_);
            cp = cp * 16 + uint32_t(d);
          }
          utf8::append(out, cp);
          pos_ += n;
          break;
        }
        default: out += '\\'; out += e;
      }
    }
    if (pos_ >= s_.size()) fail("jinja: unterminated string at line {}", line_);
    ++pos_;
    return out;
  }

  std::string s_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> out_;
};

}  // namespace

std::vector<Token> lex(const std::string& source) { return Lexer(source).run(); }

}  // namespace moesrv::jinja
