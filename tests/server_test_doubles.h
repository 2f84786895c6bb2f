// Test doubles for the server: a byte-level ChatCodec with GLM special tokens and a scripted Engine whose
// "model" is a policy function from the tokens generated so far to preferred next tokens.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <thread>

#include "backend/engine.h"
#include "server/chat_codec.h"

namespace moesrv::testing {

inline const std::vector<std::string>& glm_specials() {
  static const std::vector<std::string> s = {
      "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>",
      "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>",
      "</tool_response>", "<|endoftext|>"};
  return s;
}

// The structure tokens of the other tool-call formats (plus the test-only <|assistant|> the scripted engine
// looks for and a stray special token that must never reach the output).
inline const std::vector<std::string>& qwen3_specials() {
  static const std::vector<std::string> s = {"<|im_start|>",     "<|im_end|>",    "<|endoftext|>", "<tool_call>",
                                             "</tool_call>",     "<think>",       "</think>",      "<tool_response>",
                                             "</tool_response>", "<|assistant|>", "<|user|>",      "<|vision_pad|>"};
  return s;
}
inline const std::vector<std::string>& deepseek_specials() {
  static const std::vector<std::string> s = {"<｜begin▁of▁sentence｜>",
                                             "<｜end▁of▁sentence｜>",
                                             "<｜User｜>",
                                             "<｜Assistant｜>",
                                             "<｜tool▁calls▁begin｜>",
                                             "<｜tool▁calls▁end｜>",
                                             "<｜tool▁call▁begin｜>",
                                             "<｜tool▁call▁end｜>",
                                             "<｜tool▁sep｜>",
                                             "<｜tool▁outputs▁begin｜>",
                                             "<｜tool▁output▁begin｜>",
                                             "<｜tool▁output▁end｜>",
                                             "<｜tool▁outputs▁end｜>",
                                             "<|assistant|>",
                                             "<|user|>",
                                             "<|endoftext|>"};
  return s;
}

enum class TestFormat { kGlm, kQwen3, kDeepSeek };

// ids 0..255: bytes; 256..: the format's special tokens (GLM by default).
class ByteCodec : public ChatCodec {
 public:
  explicit ByteCodec(TestFormat f = TestFormat::kGlm)
      : specials_(f == TestFormat::kGlm     ? glm_specials()
                  : f == TestFormat::kQwen3 ? qwen3_specials()
                                            : deepseek_specials()),
        format_(f) {}
  const std::vector<std::string>& specials() const { return specials_; }
  int64_t vocab_size() const override { return 256 + int64_t(specials_.size()); }
  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> out;
    for (size_t i = 0; i < text.size();) {
      bool matched = false;
      for (size_t s = 0; s < specials_.size(); ++s) {
        auto& sp = specials_[s];
        if (text.compare(i, sp.size(), sp) == 0) {
          out.push_back(int32_t(256 + s));
          i += sp.size();
          matched = true;
          break;
        }
      }
      if (!matched) out.push_back((unsigned char)text[i++]);
    }
    return out;
  }
  std::string token_bytes(int32_t id) const override {
    if (id < 256) return std::string(1, char(id));
    return specials_.at(size_t(id - 256));
  }
  bool is_special(int32_t id) const override { return id >= 256; }
  std::optional<int32_t> special_id(const std::string& text) const override {
    for (size_t s = 0; s < specials_.size(); ++s)
      if (specials_[s] == text) return int32_t(256 + s);
    return std::nullopt;
  }
  std::vector<int32_t> end_of_turn_ids() const override {
    std::vector<int32_t> ids;
    for (auto* t : {"<|endoftext|>", "<|user|>", "<|observation|>", "<|im_end|>", "<｜end▁of▁sentence｜>"})
      if (auto id = special_id(t)) ids.push_back(*id);
    return ids;
  }
  // A GLM-like rendering; reasoning_content of assistant turns is kept so tests can see re-attachment.
  std::string render_chat(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                          const nlohmann::ordered_json& kwargs) const override {
    std::string out = format_ == TestFormat::kGlm ? "[gMASK]<sop>" : "";
    if (!tools.empty()) out += "<|system|>\ntools:" + tools.dump();
    for (auto& m : messages) {
      std::string role = m["role"];
      if (role == "tool") {
        out += (format_ == TestFormat::kGlm ? "<|observation|>" : "<|user|>");
        out += "<tool_response>" + m.value("content", "") + "</tool_response>";
        continue;
      }
      out += format_ == TestFormat::kGlm || role != "system" ? "<|" + role + "|>\n" : "system\n";
      if (role == "assistant") out += "<think>" + m.value("reasoning_content", "") + "</think>";
      out += m.value("content", "");
      if (m.contains("tool_calls"))
        for (auto& c : m["tool_calls"]) {
          out += "<tool_call>" + c["function"]["name"].get<std::string>() + "\n";
          for (auto& [k, v] : c["function"]["arguments"].items())
            out += "<arg_key>" + k + "</arg_key><arg_value>" + (v.is_string() ? v.get<std::string>() : v.dump()) + "</arg_value>";
          out += "</tool_call>";
        }
    }
    out += "<|assistant|>";
    if (kwargs.value("think_in_prompt", false)) out += "<think>";
    return out;
  }

