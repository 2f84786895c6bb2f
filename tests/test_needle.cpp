// Needle-in-a-haystack: prompt construction and scoring, against an engine that reads the prompt back.
#include <gtest/gtest.h>

#include <algorithm>

#include "server_test_doubles.h"
#include "tools/needle.h"
#include "util/error.h"

namespace moesrv {
namespace {

using namespace moesrv::testing;

// Emits, after the prompt, whatever follows "vault is " in it (up to '.'), then end of turn: a model with
// perfect recall. With `recall = false` it answers something unrelated.
class RecallEngine : public Engine {
 public:
  explicit RecallEngine(const ByteCodec& codec, bool recall) : codec_(codec), recall_(recall) {}
  std::string name() const override { return "recall"; }
  int64_t vocab_size() const override { return codec_.vocab_size(); }
  int64_t max_context() const override { return 1 << 20; }
  int64_t prefill_chunk() const override { return 1 << 20; }  // the whole prompt in the first call (read below)
  std::unique_ptr<SequenceState> new_sequence() const override { return std::make_unique<ScriptedSequence>(); }
  std::vector<float> forward(SequenceState& seq, const std::vector<int32_t>& tokens, bool) override {
    auto& s = static_cast<ScriptedSequence&>(seq);
    s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
    history_.insert(history_.end(), tokens.begin(), tokens.end());
    if (answer_.empty()) {
      std::string text;
      for (int32_t t : history_) text += codec_.token_bytes(t);
      std::string key = recall_ ? "vault is " : "the ";
      size_t at = text.find(key);
      answer_ = at == std::string::npos ? "nothing" : text.substr(at + key.size(), text.find('.', at) - at - key.size());
      answer_ += char(0);  // end marker
      pos_ = 0;
    } else {
      ++pos_;
    }
    std::vector<float> logits(size_t(vocab_size()), 0.0f);
    int32_t next = pos_ < answer_.size() - 1 ? int32_t((unsigned char)answer_[pos_]) : *codec_.special_id("<|endoftext|>");
    logits[size_t(next)] = 1.0f;
    return logits;
  }

 private:
  const ByteCodec& codec_;
  bool recall_;
  std::vector<int32_t> history_;
  std::string answer_;
  size_t pos_ = 0;
};

TEST(Needle, PromptFitsContextAndHoldsTheNeedleAtDepth) {
  ByteCodec codec;
  NeedleOptions o;
  int64_t last_offset = -1;
  for (double depth : {0.0, 0.5, 1.0}) {
    NeedlePrompt p = build_needle_prompt(codec, {4000, depth}, o);
    EXPECT_LE(int64_t(p.tokens.size()), 4000);
    EXPECT_GE(int64_t(p.tokens.size()), 3500);  // filled close to the target
    std::string text;
    for (int32_t t : p.tokens) text += codec.token_bytes(t);
    ASSERT_EQ(text.find(o.needle), text.rfind(o.needle)) << "needle must appear once";
    std::string head;
    for (int64_t i = 0; i < p.needle_token_offset; ++i) head += codec.token_bytes(p.tokens[size_t(i)]);
    EXPECT_EQ(head.size(), text.find(o.needle));  // ByteCodec: one token per byte
    EXPECT_GT(p.needle_token_offset, last_offset);
    last_offset = p.needle_token_offset;
  }
  EXPECT_GT(last_offset, 3000);  // depth 1: near the end
}

TEST(Needle, ScoresRecallAndMisses) {
  ByteCodec codec;
  NeedleOptions o;
  RecallEngine good(codec, true), bad(codec, false);
  NeedleResult r = run_needle(good, codec, {2000, 0.3}, o);
  EXPECT_TRUE(r.found) << r.answer;
  EXPECT_EQ(r.answer, "amber-falcon-7319");
  NeedleResult miss = run_needle(bad, codec, {2000, 0.3}, o);
  EXPECT_FALSE(miss.found) << miss.answer;
}

TEST(Needle, RejectsImpossibleCases) {
  ByteCodec codec;
  NeedleOptions o;
  EXPECT_THROW(build_needle_prompt(codec, {50, 0.5}, o), Error);
  EXPECT_THROW(build_needle_prompt(codec, {4000, 1.5}, o), Error);
}

}  // namespace
}  // namespace moesrv
