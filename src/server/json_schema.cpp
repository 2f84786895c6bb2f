#include "server/json_schema.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <map>
#include <stdexcept>

#include "server/json_matcher_phases.h"

namespace moesrv {

using nlohmann::json;

namespace {

std::string escaped_key(const std::string& k) {
  std::string q = json(k).dump(-1, ' ', false, json::error_handler_t::replace);
  return q.substr(1, q.size() - 2);
}

uint8_t type_bit(const std::string& t) {
  if (t == "string") return JsonSchema::kString;
  if (t == "integer") return JsonSchema::kInteger;
  if (t == "number") return JsonSchema::kNumber | JsonSchema::kInteger;
  if (t == "boolean") return JsonSchema::kBoolean;
  if (t == "null") return JsonSchema::kNull;
  if (t == "object") return JsonSchema::kObject;
  if (t == "array") return JsonSchema::kArray;
  throw std::invalid_argument("unknown type '" + t + "'");
}

int non_negative(const json& s, const char* key, int fallback) {
  auto it = s.find(key);
  if (it == s.end() || it->is_null()) return fallback;
  if (!it->is_number_integer() || it->get<int64_t>() < 0)
    throw std::invalid_argument(std::string("'") + key + "' must be a non-negative integer");
  return int(std::min<int64_t>(it->get<int64_t>(), 1 << 30));
}

}  // namespace

struct SchemaCompiler {
  JsonSchema& out;
  const json& root;
  std::map<std::string, int> refs;

  int add() {
    out.nodes_.emplace_back();
    return int(out.nodes_.size()) - 1;
  }

  const json& resolve(const std::string& ref) {
    if (ref == "#") return root;
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      std::string p = prefix;
      if (ref.compare(0, p.size(), p) == 0) {
        std::string section = p.substr(2, p.size() - 3), name = ref.substr(p.size());
        auto sec = root.find(section);
        if (sec != root.end() && sec->is_object() && sec->contains(name)) return (*sec)[name];
      }
    }
    throw std::invalid_argument("unresolvable $ref '" + ref + "'");
  }

