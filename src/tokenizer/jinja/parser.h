// Jinja parser: tokens -> statement tree.
#pragma once
#include <vector>

#include "tokenizer/jinja/ast.h"
#include "tokenizer/jinja/lexer.h"

namespace moesrv::jinja {

Body parse(const std::vector<Token>& tokens);

}  // namespace moesrv::jinja
