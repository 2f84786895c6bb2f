// OpenAI `stop` sequences over streamed text: holds back text that might begin a stop sequence and cuts
// the output where one appears.
#pragma once
#include <string>
#include <vector>

namespace moesrv {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  // Adds text; returns what can be emitted now. After a hit, nothing more is accepted.
  std::string push(const std::string& text);
  std::string flush();  // end of generation: release held-back text
  bool hit() const { return hit_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool hit_ = false;
};

inline std::string StopMatcher::push(const std::string& text) {
  if (hit_) return "";
  held_ += text;
  if (stops_.empty()) return std::move(held_);
  size_t cut = std::string::npos;
  for (auto& s : stops_) cut = std::min(cut, held_.find(s));
  if (cut != std::string::npos) {
    hit_ = true;
    std::string out = held_.substr(0, cut);
    held_.clear();
    return out;
  }
  size_t keep = 0;  // longest suffix of held_ that is a proper prefix of a stop sequence
  for (auto& s : stops_)
    for (size_t k = std::min(s.size() - 1, held_.size()); k > keep; --k)
      if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
        keep = k;
        break;
      }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

inline std::string StopMatcher::flush() {
  std::string out;
  if (!hit_) out.swap(held_);
  return out;
}

}  // namespace moesrv
