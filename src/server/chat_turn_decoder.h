// DecodeHooks for one assistant turn of a chat completion: parses output into reasoning/content/tool calls
// (the model family's format), constrains every token through the turn grammar (tool_choice, parallel calls,
// strict tool arguments, response_format), bounds reasoning (forces the reasoning close), applies stop
// sequences and end-of-turn tokens, records logprobs (reasoning and content tokens), and hands each delta to a
// sink (false = client gone).
#pragma once
#include <deque>
#include <functional>
#include <memory>

#include "server/chat_codec.h"
#include "server/chat_request.h"
#include "server/generator.h"
#include "server/output_parser.h"
#include "server/stop_matcher.h"
#include "server/turn_grammar.h"
#include "server/vocab_text.h"

namespace moesrv {

struct ChatTurnConfig {
  int64_t reasoning_budget = 4096;  // max reasoning tokens, <think> and </think> included; 0: unlimited
  bool strict_tools = false;
  bool start_in_reasoning = false;  // the prompt ends inside <think>
  int64_t max_new_tokens = 0;       // the turn's token limit (0: none): bounds reasoning before a required call
};

// The reasoning budget of a turn. When a tool call or JSON content is required, reasoning may use at most half of
// the turn's tokens, so that what is required still fits after it.
int64_t turn_reasoning_budget(const ChatTurnConfig& cfg, const TurnRules& rules);

// The reasoning-close forcing and usage count both rely on this: tokens from the reasoning open (or the turn's
// start when the prompt opened it) through the reasoning close, inclusive.
class ChatTurnDecoder : public DecodeHooks {
 public:
  using Sink = std::function<bool(const ChatDelta&)>;
  ChatTurnDecoder(const ChatCodec& codec, const VocabText& vocab, const TurnMarkers& markers,
                  const ChatCompletionRequest& req, ChatTurnConfig cfg, Sink sink);

  std::optional<int32_t> forced_token() override;
  const std::vector<uint8_t>* allowed_tokens() override;
  void on_sampled(std::span<const float> logits, int32_t id) override;
  bool wants_logits() const override;
  bool on_token(int32_t id) override;

  void finish();  // flush the parser and stop matcher into a last delta
  const OutputParser& parser() const { return *parser_; }
  const std::string& content() const { return content_; }  // after stop sequences
  const nlohmann::json& logprobs() const { return all_logprobs_; }  // reasoning and content tokens, in order
  // The calls that were closed: a call cut by the token limit is not one (the parser still reports it).
  std::vector<ParsedToolCall> complete_calls() const;
  int64_t reasoning_tokens() const { return reasoning_tokens_; }
  bool cancelled() const { return cancelled_; }
  bool stop_hit() const { return stops_.hit(); }
  bool budget_forced() const { return budget_forced_; }
  bool grammar_broken() const { return broken_; }

 private:
  bool emit(ChatDelta d);
  void keep_end_in_reach();
  const ChatCodec& codec_;
  const TurnMarkers& m_;
  const ChatCompletionRequest& req_;
  ChatTurnConfig cfg_;
  int64_t reasoning_budget_;
  Sink sink_;
  std::unique_ptr<OutputParser> parser_;
  StopMatcher stops_;
  std::string content_;
  int64_t reasoning_tokens_ = 0, generated_ = 0;
  bool budget_forced_ = false, cancelled_ = false, broken_ = false;
  TurnGrammar grammar_;
  TurnGrammar::State gstate_;
  std::vector<uint8_t> mask_;
  nlohmann::json last_logprob_, pending_logprobs_ = nlohmann::json::array(), all_logprobs_ = nlohmann::json::array();
};

// One OpenAI logprob entry {token, logprob, bytes, top_logprobs} for `id` under `logits`.
nlohmann::json logprob_entry(const ChatCodec& codec, std::span<const float> logits, int32_t id, int top);

}  // namespace moesrv
