// A PCRE2 regex (UTF + UCP, JIT when available) used by Split pre-tokenizers.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/pre_tokenizer.h"

namespace moesrv {

class RegexSplitter {
 public:
  explicit RegexSplitter(const std::string& pattern);
  ~RegexSplitter();
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;

  // "Isolated" split: every match and every gap between matches becomes its own span.
  // `text` must be valid UTF-8 (not re-checked).
  void split(std::string_view text, Span in, std::vector<Span>& out) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8*
  std::string pattern_;
};

}  // namespace moesrv