  int compile(const json& s, int depth) {
    if (depth > 64) throw std::invalid_argument("schema nesting is too deep");
    if (s.is_boolean()) {
      if (s.get<bool>()) return 0;
      int n = add();
      out.nodes_[size_t(n)].types = 0;
      return n;
    }
    if (!s.is_object()) throw std::invalid_argument("a schema must be an object or a boolean");
    if (auto r = s.find("$ref"); r != s.end()) {
      if (!r->is_string()) throw std::invalid_argument("'$ref' must be a string");
      std::string ref = *r;
      if (auto it = refs.find(ref); it != refs.end()) return it->second;
      int n = add();  // reserved first: recursive schemas point back at it
      refs[ref] = n;
      int target = compile(resolve(ref), depth + 1);
      out.nodes_[size_t(n)] = out.nodes_[size_t(target)];
      return n;
    }
    for (const char* k : {"anyOf", "oneOf"}) {
      auto it = s.find(k);
      if (it == s.end()) continue;
      if (!it->is_array() || it->empty())
        throw std::invalid_argument(std::string("'") + k + "' must be a non-empty array");
      std::vector<int> branches;
      for (auto& b : *it) branches.push_back(compile(b, depth + 1));
      int n = add();
      JsonSchema::Node& node = out.nodes_[size_t(n)];
      node.types = 0;
      for (int b : branches) node.types |= out.nodes_[size_t(b)].types;
      node.any_of = std::move(branches);
      return n;
    }
    if (auto it = s.find("allOf"); it != s.end()) {
      if (!it->is_array() || it->empty()) throw std::invalid_argument("'allOf' must be a non-empty array");
      if (it->size() == 1) return compile((*it)[0], depth + 1);
    }
    int n = add();
    JsonSchema::Node node;
    if (auto t = s.find("type"); t != s.end() && !t->is_null()) {
      node.types = 0;
      if (t->is_string()) node.types = type_bit(*t);
      else if (t->is_array())
        for (auto& x : *t) {
          if (!x.is_string()) throw std::invalid_argument("'type' must be a string or a list of strings");
          node.types |= type_bit(x);
        }
      else throw std::invalid_argument("'type' must be a string or a list of strings");
    } else if (s.contains("properties")) {
      node.types = JsonSchema::kObject;
    } else if (s.contains("items")) {
      node.types = JsonSchema::kArray;
    }
    if (auto nb = s.find("nullable"); nb != s.end() && nb->is_boolean() && nb->get<bool>())
      node.types |= JsonSchema::kNull;
    auto add_enum = [&](const json& v) {
      node.enums.push_back(v.dump(-1, ' ', false, json::error_handler_t::replace));
    };
    if (auto e = s.find("enum"); e != s.end()) {
      if (!e->is_array() || e->empty()) throw std::invalid_argument("'enum' must be a non-empty array");
      for (auto& v : *e) add_enum(v);
    }
    if (auto c = s.find("const"); c != s.end()) add_enum(*c);
    std::sort(node.enums.begin(), node.enums.end());
    node.enums.erase(std::unique(node.enums.begin(), node.enums.end()), node.enums.end());
    if (node.enums.size() > 60000) throw std::invalid_argument("'enum' is too long");

    // Objects: declared properties only, unless the schema declares none or allows others explicitly.
    std::vector<std::pair<std::string, const json*>> props;
    if (auto p = s.find("properties"); p != s.end() && !p->is_null()) {
      if (!p->is_object()) throw std::invalid_argument("'properties' must be an object");
      for (auto& [k, v] : p->items()) props.push_back({escaped_key(k), &v});
    }
    static const json kAny = json::object();
    std::vector<std::string> required;
    if (auto r = s.find("required"); r != s.end() && !r->is_null()) {
      if (!r->is_array()) throw std::invalid_argument("'required' must be an array");
      for (auto& k : *r) {
        if (!k.is_string()) throw std::invalid_argument("'required' must list property names");
        required.push_back(escaped_key(k));
        bool declared = false;
        for (auto& [pk, _] : props) declared |= pk == required.back();
        if (!declared) props.push_back({required.back(), &kAny});
      }
    }
    std::sort(props.begin(), props.end(), [](auto& a, auto& b) { return a.first < b.first; });
    for (size_t i = 1; i < props.size(); ++i)
      if (props[i].first == props[i - 1].first) props.erase(props.begin() + long(i--));
    if (props.size() > 60000) throw std::invalid_argument("too many properties");
    node.additional = props.empty();
    if (auto a = s.find("additionalProperties"); a != s.end() && !a->is_null()) {
      if (a->is_boolean()) node.additional = a->get<bool>();
      else if (a->is_object()) node.additional = true;
      else throw std::invalid_argument("'additionalProperties' must be a boolean or a schema");
    }
    if (auto i = s.find("items"); i != s.end() && !i->is_null() && !i->is_array()) node.items = -1;
    node.min_items = non_negative(s, "minItems", 0);
    node.max_items = non_negative(s, "maxItems", -1);
    node.min_length = non_negative(s, "minLength", 0);
    node.max_length = non_negative(s, "maxLength", -1);
    if (node.max_items >= 0 && node.max_items < node.min_items) throw std::invalid_argument("maxItems < minItems");
    if (node.max_length >= 0 && node.max_length < node.min_length) throw std::invalid_argument("maxLength < minLength");
    for (auto& [k, v] : props) {
      node.keys.push_back(k);
      node.key_nodes.push_back(0);
    }
    for (size_t i = 0; i < node.keys.size() && i < 64; ++i)
      if (std::find(required.begin(), required.end(), node.keys[i]) != required.end())
        node.required |= uint64_t(1) << i;
    for (size_t i = 64; i < node.keys.size(); ++i)
      if (std::find(required.begin(), required.end(), node.keys[i]) != required.end())
        throw std::invalid_argument("at most 64 properties can be tracked as required");
    out.nodes_[size_t(n)] = node;
    // Children after the node is stored (compile() may grow nodes_).
    for (size_t i = 0; i < props.size(); ++i) {
      int child = compile(*props[i].second, depth + 1);
      out.nodes_[size_t(n)].key_nodes[i] = child;
    }
    if (auto a = s.find("additionalProperties"); a != s.end() && a->is_object()) {
      int child = compile(*a, depth + 1);
      out.nodes_[size_t(n)].additional_node = child;
    }
    if (auto i = s.find("items"); i != s.end() && i->is_object()) {
      int child = compile(*i, depth + 1);
      out.nodes_[size_t(n)].items = child;
    } else {
      out.nodes_[size_t(n)].items = 0;
    }
    return n;
  }
};

