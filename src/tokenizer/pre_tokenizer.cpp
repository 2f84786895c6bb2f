#include "tokenizer/pre_tokenizer.h"

#include <nlohmann/json.hpp>

#include "tokenizer/regex_splitter.h"
#include "util/error.h"

namespace moesrv {
namespace {

// The GPT-2 pattern used by ByteLevel when use_regex is true.
const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string escape_literal(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

PreTokenizer::PreTokenizer(const nlohmann::json& config) {
  if (!config.is_null()) add(config);
}
PreTokenizer::~PreTokenizer() = default;
PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;

void PreTokenizer::add(const nlohmann::json& c) {
  std::string type = c.value("type", "");
  if (type == "Sequence") {
    for (const auto& p : c.at("pretokenizers")) add(p);
  } else if (type == "Split") {
    std::string behavior = c.value("behavior", "");
    if (behavior != "Isolated" || c.value("invert", false))
      fail("tokenizer: Split pre-tokenizer with behavior '{}' invert={} is not supported", behavior,
           c.value("invert", false));
    const auto& pat = c.at("pattern");
    std::string regex = pat.contains("Regex") ? pat["Regex"].get<std::string>()
                                              : escape_literal(pat.at("String").get<std::string>());
    splitters_.push_back(std::make_unique<RegexSplitter>(regex));
  } else if (type == "ByteLevel") {
    if (c.value("add_prefix_space", false))
      fail("tokenizer: ByteLevel pre-tokenizer with add_prefix_space is not supported");
    if (c.value("use_regex", true)) splitters_.push_back(std::make_unique<RegexSplitter>(kGpt2Pattern));
    byte_level_ = true;
  } else {
    fail("tokenizer: pre-tokenizer type '{}' is not supported", type);
  }
}

std::vector<Span> PreTokenizer::split(std::string_view text) const {
  std::vector<Span> spans{{0, text.size()}}, next;
  if (text.empty()) return {};
  for (const auto& s : splitters_) {
    next.clear();
    next.reserve(spans.size() * 2);
    for (Span sp : spans) s->split(text, sp, next);
    spans.swap(next);
  }
  return spans;
}

}  // namespace moesrv
