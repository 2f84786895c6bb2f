#include "server/chat_turn_decoder.h"

#include <algorithm>

#include "serving/sampler.h"

namespace moesrv {

namespace {
TurnRules rules_for(const ChatCompletionRequest& req, const ChatTurnConfig& cfg) {
  TurnRules r;
  bool forced = req.tool_choice == ToolChoice::kRequired || req.tool_choice == ToolChoice::kNamed;
  r.calls_allowed = !req.tool_specs.empty() && req.tool_choice != ToolChoice::kNone;
  r.call_required = r.calls_allowed && forced;
  r.max_calls = req.parallel_tool_calls ? 0 : 1;
  r.strict_calls = cfg.strict_tools || forced;
  if (req.tool_choice == ToolChoice::kNamed)
    for (size_t i = 0; i < req.tool_specs.size(); ++i)
      if (req.tool_specs[i].name == req.tool_choice_name) r.tools.push_back(int(i));
  r.content_schema = req.response_schema;
  r.start_in_reasoning = cfg.start_in_reasoning;
  return r;
}

nlohmann::json bytes_array(const std::string& s) {
  nlohmann::json a = nlohmann::json::array();
  for (unsigned char c : s) a.push_back(int(c));
  return a;
}
}  // namespace

int64_t turn_reasoning_budget(const ChatTurnConfig& cfg, const TurnRules& rules) {
  if (!(rules.call_required || rules.content_schema) || cfg.max_new_tokens <= 0) return cfg.reasoning_budget;
  int64_t half = std::max<int64_t>(1, cfg.max_new_tokens / 2);
  return cfg.reasoning_budget > 0 ? std::min(cfg.reasoning_budget, half) : half;
}

nlohmann::json logprob_entry(const ChatCodec& codec, std::span<const float> logits, int32_t id, int top) {
  TokenLogprobs lp = token_logprobs(tokenizer_logits(codec, logits), id, top);
  std::string text = codec.token_bytes(id);
  nlohmann::json e = {{"token", text}, {"logprob", lp.logprob}, {"bytes", bytes_array(text)}};
  nlohmann::json alts = nlohmann::json::array();
  for (auto& [t, v] : lp.top) {
    std::string tt = codec.token_bytes(t);
    alts.push_back({{"token", tt}, {"logprob", v}, {"bytes", bytes_array(tt)}});
  }
  e["top_logprobs"] = std::move(alts);
  return e;
}

ChatTurnDecoder::ChatTurnDecoder(const ChatCodec& codec, const VocabText& vocab, const TurnMarkers& markers,
                                 const ChatCompletionRequest& req, ChatTurnConfig cfg, Sink sink)
    : codec_(codec),
      m_(markers),
      req_(req),
      cfg_(cfg),
      sink_(std::move(sink)),
      parser_(OutputParser::create(codec, markers, &req.tool_specs, cfg.start_in_reasoning)),
      stops_(req.gen.stop),
      grammar_(markers, req.tool_specs, rules_for(req, cfg), vocab) {
  reasoning_budget_ = turn_reasoning_budget(cfg_, grammar_.rules());
  gstate_ = grammar_.initial();
}

std::optional<int32_t> ChatTurnDecoder::forced_token() {
  if (reasoning_budget_ > 0 && m_.think_close >= 0 && parser_->mode() == OutputParser::Mode::kReasoning &&
      reasoning_tokens_ + 1 >= reasoning_budget_) {
    budget_forced_ = true;
    return m_.think_close;  // the close itself is the budget's last token
  }
  return std::nullopt;
}

const std::vector<uint8_t>* ChatTurnDecoder::allowed_tokens() {
  if (broken_) return nullptr;
  grammar_.mask(gstate_, mask_);
  keep_end_in_reach();
  return &mask_;
}

// A turn that must end in a call (or JSON content), or that is inside a strict call: near max_tokens, only tokens after
// which it can still end within the tokens left. Checked from kWindow tokens before the end is due, a margin for
// tokens that lengthen the way (an opened object, a chosen key).
void ChatTurnDecoder::keep_end_in_reach() {
  constexpr int64_t kWindow = 64;
  const TurnRules& rules = grammar_.rules();
  bool strict_call = rules.strict_calls && gstate_.phase == TurnGrammar::State::kCall;  // free bodies: cut, not closed
  bool must_close = rules.call_required || rules.content_schema || strict_call;
  if (cfg_.max_new_tokens <= 0 || !must_close) return;
  int64_t left = cfg_.max_new_tokens - generated_ - 1;  // after this token
  if (int64_t(grammar_.tokens_to_end(gstate_)) + kWindow <= left) return;
  std::vector<uint8_t> kept(mask_.size(), 0);
  bool any = false;
  for (size_t t = 0; t < mask_.size(); ++t) {
    if (!mask_[t]) continue;
    TurnGrammar::State next = gstate_;
    if (grammar_.advance(next, int32_t(t)) && int64_t(grammar_.tokens_to_end(next)) <= left) kept[t] = 1, any = true;
  }
  if (any) mask_.swap(kept);  // else the end is out of reach already: the turn is cut at max_tokens
}

void ChatTurnDecoder::on_sampled(std::span<const float> logits, int32_t id) {
  auto mode = parser_->mode();
  bool text = mode == OutputParser::Mode::kContent || mode == OutputParser::Mode::kReasoning;
  if (req_.logprobs.enabled && text && !codec_.is_special(id))
    last_logprob_ = logprob_entry(codec_, logits, id, req_.logprobs.top);
  else last_logprob_ = nullptr;
}

bool ChatTurnDecoder::wants_logits() const { return req_.logprobs.enabled; }

bool ChatTurnDecoder::on_token(int32_t id) {
  using Mode = OutputParser::Mode;
  ++generated_;
  if (!broken_ && !grammar_.advance(gstate_, id)) broken_ = true;  // unconstrained from here (never expected)
  if (m_.is_end(id)) return false;
  Mode before = parser_->mode();
  ChatDelta d;
  parser_->push(id, d);
  Mode after = parser_->mode();
  if (before == Mode::kReasoning || (after == Mode::kReasoning && before != Mode::kReasoning)) ++reasoning_tokens_;
  if (!last_logprob_.is_null() && before == after) {
    pending_logprobs_.push_back(last_logprob_);
    all_logprobs_.push_back(last_logprob_);
  }
  last_logprob_ = nullptr;
  if (!d.content.empty()) {
    d.content = stops_.push(d.content);
    content_ += d.content;
  }
  if ((!d.content.empty() || !d.reasoning.empty()) && !pending_logprobs_.empty()) {
    d.logprobs = std::move(pending_logprobs_);
    pending_logprobs_ = nlohmann::json::array();
  }
  if (!emit(std::move(d))) return false;
  return !stops_.hit();
}

std::vector<ParsedToolCall> ChatTurnDecoder::complete_calls() const {
  std::vector<ParsedToolCall> calls = parser_->tool_calls();
  if (!broken_) calls.resize(std::min<size_t>(calls.size(), gstate_.calls));  // the grammar counts closed calls
  return calls;
}

bool ChatTurnDecoder::emit(ChatDelta d) {
  if (d.empty() || cancelled_) return !cancelled_;
  if (!sink_(d)) cancelled_ = true;
  return !cancelled_;
}

void ChatTurnDecoder::finish() {
  ChatDelta d;
  parser_->finish(d);
  if (!d.content.empty()) d.content = stops_.push(d.content);
  d.content += stops_.flush();
  content_ += d.content;
  if (!pending_logprobs_.empty()) {
    d.logprobs = std::move(pending_logprobs_);
    pending_logprobs_ = nlohmann::json::array();
  }
  emit(std::move(d));
}

}  // namespace moesrv
