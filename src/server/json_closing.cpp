// How far a JSON value is from complete: the shortest valid value of each schema node, and the characters a
// JsonMatcher must still see to finish its value. Constrained decoding uses them to close a value (a tool call's
// arguments, JSON content) within the tokens left.
#include <algorithm>
#include <cstring>

#include "server/json_matcher_phases.h"
#include "server/json_schema.h"

namespace moesrv {

using namespace json_phases;

namespace {
constexpr uint64_t kFar = JsonSchema::kFar;
uint64_t cap(uint64_t v) { return std::min(v, kFar); }
bool free_key(uint64_t used, size_t k) { return k >= 64 || !(used >> k & 1); }
}  // namespace

void JsonSchema::compute_min_chars() {
  for (auto& n : nodes_) n.min_chars = uint32_t(kFar);
  auto shortest = [&](const Node& n) -> uint64_t {
    if (!n.any_of.empty()) {
      uint64_t best = kFar;
      for (int b : n.any_of) best = std::min<uint64_t>(best, nodes_[size_t(b)].min_chars);
      return best;
    }
    if (!n.enums.empty()) {
      uint64_t best = kFar;
      for (auto& e : n.enums) best = std::min<uint64_t>(best, e.size());
      return best;
    }
    uint64_t best = kFar;
    if (n.types & (kNull | kBoolean)) best = std::min<uint64_t>(best, 4);  // null, true
    if (n.types & (kInteger | kNumber)) best = std::min<uint64_t>(best, 1);
    if (n.types & kString) best = std::min<uint64_t>(best, 2 + uint64_t(n.min_length));
    if (n.types & kArray) {
      uint64_t item = nodes_[size_t(n.items)].min_chars, k = uint64_t(n.min_items);
      best = std::min(best, cap(2 + (k ? k * item + k - 1 : 0)));
    }
    if (n.types & kObject) {
      uint64_t sum = 2, count = 0;
      for (size_t k = 0; k < n.keys.size() && k < 64; ++k)
        if (n.required >> k & 1) sum += 3 + n.keys[k].size() + nodes_[size_t(n.key_nodes[k])].min_chars, ++count;
      best = std::min(best, cap(sum + (count ? count - 1 : 0)));
    }
    return best;
  };
  // Recursive schemas: relax until nothing shrinks (each pass settles at least one more node).
  for (size_t pass = 0; pass <= nodes_.size(); ++pass) {
    bool changed = false;
    for (auto& n : nodes_) {
      uint32_t v = uint32_t(cap(shortest(n)));
      if (v < n.min_chars) n.min_chars = v, changed = true;
    }
    if (!changed) break;
  }
}

uint32_t JsonMatcher::chars_to_complete() const {
  if (!schema_) return uint32_t(kFar);
  if (done_) return 0;
  uint64_t total = 0;
  for (int i = depth_ - 1; i >= 0; --i) total += frame_rest(stack_[size_t(i)], i == depth_ - 1);
  return uint32_t(cap(total));
}

// Characters that finish frame `f`; below the top, the frame's current child is taken as complete.
uint32_t JsonMatcher::frame_rest(const Frame& f, bool top) const {
  const JsonSchema::Node& n = schema_->node(f.node);
  auto value_min = [&](int node) -> uint64_t { return schema_->node(node).min_chars; };
  switch (f.kind) {
    case kValue: return n.min_chars;
    case kEnum: {
      uint64_t best = kFar;
      for (size_t i = f.lo; i < f.hi; ++i) best = std::min<uint64_t>(best, n.enums[i].size() - f.off);
      return uint32_t(best);
    }
    case kLiteral: return uint32_t(std::strlen(kLiterals[f.lo]) - f.off);
    case kString: {
      uint64_t pending = f.utf8_need + (f.str_phase == kEscape ? 1 : f.str_phase == kHex ? f.hex_left : 0);
      return uint32_t(pending + uint64_t(std::max(0, n.min_length - int(f.count))) + 1);
    }
    case kNumber: {
      bool needs_digit = f.phase == kMinus || f.phase == kDot || f.phase == kExp || f.phase == kExpSign;
      return needs_digit ? 1 : 0;
    }
    case kArray: {
      uint64_t item = value_min(n.items);
      int count = f.count + (!top && f.phase == kArrValue ? 1 : 0);
      int need = std::max(0, n.min_items - count);
      if (f.phase == kArrFirst) return uint32_t(cap(need ? need * item + uint64_t(need) - 1 + 1 : 1));
      if (f.phase == kArrNext) {
        need = std::max(need, 1);
        return uint32_t(cap(need * item + uint64_t(need) - 1 + 1));
      }
      return uint32_t(cap(need * (item + 1) + 1));
    }
    case kObject: break;
  }
  // Objects: the required keys not given yet, each `"key":value`, with commas, then '}'.
  auto entry = [&](size_t k) { return 3 + n.keys[k].size() + value_min(n.key_nodes[k]); };
  auto missing = [&](uint64_t used, uint64_t& sum) {
    uint64_t count = 0;
    sum = 0;
    for (size_t k = 0; k < n.keys.size() && k < 64; ++k)
      if ((n.required >> k & 1) && !(used >> k & 1)) sum += entry(k), ++count;
    return count;
  };
  auto after = [&](uint64_t used) {  // from after a member: ", more" then '}'
    uint64_t sum = 0, count = missing(used, sum);
    return cap(sum + count + 1);
  };
  auto fresh = [&](uint64_t used) {  // from where a member must or may start: members, commas between, '}'
    uint64_t sum = 0, count = missing(used, sum);
    return cap(sum + (count ? count - 1 : 0) + 1);
  };
  auto key_node = [&](int key) { return key >= 0 ? n.key_nodes[size_t(key)] : n.additional_node; };
  switch (f.phase) {
    case kObjFirst: return uint32_t(fresh(f.used));
    case kObjColon: return uint32_t(cap(1 + value_min(key_node(f.key)) + after(f.used)));
    case kObjValue:
    case kObjAfter: return uint32_t(after(f.used));
    case kObjNextKey: {
      uint64_t sum = 0;
      if (missing(f.used, sum)) return uint32_t(fresh(f.used));
      uint64_t best = n.additional ? 3 + value_min(n.additional_node) : kFar;  // "":value
      for (size_t k = 0; k < n.keys.size(); ++k)
        if (free_key(f.used, k)) best = std::min(best, entry(k));
      return uint32_t(cap(best + 1));
    }
    case kObjKey: {
      uint64_t pending = f.utf8_need + (f.str_phase == kEscape ? 1 : f.str_phase == kHex ? f.hex_left : 0);
      uint64_t best = n.additional ? 2 + value_min(n.additional_node) + after(f.used) : kFar;  // a key of its own
      if (!f.free_key)
        for (size_t k = f.lo; k < f.hi; ++k)
          if (free_key(f.used, k)) {
            uint64_t used = k < 64 ? f.used | uint64_t(1) << k : f.used;
            best = std::min(best, n.keys[k].size() - f.off + 2 + value_min(n.key_nodes[k]) + after(used));
          }
      return uint32_t(cap(pending + best));
    }
    default: return uint32_t(kFar);
  }
}

}  // namespace moesrv
