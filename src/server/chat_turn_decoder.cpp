#include "server/chat_turn_decoder.h"

#include <algorithm>

namespace moesrv {

ChatTurnDecoder::ChatTurnDecoder(const ChatCodec& codec, const VocabText& vocab, const ChatCompletionRequest& req,
                                 ChatTurnConfig cfg, Sink sink)
    : codec_(codec), vocab_(vocab), req_(req), cfg_(cfg), sink_(std::move(sink)),
      parser_(codec, &req.tool_specs, cfg.start_in_reasoning), m_(GlmMarkers::from(codec)),
      end_ids_(codec.end_of_turn_ids()), stops_(req.gen.stop) {
  bool constrain = cfg.strict_tools || req.tool_choice == ToolChoice::kRequired || req.tool_choice == ToolChoice::kNamed;
  if (constrain && !req.tool_specs.empty() && m_.tool_open >= 0 && m_.key_open >= 0) {
    std::vector<std::string> names;
    if (req.tool_choice == ToolChoice::kNamed) names.push_back(req.tool_choice_name);
    grammar_ = std::make_unique<ToolCallGrammar>(req.tool_specs, names, m_);
  }
  reasoned_ = cfg.start_in_reasoning;
}

std::optional<int32_t> ChatTurnDecoder::forced_token() {
  if (forced_.empty() && cfg_.reasoning_budget > 0 && parser_.mode() == GlmOutputParser::Mode::kReasoning &&
      reasoning_tokens_ >= cfg_.reasoning_budget) {
    for (int32_t t : codec_.encode("</think>")) forced_.push_back(t);
    budget_forced_ = true;
  }
  if (forced_.empty()) return std::nullopt;
  int32_t t = forced_.front();
  forced_.pop_front();
  return t;
}

const std::vector<uint8_t>* ChatTurnDecoder::allowed_tokens() {
  using Mode = GlmOutputParser::Mode;
  if (parser_.mode() == Mode::kToolCall) {
    if (!grammar_) return nullptr;
    grammar_->mask(gstate_, vocab_, mask_);
    return &mask_;
  }
  if (parser_.mode() != Mode::kContent || m_.tool_open < 0) return nullptr;
  bool must_call = (req_.tool_choice == ToolChoice::kRequired || req_.tool_choice == ToolChoice::kNamed) &&
                   parser_.tool_calls().empty();
  if (must_call) {  // only a tool call may follow (or the reasoning the model usually starts with)
    mask_.assign(vocab_.bytes.size(), 0);
    mask_[size_t(m_.tool_open)] = 1;
    if (!reasoned_ && m_.think_open >= 0) mask_[size_t(m_.think_open)] = 1;
    return &mask_;
  }
  if (req_.tool_choice == ToolChoice::kNone || req_.tool_specs.empty()) {
    mask_.assign(vocab_.bytes.size(), 1);
    mask_[size_t(m_.tool_open)] = 0;
    return &mask_;
  }
  return nullptr;
}

bool ChatTurnDecoder::on_token(int32_t id) {
  using Mode = GlmOutputParser::Mode;
  if (std::find(end_ids_.begin(), end_ids_.end(), id) != end_ids_.end()) return false;
  if (parser_.mode() == Mode::kReasoning) ++reasoning_tokens_;
  if (id == m_.think_open) reasoned_ = true;
  bool was_tool = parser_.mode() == Mode::kToolCall;
  ChatDelta d;
  parser_.push(id, d);
  if (grammar_ && was_tool) grammar_->advance(gstate_, id, vocab_);
  if (parser_.mode() == Mode::kToolCall && !was_tool) gstate_ = ToolCallGrammar::State{};
  if (!d.content.empty()) {
    d.content = stops_.push(d.content);
    content_ += d.content;
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
  parser_.finish(d);
  if (!d.content.empty()) d.content = stops_.push(d.content);
  d.content += stops_.flush();
  content_ += d.content;
  emit(std::move(d));
}

}  // namespace moesrv
