#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex_splitter.h"

#include <pcre2.h>

#include "util/error.h"

namespace moesrv {
namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

// Match data and JIT stack are per thread, so one tokenizer can encode from many threads.
struct MatchScratch {
  pcre2_match_data* data = pcre2_match_data_create(4, nullptr);
  pcre2_match_context* ctx = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  MatchScratch() { pcre2_jit_stack_assign(ctx, nullptr, stack); }
  ~MatchScratch() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(ctx);
    pcre2_match_data_free(data);
  }
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

}  // namespace

RegexSplitter::RegexSplitter(const std::string& pattern) : pattern_(pattern) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
  if (!code) fail("tokenizer: cannot compile regex '{}' at {}: {}", pattern, offset, pcre2_message(err));
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is unavailable
  code_ = code;
}

RegexSplitter::~RegexSplitter() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void RegexSplitter::split(std::string_view text, Span in, std::vector<Span>& out) const {
  auto* code = static_cast<pcre2_code*>(code_);
  MatchScratch& s = scratch();
  // Match within the span only (lookarounds must not see neighbouring spans).
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data() + in.begin);
  size_t len = in.end - in.begin, pos = 0, gap_start = 0;
  while (pos < len) {
    int rc = pcre2_match(code, subject, len, pos, PCRE2_NO_UTF_CHECK, s.data, s.ctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) fail("tokenizer: regex '{}' failed: {}", pattern_, pcre2_message(rc));
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.data);
    size_t mb = ov[0], me = ov[1];
    if (me == mb) {  // empty match: step over one character
      pos = mb + 1;
      while (pos < len && (subject[pos] & 0xC0) == 0x80) ++pos;
      continue;
    }
    if (mb > gap_start) out.push_back({in.begin + gap_start, in.begin + mb});
    out.push_back({in.begin + mb, in.begin + me});
    gap_start = pos = me;
  }
  if (gap_start < len) out.push_back({in.begin + gap_start, in.end});
}

}  // namespace moesrv