std::shared_ptr<const JsonSchema> JsonSchema::compile(const json& schema) {
  auto s = std::make_shared<JsonSchema>();
  s->nodes_.emplace_back();  // node 0: any value
  SchemaCompiler c{*s, schema, {}};
  try {
    s->root_ = c.compile(schema, 0);
  } catch (const nlohmann::json::exception& e) {  // a keyword of an unexpected JSON type
    throw std::invalid_argument(e.what());
  }
  if (s->nodes_.size() > 60000) throw std::invalid_argument("schema is too large");
  s->compute_min_chars();
  return s;
}

std::shared_ptr<const JsonSchema> JsonSchema::any_object() {
  static auto s = compile(json{{"type", "object"}});
  return s;
}

std::shared_ptr<const JsonSchema> JsonSchema::any_value() {
  static auto s = compile(json::object());
  return s;
}

bool json_value_is_text(const JsonSchema::Node& n) {
  if (!n.enums.empty()) {
    for (auto& e : n.enums)
      if (e.empty() || e[0] != '"') return false;
    return true;
  }
  uint8_t t = n.types;
  if (t == JsonSchema::kAnyType) return n.any_of.empty();
  return (t & JsonSchema::kString) && !(t & ~(JsonSchema::kString | JsonSchema::kNull));
}

int JsonSchema::key_index(const Node& n, const std::string& key) {
  auto it = std::lower_bound(n.keys.begin(), n.keys.end(), key);
  return it != n.keys.end() && *it == key ? int(it - n.keys.begin()) : -1;
}

// ---------------------------------------------------------------------------------------------------------------

namespace {
bool ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
bool digit(char c) { return c >= '0' && c <= '9'; }
}  // namespace

using namespace json_phases;

JsonMatcher::JsonMatcher(const JsonSchema* schema, int node, bool trailing_ws)
    : schema_(schema), trailing_ws_(trailing_ws) {
  Frame f;
  f.node = uint16_t(node);
  f.kind = kValue;
  stack_[0] = f;
  depth_ = 1;
}

bool JsonMatcher::push(Frame f) {
  if (depth_ >= kMaxDepth) return false;
  stack_[size_t(depth_++)] = f;
  return true;
}

bool JsonMatcher::complete() const {
  if (done_) return true;
  if (depth_ != 1) return false;
  const Frame& f = stack_[0];
  if (f.kind == kNumber) return f.phase == kZero || f.phase == kInt || f.phase == kFrac || f.phase == kExpDigits;
  if (f.kind == kEnum) return enum_done(f);
  return false;
}

int32_t JsonMatcher::free_string_room() const {
  if (!schema_ || depth_ == 0 || done_) return -1;
  const Frame& f = top();
  if (f.kind != kString || f.str_phase != kChars || f.utf8_need) return -1;
  const auto& n = schema_->node(f.node);
  return n.max_length < 0 ? INT32_MAX : int32_t(n.max_length) - int32_t(f.count);
}

bool JsonMatcher::enum_done(const Frame& f) const {
  const auto& e = schema_->node(f.node).enums;
  return f.lo < f.hi && e[f.lo].size() == f.off;
}

