// Character-level JSON recogniser: feed() rejects the first character that cannot continue a valid JSON
// value; complete() says whether what was fed is one whole value. Small copyable state, used to mask tokens.
#pragma once
#include <cstdint>
#include <string>

namespace moesrv {

class JsonPrefixValidator {
 public:
  // `top_type`: JSON-schema type the top-level value must have ("" = any).
  explicit JsonPrefixValidator(const std::string& top_type = "");
  bool feed(char c);
  bool complete() const;

 private:
  enum class S : uint8_t {
    kValue, kArrayFirst, kObjectFirst, kObjectKey, kColon, kAfter, kString, kEscape, kUnicode, kLiteral,
    kMinus, kZero, kInt, kDot, kFrac, kExp, kExpSign, kExpDigits
  };
  bool start_value(char c);
  bool end_number_then(char c);
  void value_done();
  std::string stack_;    // '{' / '[' of open containers
  S s_ = S::kValue;
  bool key_ = false;     // the string being read is an object key
  bool done_ = false;    // the top-level value has ended
  uint8_t hex_left_ = 0;
  const char* literal_ = nullptr;  // remaining characters of true/false/null
  char top_ = 0;         // required first character class: 0 any, 'n' number, 'i' integer, or one of {[tfn"
  bool integer_only_ = false;
  uint8_t spaces_ = 0;   // whitespace run outside strings: bounded so a weak model cannot stall in it
  static constexpr uint8_t kMaxSpaces = 16;
};

}  // namespace moesrv