 private:
  std::vector<std::string> specials_;
  TestFormat format_;
};

class ScriptedSequence : public SequenceState {
 public:
  std::vector<int32_t> tokens;
  int64_t length() const override { return int64_t(tokens.size()); }
  void truncate(int64_t n) override { tokens.resize(size_t(n)); }
  std::unique_ptr<SequenceState> clone() const override { return std::make_unique<ScriptedSequence>(*this); }
  size_t bytes() const override { return tokens.size() * 1000; }
};

// Logit preferences for the next token: (token, logit); every other token gets -100.
using Preferences = std::vector<std::pair<int32_t, float>>;
using Policy = std::function<Preferences(const std::vector<int32_t>& generated)>;

class ScriptedEngine : public Engine {
 public:
  ScriptedEngine(const ByteCodec& codec, Policy policy, int64_t max_ctx = 4096)
      : codec_(codec), policy_(std::move(policy)), max_ctx_(max_ctx) {}
  std::string name() const override { return "scripted"; }
  int64_t vocab_size() const override { return codec_.vocab_size(); }
  int64_t max_context() const override { return max_ctx_; }
  std::unique_ptr<SequenceState> new_sequence() const override { return std::make_unique<ScriptedSequence>(); }
  std::vector<float> forward(SequenceState& s, const std::vector<int32_t>& tokens, bool) override {
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms.load()));
    auto& seq = static_cast<ScriptedSequence&>(s);
    seq.tokens.insert(seq.tokens.end(), tokens.begin(), tokens.end());
    forwarded_tokens += int64_t(tokens.size());
    {
      std::lock_guard lock(mu_);
      last_sequence_ = seq.tokens;
    }
    // The generated part is what follows the last <|assistant|> (or <think> right after it).
    int32_t assistant = *codec_.special_id("<|assistant|>");
    size_t start = 0;
    for (size_t i = seq.tokens.size(); i-- > 0;)
      if (seq.tokens[i] == assistant) {
        start = i + 1;
        break;
      }
    std::vector<int32_t> generated(seq.tokens.begin() + int64_t(start), seq.tokens.end());
    std::vector<float> logits(size_t(vocab_size()), -100.0f);
    for (auto& [t, v] : policy_(generated)) logits[size_t(t)] = v;
    return logits;
  }
  std::vector<int32_t> last_sequence() const {
    std::lock_guard lock(mu_);
    return last_sequence_;
  }
  std::atomic<int64_t> forwarded_tokens{0};
  std::atomic<int> delay_ms{0};

 private:
  const ByteCodec& codec_;
  Policy policy_;
  int64_t max_ctx_;
  mutable std::mutex mu_;
  std::vector<int32_t> last_sequence_;
};

// A policy that writes `script` (special-token text allowed) and then ends the turn with `end`.
inline Policy script_policy(const ByteCodec& codec, const std::string& script, const std::string& end = "<|endoftext|>",
                            Preferences fallback = {}) {
  auto ids = codec.encode(script);
  int32_t end_id = *codec.special_id(end);
  return [ids, end_id, fallback](const std::vector<int32_t>& generated) {
    Preferences p = fallback;
    size_t k = generated.size();
    p.push_back({k < ids.size() ? ids[k] : end_id, 10.0f});
    return p;
  };
}

}  // namespace moesrv::testing
