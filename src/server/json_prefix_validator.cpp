#include "server/json_prefix_validator.h"

#include <cctype>
#include <cstring>

namespace moesrv {

static bool ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
static bool digit(char c) { return c >= '0' && c <= '9'; }

JsonPrefixValidator::JsonPrefixValidator(const std::string& t) {
  if (t == "integer") top_ = 'n', integer_only_ = true;
  else if (t == "number") top_ = 'n';
  else if (t == "boolean") top_ = 'b';
  else if (t == "object") top_ = '{';
  else if (t == "array") top_ = '[';
  else if (t == "null") top_ = 'z';
  else if (t == "string") top_ = '"';
}

void JsonPrefixValidator::value_done() {
  if (stack_.empty()) done_ = true;
  s_ = S::kAfter;
}

bool JsonPrefixValidator::start_value(char c) {
  if (stack_.empty() && top_) {  // enforce the schema's top-level type
    bool number = c == '-' || digit(c);
    bool ok = (top_ == 'n' && number) || (top_ == 'b' && (c == 't' || c == 'f')) || (top_ == 'z' && c == 'n') ||
              (top_ == c);
    if (!ok) return false;
  }
  switch (c) {
    case '{': stack_ += '{'; s_ = S::kObjectFirst; return true;
    case '[': stack_ += '['; s_ = S::kArrayFirst; return true;
    case '"': s_ = S::kString; key_ = false; return true;
    case 't': literal_ = "rue"; s_ = S::kLiteral; return true;
    case 'f': literal_ = "alse"; s_ = S::kLiteral; return true;
    case 'n': literal_ = "ull"; s_ = S::kLiteral; return true;
    case '-': s_ = S::kMinus; return true;
    case '0': s_ = S::kZero; return true;
    default:
      if (digit(c)) { s_ = S::kInt; return true; }
      return false;
  }
}

// A number ends at the first character that cannot extend it; that character is then read as "after value".
bool JsonPrefixValidator::end_number_then(char c) {
  value_done();
  return feed(c);
}

bool JsonPrefixValidator::feed(char c) {
  bool top_number = stack_.empty();
  bool in_string = s_ == S::kString || s_ == S::kEscape || s_ == S::kUnicode;
  if (!in_string && ws(c)) {
    if (++spaces_ > kMaxSpaces) return false;
  } else {
    spaces_ = 0;
  }
  switch (s_) {
    case S::kValue:
      if (ws(c)) return true;
      return start_value(c);
    case S::kArrayFirst:
      if (ws(c)) return true;
      if (c == ']') { stack_.pop_back(); value_done(); return true; }
      return start_value(c);
    case S::kObjectFirst:
    case S::kObjectKey:
      if (ws(c)) return true;
      if (c == '}' && s_ == S::kObjectFirst) { stack_.pop_back(); value_done(); return true; }
      if (c == '"') { s_ = S::kString; key_ = true; return true; }
      return false;
    case S::kColon:
      if (ws(c)) return true;
      if (c == ':') { s_ = S::kValue; return true; }
      return false;
    case S::kAfter:
      if (ws(c)) return true;
      if (stack_.empty()) return false;  // only trailing whitespace after the top-level value
      if (c == ',') { s_ = stack_.back() == '{' ? S::kObjectKey : S::kValue; return true; }
      if ((c == '}' && stack_.back() == '{') || (c == ']' && stack_.back() == '[')) {
        stack_.pop_back();
        value_done();
        return true;
      }
      return false;
    case S::kString:
      if (c == '"') {
        if (key_) s_ = S::kColon, key_ = false;
        else value_done();
        return true;
      }
      if (c == '\\') { s_ = S::kEscape; return true; }
      return (unsigned char)c >= 0x20;
    case S::kEscape:
      if (c == 'u') { s_ = S::kUnicode; hex_left_ = 4; return true; }
      if (std::strchr("\"\\/bfnrt", c) && c) { s_ = S::kString; return true; }
      return false;
    case S::kUnicode:
      if (!std::isxdigit((unsigned char)c)) return false;
      if (--hex_left_ == 0) s_ = S::kString;
      return true;
    case S::kLiteral:
      if (c != *literal_) return false;
      if (!*++literal_) value_done();
      return true;
    case S::kMinus:
      if (c == '0') { s_ = S::kZero; return true; }
      if (digit(c)) { s_ = S::kInt; return true; }
      return false;
    case S::kZero:
    case S::kInt:
      if (digit(c) && s_ == S::kInt) return true;
      if (!(integer_only_ && top_number)) {
        if (c == '.') { s_ = S::kDot; return true; }
        if (c == 'e' || c == 'E') { s_ = S::kExp; return true; }
      }
      return end_number_then(c);
    case S::kDot:
      if (digit(c)) { s_ = S::kFrac; return true; }
      return false;
    case S::kFrac:
      if (digit(c)) return true;
      if (c == 'e' || c == 'E') { s_ = S::kExp; return true; }
      return end_number_then(c);
    case S::kExp:
      if (c == '+' || c == '-') { s_ = S::kExpSign; return true; }
      [[fallthrough]];
    case S::kExpSign:
      if (digit(c)) { s_ = S::kExpDigits; return true; }
      return false;
    case S::kExpDigits:
      if (digit(c)) return true;
      return end_number_then(c);
  }
  return false;
}

bool JsonPrefixValidator::complete() const {
  if (done_) return true;
  bool number_end = s_ == S::kZero || s_ == S::kInt || s_ == S::kFrac || s_ == S::kExpDigits;
  return stack_.empty() && number_end;
}

}  // namespace moesrv
