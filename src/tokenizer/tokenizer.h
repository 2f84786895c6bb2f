// Hugging Face tokenizer.json loader and encoder/decoder (BPE, byte-level; Qwen / DeepSeek / GLM).
//
// encode() is the raw tokenizer: no BOS/EOS or other post-processing is added (chat templates
// emit those tokens as text). Thread-safe: const methods may be called concurrently.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pre_tokenizer.h"

namespace moesrv {

class Tokenizer {
 public:
  // Loads tokenizer.json; tokenizer_config.json defaults to the file next to it (optional).
  static Tokenizer load(const std::string& tokenizer_json_path, const std::string& tokenizer_config_path = "");
  // From already-parsed JSON (tests, embedded tokenizers).
  static Tokenizer from_json(const nlohmann::json& tokenizer, nlohmann::json config = nlohmann::json::object());

  // parse_special=false: special tokens in `text` are encoded as plain text
  // (non-special added tokens are still matched, like HF's split_special_tokens).
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
  // Invalid UTF-8 produced by the ids is replaced with U+FFFD.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;
  // Raw bytes one token contributes to decoded text (may be a partial UTF-8 sequence).
  std::string token_text(int32_t id) const;
  // Id of a vocab entry as spelled in tokenizer.json (e.g. "Ġthe") or of an added token's content.
  std::optional<int32_t> token_id(std::string_view tok) const;
  int64_t vocab_size() const { return vocab_size_; }
  bool is_special(int32_t id) const;
  bool is_added(int32_t id) const;  // an added token (special or not): matched atomically, a marker rather than text
  // tokenizer_config.json (chat_template, eos_token, ...); an empty object when absent.
  const nlohmann::json& config() const { return config_; }
  // Content of a config token entry ("eos_token", "bos_token", ...): plain string or {"content": ...}.
  std::optional<std::string> config_token(const std::string& key) const;
  std::optional<int32_t> eos_id() const;
  std::optional<int32_t> bos_id() const;

  Tokenizer(Tokenizer&&) noexcept = default;
  Tokenizer& operator=(Tokenizer&&) noexcept = default;

 private:
  Tokenizer() = default;
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;

  std::unique_ptr<Bpe> bpe_;
  std::unique_ptr<PreTokenizer> pre_;
  std::unique_ptr<AddedTokens> added_;
  bool nfc_ = false;
  std::vector<std::string> id_to_piece_;  // vocab spelling per id ("" for gaps)
  std::vector<uint8_t> is_added_;         // 1 added, 2 added+special
  int64_t vocab_size_ = 0;
  nlohmann::json config_ = nlohmann::json::object();
};

}  // namespace moesrv
