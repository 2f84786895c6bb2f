// DecodeHooks for one assistant turn of a chat completion: parses output into reasoning/content/tool calls,
// enforces the reasoning budget (forces "</think>"), tool_choice and strict tool grammar masks, stop
// sequences and end-of-turn tokens, and hands each delta to a sink (false from the sink = client gone).
#pragma once
#include <deque>
#include <functional>
#include <memory>

#include "server/chat_codec.h"
#include "server/chat_request.h"
#include "server/generator.h"
#include "server/glm_output_parser.h"
#include "server/stop_matcher.h"
#include "server/tool_call_grammar.h"
#include "server/vocab_text.h"

namespace moesrv {

struct ChatTurnConfig {
  int64_t reasoning_budget = 4096;  // 0: unlimited
  bool strict_tools = false;
  bool start_in_reasoning = false;  // the prompt ends inside <think>
};

class ChatTurnDecoder : public DecodeHooks {
 public:
  using Sink = std::function<bool(const ChatDelta&)>;
  ChatTurnDecoder(const ChatCodec& codec, const VocabText& vocab, const ChatCompletionRequest& req, ChatTurnConfig cfg, Sink sink);

  std::optional<int32_t> forced_token() override;
  const std::vector<uint8_t>* allowed_tokens() override;
  bool on_token(int32_t id) override;

  void finish();  // flush the parser and stop matcher into a last delta
  const GlmOutputParser& parser() const { return parser_; }
  const std::string& content() const { return content_; }  // after stop sequences
  int64_t reasoning_tokens() const { return reasoning_tokens_; }
  bool cancelled() const { return cancelled_; }
  bool stop_hit() const { return stops_.hit(); }
  bool budget_forced() const { return budget_forced_; }

 private:
  bool emit(ChatDelta d);
  const ChatCodec& codec_;
  const VocabText& vocab_;
  const ChatCompletionRequest& req_;
  ChatTurnConfig cfg_;
  Sink sink_;
  GlmOutputParser parser_;
  GlmMarkers m_;
  std::vector<int32_t> end_ids_;
  std::deque<int32_t> forced_;
  StopMatcher stops_;
  std::string content_;
  int64_t reasoning_tokens_ = 0;
  bool budget_forced_ = false, cancelled_ = false, reasoned_ = false;
  std::unique_ptr<ToolCallGrammar> grammar_;
  ToolCallGrammar::State gstate_;
  std::vector<uint8_t> mask_;
};

}  // namespace moesrv
