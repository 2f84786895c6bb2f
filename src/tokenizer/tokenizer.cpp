#include "tokenizer/tokenizer.h"

#include <filesystem>
#include <fstream>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "tokenizer/byte_level.h"
#include "tokenizer/nfc.h"
#include "tokenizer/utf8.h"
#include "util/error.h"

namespace moesrv {
namespace {

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  if (!f) fail("tokenizer: cannot open {}", path);
  try {
    return nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    fail("tokenizer: cannot parse {}: {}", path, e.what());
  }
}

// Replaces invalid UTF-8 with U+FFFD (returns `s` unchanged when already valid).
std::string sanitize_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t start = i;
    uint32_t cp = utf8::decode(s, i);
    bool bad = (cp == 0xFFFD && i - start == 1) || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF ||
               (i - start == 2 && cp < 0x80) || (i - start == 3 && cp < 0x800) || (i - start == 4 && cp < 0x10000);
    if (bad) {
      utf8::append(out, 0xFFFD);
    } else {
      out.append(s.substr(start, i - start));
    }
  }
  return out;
}

bool is_valid_utf8(std::string_view s) {
  for (unsigned char c : s)
    if (c >= 0x80) return sanitize_utf8(s) == s;
  return true;
}

// Returns true when the normalizer is NFC, false when it is absent/empty; fails otherwise.
bool parse_normalizer(const nlohmann::json& n) {
  if (n.is_null()) return false;
  std::string type = n.value("type", "");
  if (type == "NFC") return true;
  if (type == "Sequence") {
    bool nfc = false;
    for (const auto& sub : n.at("normalizers")) nfc = parse_normalizer(sub) || nfc;
    return nfc;
  }
  fail("tokenizer: normalizer '{}' is not supported", type);
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& json_path, const std::string& config_path) {
  std::string cfg = config_path;
  if (cfg.empty()) {
    auto sibling = std::filesystem::path(json_path).parent_path() / "tokenizer_config.json";
    if (std::filesystem::exists(sibling)) cfg = sibling.string();
  }
  Tokenizer t = from_json(read_json(json_path), cfg.empty() ? nlohmann::json::object() : read_json(cfg));
#ifdef __GLIBC__
  // The parsed tokenizer.json leaves millions of freed small blocks; consolidate them now instead
  // of stalling the first encode() call (glibc merges them lazily on the next large allocation).
  malloc_trim(0);
#endif
  return t;
}

Tokenizer Tokenizer::from_json(const nlohmann::json& j, nlohmann::json config) {
  Tokenizer t;
  t.config_ = std::move(config);
  t.nfc_ = parse_normalizer(j.value("normalizer", nlohmann::json()));
  t.pre_ = std::make_unique<PreTokenizer>(j.value("pre_tokenizer", nlohmann::json()));
  if (!t.pre_->byte_level()) fail("tokenizer: only byte-level BPE tokenizers are supported");
  const auto& dec = j.value("decoder", nlohmann::json());
  if (!dec.is_null() && dec.value("type", "") != "ByteLevel")
    fail("tokenizer: decoder '{}' is not supported", dec.value("type", ""));
  t.bpe_ = std::make_unique<Bpe>(j.at("model"));

  int64_t max_id = -1;
  for (const auto& [piece, id] : t.bpe_->vocab()) max_id = std::max<int64_t>(max_id, id);
  std::vector<AddedToken> added;
  for (const auto& a : j.value("added_tokens", nlohmann::json::array())) {
    AddedToken tok{a.at("id").get<int32_t>(), a.at("content").get<std::string>(), a.value("special", false),
                   a.value("lstrip", false), a.value("rstrip", false)};
    if (a.value("single_word", false)) fail("tokenizer: added token '{}' uses single_word (unsupported)", tok.content);
    // We match added tokens on raw text; that equals HF only if normalization leaves them unchanged.
    if (a.value("normalized", false) && t.nfc_ && nfc_normalize(tok.content) != tok.content)
      fail("tokenizer: added token '{}' changes under normalization (unsupported)", tok.content);
    max_id = std::max<int64_t>(max_id, tok.id);
    added.push_back(std::move(tok));
  }
  t.vocab_size_ = max_id + 1;
  t.id_to_piece_.assign(t.vocab_size_, "");
  t.is_added_.assign(t.vocab_size_, 0);
  for (const auto& [piece, id] : t.bpe_->vocab()) t.id_to_piece_[id] = piece;
  for (const auto& a : added) {
    t.id_to_piece_[a.id] = a.content;
    t.is_added_[a.id] = a.special ? 2 : 1;
  }
  t.added_ = std::make_unique<AddedTokens>(std::move(added));
  return t;
}

void Tokenizer::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  std::string normalized;
  if (nfc_ && !nfc_quick_check(text)) {
    normalized = nfc_normalize(text);
    text = normalized;
  }
  const ByteLevel& bl = ByteLevel::get();
  std::string word;
  for (Span sp : pre_->split(text)) {
    word.clear();
    for (size_t i = sp.begin; i < sp.end; ++i) word += bl.byte_to_text(static_cast<unsigned char>(text[i]));
    bpe_->encode_word(word, out);
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  std::string clean;
  if (!is_valid_utf8(text)) {
    clean = sanitize_utf8(text);
    text = clean;
  }
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  size_t pos = 0;
  for (const auto& m : added_->find_all(text, parse_special)) {
    encode_text(text.substr(pos, m.begin - pos), out);
    out.push_back(m.id);
    pos = m.end;
  }
  encode_text(text.substr(pos), out);
  return out;
}

std::string Tokenizer::token_text(int32_t id) const {
  if (id < 0 || id >= vocab_size_) fail("tokenizer: token id {} out of range", id);
  if (is_added_[id]) return id_to_piece_[id];
  return ByteLevel::get().decode(id_to_piece_[id]);
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (skip_special && is_special(id)) continue;
    bytes += token_text(id);
  }
  return is_valid_utf8(bytes) ? bytes : sanitize_utf8(bytes);
}

std::optional<int32_t> Tokenizer::token_id(std::string_view tok) const {
  for (const auto& a : added_->tokens())
    if (a.content == tok) return a.id;
  const auto& v = bpe_->vocab();
  if (auto it = v.find(std::string(tok)); it != v.end()) return it->second;
  return std::nullopt;
}

bool Tokenizer::is_special(int32_t id) const { return id >= 0 && id < vocab_size_ && is_added_[id] == 2; }
bool Tokenizer::is_added(int32_t id) const { return id >= 0 && id < vocab_size_ && is_added_[id] != 0; }

std::optional<std::string> Tokenizer::config_token(const std::string& key) const {
  if (!config_.contains(key)) return std::nullopt;
  const auto& v = config_[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

std::optional<int32_t> Tokenizer::eos_id() const {
  auto s = config_token("eos_token");
  return s ? token_id(*s) : std::nullopt;
}

std::optional<int32_t> Tokenizer::bos_id() const {
  auto s = config_token("bos_token");
  return s ? token_id(*s) : std::nullopt;
}

}  // namespace moesrv
