// Jinja lexer: splits template source into text and tag tokens, applying whitespace control
// ({%- -%}), trim_blocks, lstrip_blocks and dropping one trailing newline, like Hugging Face's
// chat-template environment.
#pragma once
#include <string>
#include <vector>

namespace moesrv::jinja {

struct Token {
  enum Kind { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };
  Kind kind;
  std::string text;
  int line;
};

std::vector<Token> lex(const std::string& source);

}  // namespace moesrv::jinja