// Keeps the candidates (sorted) whose next character is `c`; with `obj`, only keys not given yet count.
bool JsonMatcher::narrow(const std::vector<std::string>& c, Frame& f, char ch, const Frame* obj) const {
  size_t lo = f.lo, hi = f.hi, off = f.off;
  while (lo < hi && (c[lo].size() <= off || c[lo][off] != ch)) {
    if (c[lo].size() > off && (unsigned char)c[lo][off] > (unsigned char)ch) return false;
    ++lo;
  }
  size_t h = lo;
  while (h < hi && c[h].size() > off && c[h][off] == ch) ++h;
  if (lo == h) return false;
  if (obj) {  // a prefix of used keys only does not count
    bool any = false;
    for (size_t i = lo; i < h && !any; ++i) any = key_free(*obj, i);
    if (!any) return false;
  }
  f.lo = uint16_t(lo), f.hi = uint16_t(h), f.off = uint16_t(off + 1);
  return true;
}

bool JsonMatcher::start_value(Frame& f, char c) {
  const JsonSchema::Node* n = &schema_->node(f.node);
  uint8_t cls = c == '"'                 ? JsonSchema::kString
                : c == '{'               ? JsonSchema::kObject
                : c == '['               ? JsonSchema::kArray
                : (c == 't' || c == 'f') ? JsonSchema::kBoolean
                : c == 'n'               ? JsonSchema::kNull
                : (c == '-' || digit(c)) ? uint8_t(JsonSchema::kInteger | JsonSchema::kNumber)
                                         : 0;
  if (!cls) return false;
  for (int hops = 0; !n->any_of.empty(); ++hops) {  // anyOf: the branch allowing this JSON type
    if (hops > 16) return false;
    int pick = -1;
    for (int b : n->any_of)
      if (schema_->node(b).types & cls) {
        pick = b;
        break;
      }
    if (pick < 0) return false;
    f.node = uint16_t(pick);
    n = &schema_->node(pick);
  }
  if (!(n->types & cls)) return false;
  if (!n->enums.empty()) {
    f.kind = kEnum;
    f.lo = 0, f.hi = uint16_t(n->enums.size()), f.off = 0;
    if (!narrow(n->enums, f, c, nullptr)) return false;
    if (enum_done(f) && f.hi - f.lo == 1) pop_done();
    return true;
  }
  switch (c) {
    case '{': f.kind = kObject, f.phase = kObjFirst, f.used = 0, f.lo = 0, f.hi = 0, f.off = 0; return true;
    case '[': f.kind = kArray, f.phase = kArrFirst, f.count = 0; return true;
    case '"': f.kind = kString, f.str_phase = kChars, f.count = 0, f.utf8_need = 0; return true;
    case 't':
    case 'f':
    case 'n': f.kind = kLiteral, f.lo = c == 't' ? 0 : c == 'f' ? 1 : 2, f.off = 1; return true;
    default:
      f.kind = kNumber, f.count = 0;
      if (c == '-') f.phase = kMinus;
      else if (c == '0') f.phase = kZero;
      else f.phase = kInt, f.count = 1;
      return true;
  }
}

// One character of string content (after the opening quote). `closed` is set on the closing quote.
bool JsonMatcher::string_char(Frame& f, char c, bool& closed) {
  unsigned char u = (unsigned char)c;
  closed = false;
  if (f.utf8_need) {
    if (u < f.utf8_lo || u > f.utf8_hi) return false;
    f.utf8_lo = 0x80, f.utf8_hi = 0xBF;
    --f.utf8_need;
    return true;
  }
  switch (f.str_phase) {
    case kEscape:
      if (c == 'u') {
        f.str_phase = kHex, f.hex_left = 4;
        return true;
      }
      if (c && std::strchr("\"\\/bfnrt", c)) {
        f.str_phase = kChars;
        return true;
      }
      return false;
    case kHex:
      if (!std::isxdigit(u)) return false;
      if (--f.hex_left == 0) f.str_phase = kChars;
      return true;
    default: break;
  }
  if (c == '"') {
    closed = true;
    return true;
  }
  if (u < 0x20) return false;
  if (c == '\\') {
    f.str_phase = kEscape;
    return true;
  }
  if (u < 0x80) return true;
  // UTF-8 lead byte: the ranges nlohmann::json (and RFC 3629) accept.
  if (u >= 0xC2 && u <= 0xDF) f.utf8_need = 1;
  else if (u == 0xE0) f.utf8_need = 2, f.utf8_lo = 0xA0;
  else if ((u >= 0xE1 && u <= 0xEC) || u == 0xEE || u == 0xEF) f.utf8_need = 2;
  else if (u == 0xED) f.utf8_need = 2, f.utf8_hi = 0x9F;
  else if (u == 0xF0) f.utf8_need = 3, f.utf8_lo = 0x90;
  else if (u >= 0xF1 && u <= 0xF3) f.utf8_need = 3;
  else if (u == 0xF4) f.utf8_need = 3, f.utf8_hi = 0x8F;
  else return false;
  return true;
}

