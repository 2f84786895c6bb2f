// Unicode NFC normalization (tables generated from the Unicode database, see tokenizer/tools/gen_nfc_tables.py).
#pragma once
#include <string>
#include <string_view>

namespace moesrv {

// True when `s` is certainly NFC already (fast scan; may return false for some NFC text).
bool nfc_quick_check(std::string_view s);
// Returns the NFC form of UTF-8 text `s`.
std::string nfc_normalize(std::string_view s);

}  // namespace moesrv
