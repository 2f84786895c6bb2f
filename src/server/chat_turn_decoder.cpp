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
  gstate_ = grammar_.initial();
}

std::optional<int32_t> ChatTurnDecoder::forced_token() {
  if (cfg_.reasoning_budget > 0 && m_.think_close >= 0 && parser_->mode() == OutputParser::Mode::kReasoning &&
      reasoning_tokens_ + 1 >= cfg_.reasoning_budget) {
    budget_forced_ = true;
    return m_.think_close;  // the close itself is the budget's last token
  }
  return std::nullopt;
}

const std::vector<uint8_t>* ChatTurnDecoder::allowed_tokens() {
  if (broken_) return nullptr;
  grammar_.mask(gstate_, mask_);
  return &mask_;
}

void ChatTurnDecoder::on_sampled(std::span<const float> logits, int32_t id) {
  if (req_.logprobs.enabled && parser_->mode() == OutputParser::Mode::kContent && !codec_.is_special(id))
    last_logprob_ = logprob_entry(codec_, logits, id, req_.logprobs.top);
  else last_logprob_ = nullptr;
}

bool ChatTurnDecoder::on_token(int32_t id) {
  using Mode = OutputParser::Mode;
  if (!broken_ && !grammar_.advance(gstate_, id)) broken_ = true;  // unconstrained from here (never expected)
  if (m_.is_end(id)) return false;
  Mode before = parser_->mode();
  ChatDelta d;
  parser_->push(id, d);
  Mode after = parser_->mode();
  if (before == Mode::kReasoning || (after == Mode::kReasoning && before != Mode::kReasoning)) ++reasoning_tokens_;
  if (!last_logprob_.is_null() && before == Mode::kContent && after == Mode::kContent) {
    pending_logprobs_.push_back(last_logprob_);
    all_logprobs_.push_back(last_logprob_);
  }
  last_logprob_ = nullptr;
  if (!d.content.empty()) {
    d.content = stops_.push(d.content);
    content_ += d.content;
  }
  if (!d.content.empty() && !pending_logprobs_.empty()) {
    d.logprobs = std::move(pending_logprobs_);
    pending_logprobs_ = nlohmann::json::array();
  }
  if (!emit(std::move(d))) return false;
  return !stops_.hit();
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