void JsonMatcher::pop_done() {
  --depth_;
  if (depth_ == 0) {
    done_ = true;
    return;
  }
  Frame& p = top();
  if (p.kind == kObject) p.phase = kObjAfter;
  else if (p.kind == kArray) p.phase = kArrAfter, ++p.count;
}

bool JsonMatcher::any_key_left(const Frame& obj, const JsonSchema::Node& n) const {
  if (n.additional) return true;
  for (size_t i = 0; i < n.keys.size(); ++i)
    if (key_free(obj, i)) return true;
  return false;
}

bool JsonMatcher::feed(char c) {
  if (!schema_) return false;
  started_ = true;
  bool in_string = !done_ && depth_ > 0 &&
                   (top().kind == kString || (top().kind == kObject && top().phase == kObjKey) ||
                    (top().kind == kEnum && top().off > 0 && schema_->node(top().node).enums[top().lo][0] == '"'));
  if (!in_string && ws(c)) {
    if (++spaces_ > kMaxSpaces) return false;
  } else {
    spaces_ = 0;
  }
  if (done_) return trailing_ws_ && ws(c);
  return feed_frame(c);
}

bool JsonMatcher::feed_frame(char c) {
  Frame& f = top();
  const JsonSchema::Node& n = schema_->node(f.node);
  switch (f.kind) {
    case kValue:
      if (ws(c)) return true;
      return start_value(f, c);

    case kEnum: {
      if (narrow(n.enums, f, c, nullptr)) {
        if (enum_done(f) && f.hi - f.lo == 1) pop_done();
        return true;
      }
      if (!enum_done(f)) return false;  // e.g. 1 of [1, 12] followed by ','
      pop_done();
      return done_ ? trailing_ws_ && ws(c) : feed_frame(c);
    }

    case kLiteral: {
      const char* lit = kLiterals[f.lo];
      if (c != lit[f.off]) return false;
      if (!lit[++f.off]) pop_done();
      return true;
    }

    case kString: {
      bool was_char_start = f.str_phase == kChars && !f.utf8_need;
      bool closed = false;
      if (!string_char(f, c, closed)) return false;
      if (closed) {
        if (f.count < n.min_length) return false;
        pop_done();
        return true;
      }
      // Count characters at their first byte (escapes count once).
      if (was_char_start && ((unsigned char)c < 0x80 || f.utf8_need)) {
        if (n.max_length >= 0 && f.count >= n.max_length) return false;
        ++f.count;
      }
      return true;
    }

    case kNumber: {
      bool integer = !(n.types & JsonSchema::kNumber);
      auto finish = [&]() -> bool {
        if (f.phase != kZero && f.phase != kInt && f.phase != kFrac && f.phase != kExpDigits) return false;
        pop_done();
        return done_ ? trailing_ws_ && ws(c) : feed_frame(c);
      };
      switch (f.phase) {
        case kMinus:
          if (c == '0') {
            f.phase = kZero;
            return true;
          }
          if (digit(c)) {
            f.phase = kInt, f.count = 1;
            return true;
          }
          return false;
        case kZero:
        case kInt:
          if (digit(c) && f.phase == kInt) return ++f.count <= kMaxDigits;
          if (!integer && c == '.') {
            f.phase = kDot, f.count = 0;
            return true;
          }
          if (!integer && (c == 'e' || c == 'E')) {
            f.phase = kExp, f.count = 0;
            return true;
          }
          return finish();
        case kDot:
          if (digit(c)) {
            f.phase = kFrac, f.count = 1;
            return true;
          }
          return false;
        case kFrac:
          if (digit(c)) return ++f.count <= kMaxDigits;
          if (c == 'e' || c == 'E') {
            f.phase = kExp, f.count = 0;
            return true;
          }
          return finish();
        case kExp:
          if (c == '+' || c == '-') {
            f.phase = kExpSign;
            return true;
          }
          [[fallthrough]];
        case kExpSign:
          if (digit(c)) {
            f.phase = kExpDigits, f.count = 1;
            return true;
          }
          return false;
        case kExpDigits:
          if (digit(c)) return ++f.count <= 3;
          return finish();
      }
      return false;
    }

    case kArray:
      switch (f.phase) {
        case kArrFirst:
        case kArrNext:
          if (ws(c)) return true;
          if (c == ']' && f.phase == kArrFirst) {
            if (f.count < n.min_items) return false;
            pop_done();
            return true;
          }
          {
            Frame child;
            child.node = uint16_t(n.items);
            f.phase = kArrValue;
            if (!push(child)) return false;
            return feed_frame(c);
          }
        case kArrAfter:
          if (ws(c)) return true;
          if (c == ',') {
            if (n.max_items >= 0 && f.count >= n.max_items) return false;
            f.phase = kArrNext;
            return true;
          }
          if (c == ']') {
            if (f.count < n.min_items) return false;
            pop_done();
            return true;
          }
          return false;
      }
      return false;

    case kObject:
      switch (f.phase) {
        case kObjFirst:
        case kObjNextKey:
          if (ws(c)) return true;
          if (c == '}' && f.phase == kObjFirst) {
            if (n.required & ~f.used) return false;
            pop_done();
            return true;
          }
          if (c != '"') return false;
          f.phase = kObjKey;
          f.lo = 0, f.hi = uint16_t(n.keys.size()), f.off = 0;
          f.free_key = n.keys.empty();
          f.utf8_need = 0, f.str_phase = kChars;
          if (f.free_key && !n.additional) return false;
          return any_key_left(f, n);
        case kObjKey: {
          bool closed = false;
          if (!string_char(f, c, closed)) return false;
          if (closed) {
            int idx = -1;
            if (!f.free_key && f.lo < f.hi && n.keys[f.lo].size() == f.off) idx = f.lo;
            if (idx >= 0 && !key_free(f, size_t(idx))) idx = -1;
            if (idx < 0 && !n.additional) return false;
            f.key = int16_t(idx);
            if (idx >= 0 && idx < 64) f.used |= uint64_t(1) << idx;
            f.phase = kObjColon;
            return true;
          }
          if (!f.free_key) {
            Frame cand = f;
            if (narrow(n.keys, cand, c, &f)) {
              f.lo = cand.lo, f.hi = cand.hi, f.off = cand.off;
            } else if (n.additional) {
              f.free_key = true;
            } else {
              return false;
            }
          }
          return true;
        }
        case kObjColon:
          if (ws(c)) return true;
          if (c != ':') return false;
          f.phase = kObjValue;
          {
            Frame child;
            child.node = uint16_t(f.key >= 0 ? n.key_nodes[size_t(f.key)] : n.additional_node);
            return push(child);
          }
        case kObjAfter:
          if (ws(c)) return true;
          if (c == '}') {
            if (n.required & ~f.used) return false;
            pop_done();
            return true;
          }
          if (c == ',') {
            if (!any_key_left(f, n)) return false;
            f.phase = kObjNextKey;
            return true;
          }
          return false;
      }
      return false;
  }
  return false;
}

}  // namespace moesrv
