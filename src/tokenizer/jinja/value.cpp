#include "tokenizer/jinja/value.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "tokenizer/utf8.h"
#include "util/error.h"

namespace moesrv::jinja {

const Value* Object::find(const std::string& key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Object::set(const std::string& key, Value v) {
  for (auto& [k, old] : items)
    if (k == key) {
      old = std::move(v);
      return;
    }
  items.emplace_back(key, std::move(v));
}

namespace {
thread_local RenderMemory* g_memory = nullptr;

struct CountedString {  // a string value whose bytes count as render memory
  std::string s;
  size_t bytes;
  explicit CountedString(std::string&& v) : s(std::move(v)), bytes(s.capacity()) { RenderMemory::charge(bytes); }
  ~CountedString() { RenderMemory::release(bytes); }
  CountedString(const CountedString&) = delete;
  CountedString& operator=(const CountedString&) = delete;
};
}  // namespace

RenderMemory::RenderMemory() : outer_(g_memory) { g_memory = this; }
RenderMemory::~RenderMemory() { g_memory = outer_; }

void RenderMemory::charge(size_t bytes) {
  if (!g_memory) return;
  if (g_memory->live_ + int64_t(bytes) > kMaxLiveBytes)
    fail("jinja: the template's values would hold more than {} MiB at once", kMaxLiveBytes >> 20);
  g_memory->live_ += int64_t(bytes);
}

void RenderMemory::release(size_t bytes) {
  if (g_memory) g_memory->live_ -= int64_t(bytes);
}

Value::Value(std::string s) : type_(Type::String) {
  auto holder = std::allocate_shared<CountedString>(CountedAllocator<CountedString>(), std::move(s));
  s_ = std::shared_ptr<std::string>(holder, &holder->s);
}
Value::Value(Array a)
    : type_(Type::Array), arr_(std::allocate_shared<Array>(CountedAllocator<Array>(), std::move(a))) {}
Value::Value(Object o)
    : type_(Type::Object), obj_(std::allocate_shared<Object>(CountedAllocator<Object>(), std::move(o))) {}
Value::Value(Function f)
    : type_(Type::Function), fn_(std::allocate_shared<Function>(CountedAllocator<Function>(), std::move(f))) {}

namespace {
// Bytes of the code point at s[i]: its lead byte's sequence length, cut at the end; a stray byte is one.
size_t char_len(const std::string& s, size_t i) {
  return std::min(utf8::seq_len(static_cast<unsigned char>(s[i])), s.size() - i);
}
}  // namespace

size_t utf8_length(const std::string& s) {
  size_t count = 0, i = 0;
  while (i < s.size()) {
    uint64_t word;  // eight one-byte characters at a time
    if (s.size() - i >= 8 && (std::memcpy(&word, s.data() + i, 8), (word & 0x8080808080808080ull) == 0)) {
      i += 8;
      count += 8;
      continue;
    }
    i += char_len(s, i);
    ++count;
  }
  return count;
}

Utf8Index::Utf8Index(const std::string& s) : s_(s) {
  size_t count = utf8_length(s);
  if (count == s.size()) return;
  check_size(s.size(), UINT32_MAX, "indexing a string of bytes");
  starts_.reserve(count + 1);
  for (size_t i = 0; i < s.size(); i += char_len(s, i)) starts_.push_back(uint32_t(i));
  starts_.push_back(uint32_t(s.size()));
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return none();
    case nlohmann::ordered_json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned: return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Array a;
      a.reserve(j.size());
      for (const auto& e : j) a.push_back(from_json(e));
      return Value(std::move(a));
    }
    case nlohmann::ordered_json::value_t::object: {
      Object o;
      for (auto it = j.begin(); it != j.end(); ++it) o.items.emplace_back(it.key(), from_json(it.value()));
      return Value(std::move(o));
    }
    default: return Value();
  }
}

int64_t Value::as_int() const {
  if (type_ == Type::Float) return int64_t(f_);
  return i_;
}

double Value::as_double() const { return type_ == Type::Float ? f_ : double(i_); }

bool Value::truthy() const {
  switch (type_) {
    case Type::Undefined:
    case Type::None: return false;
    case Type::Bool:
    case Type::Int: return i_ != 0;
    case Type::Float: return f_ != 0;
    case Type::String: return !s_->empty();
    case Type::Array: return !arr_->empty();
    case Type::Object: return !obj_->items.empty();
    case Type::Function: return true;
  }
  return false;
}

namespace {

// Containers being written or compared on this thread: a template can make one hold itself ({% set ns.x = ns %},
// a list appended to itself), which repr shows as Python does ([...] / {...}), tojson refuses as json.dumps does, and
// comparisons answer by identity or refuse past kMaxNesting levels instead of recursing without end.
thread_local std::vector<const void*> g_open;
thread_local int g_nesting = 0;
constexpr int kMaxNesting = 512;

struct OpenContainer {  // marks a container open for the enclosing call; `cyclic`: it was already
  bool cyclic;
  explicit OpenContainer(const void* p) : cyclic(std::find(g_open.begin(), g_open.end(), p) != g_open.end()) {
    if (!cyclic) g_open.push_back(p);
  }
  ~OpenContainer() {
    if (!cyclic) g_open.pop_back();
  }
  OpenContainer(const OpenContainer&) = delete;
  OpenContainer& operator=(const OpenContainer&) = delete;
};

struct NestingLevel {  // one level of a recursive comparison
  NestingLevel() {
    if (++g_nesting > kMaxNesting) {
      --g_nesting;
      fail("jinja: values nested more than {} levels deep (a container that holds itself?)", kMaxNesting);
    }
  }
  ~NestingLevel() { --g_nesting; }
  NestingLevel(const NestingLevel&) = delete;
  NestingLevel& operator=(const NestingLevel&) = delete;
};

std::string python_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  std::string s = fmt::format("{}", d);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

std::string python_repr_string(const std::string& s) {
  char q = (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c == q) out += '\\';
        out += c;
    }
  }
  return out + q;
}

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    unsigned char c = s[i];
    switch (c) {
      case '"': out += "\\\""; ++i; continue;
      case '\\': out += "\\\\"; ++i; continue;
      case '\n': out += "\\n"; ++i; continue;
      case '\r': out += "\\r"; ++i; continue;
      case '\t': out += "\\t"; ++i; continue;
      case '\b': out += "\\b"; ++i; continue;
      case '\f': out += "\\f"; ++i; continue;
      default: break;
    }
    if (c < 0x20) {
      out += fmt::format("\\u{:04x}", c);
      ++i;
    } else if (c < 0x80 || !ensure_ascii) {
      out += char(c);
      ++i;
    } else {
      uint32_t cp = utf8::decode(s, i);
      if (cp >= 0x10000) {
        cp -= 0x10000;
        out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
      } else {
        out += fmt::format("\\u{:04x}", cp);
      }
    }
  }
  out += '"';
}

struct JsonWriter {
  int indent;
  bool ensure_ascii, sort_keys;
  std::string item_sep, key_sep;
  std::string out;

  void newline(int depth) {
    out += '\n';
    out.append(size_t(indent * depth), ' ');
  }
  void write(const Value& v, int depth) {
    check_size(out.size(), kMaxStringBytes, "JSON of bytes");  // (a list holding one big list many times)
    switch (v.type()) {
      case Value::Type::Undefined:
      case Value::Type::None: out += "null"; return;
      case Value::Type::Bool: out += v.as_bool() ? "true" : "false"; return;
      case Value::Type::Int: out += std::to_string(v.as_int()); return;
      case Value::Type::Float: {
        double d = v.as_double();
        out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : python_float(d);
        return;
      }
      case Value::Type::String: json_string(out, v.str(), ensure_ascii); return;
      case Value::Type::Function: fail("tojson: cannot serialize a function");
      case Value::Type::Array: {
        const Array& a = v.array();
        const OpenContainer open(&a);
        if (open.cyclic) fail("tojson: circular reference detected");
        if (a.empty()) {
          out += "[]";
          return;
        }
        out += '[';
        for (size_t i = 0; i < a.size(); ++i) {
          if (i) out += indent >= 0 ? rtrim(item_sep) : item_sep;
          if (indent >= 0) newline(depth + 1);
          write(a[i], depth + 1);
        }
        if (indent >= 0) newline(depth);
        out += ']';
        return;
      }
      case Value::Type::Object: {
        const OpenContainer open(&v.object());
        if (open.cyclic) fail("tojson: circular reference detected");
        auto items = v.object().items;
        if (items.empty()) {
          out += "{}";
          return;
        }
        if (sort_keys) std::stable_sort(items.begin(), items.end(), [](auto& a, auto& b) { return a.first < b.first; });
        out += '{';
        for (size_t i = 0; i < items.size(); ++i) {
          if (i) out += indent >= 0 ? rtrim(item_sep) : item_sep;
          if (indent >= 0) newline(depth + 1);
          json_string(out, items[i].first, ensure_ascii);
          out += key_sep;
          write(items[i].second, depth + 1);
        }
        if (indent >= 0) newline(depth);
        out += '}';
        return;
      }
    }
  }
  static std::string rtrim(std::string s) {
    while (!s.empty() && s.back() == ' ') s.pop_back();
    return s;
  }
};

}  // namespace

std::string Value::to_str() const {
  switch (type_) {
    case Type::Undefined: return "";
    case Type::None: return "None";
    case Type::Bool: return i_ ? "True" : "False";
    case Type::Int: return std::to_string(i_);
    case Type::Float: return python_float(f_);
    case Type::String: return *s_;
    default: return repr();
  }
}

std::string Value::repr() const {
  switch (type_) {
    case Type::String: return python_repr_string(*s_);
    case Type::Array: {
      const OpenContainer open(arr_.get());
      if (open.cyclic) return "[...]";
      std::string out = "[";
      for (size_t i = 0; i < arr_->size(); ++i) {
        out += (i ? ", " : "") + (*arr_)[i].repr();
        check_size(out.size(), kMaxStringBytes, "a printed list of bytes");
      }
      return out + "]";
    }
    case Type::Object: {
      const OpenContainer open(obj_.get());
      if (open.cyclic) return "{...}";
      std::string out = "{";
      for (size_t i = 0; i < obj_->items.size(); ++i) {
        out += (i ? ", " : "") + python_repr_string(obj_->items[i].first) + ": " + obj_->items[i].second.repr();
        check_size(out.size(), kMaxStringBytes, "a printed mapping of bytes");
      }
      return out + "}";
    }
    case Type::Function: return "<function>";
    default: return to_str();
  }
}

std::string Value::to_json(int indent, bool ensure_ascii, const std::string& item_sep, const std::string& key_sep,
                           bool sort_keys) const {
  JsonWriter w{indent, ensure_ascii, sort_keys, item_sep, key_sep, {}};
  w.write(*this, 0);
  return std::move(w.out);
}

std::string Value::type_name() const {
  static const char* names[] = {"undefined", "none", "bool", "int", "float", "string", "list", "dict", "function"};
  return names[int(type_)];
}

Value Value::get(const std::string& key) const {
  if (type_ == Type::Object)
    if (const Value* v = obj_->find(key)) return *v;
  return Value();
}

Value Value::get(const Value& key) const {
  if (type_ == Type::Object && key.is_string()) return get(key.str());
  if ((type_ == Type::Array || type_ == Type::String) && (key.is_int() || key.is_bool())) {
    int64_t i = key.as_int();
    if (type_ == Type::Array) {
      int64_t n = int64_t(arr_->size());
      if (i < 0) i += n;
      return (i >= 0 && i < n) ? (*arr_)[i] : Value();
    }
    Utf8Index chars(*s_);
    int64_t n = int64_t(chars.size());
    if (i < 0) i += n;
    return (i >= 0 && i < n) ? Value(std::string(chars.at(size_t(i)))) : Value();
  }
  return Value();
}

Array Value::iterate() const {
  switch (type_) {
    case Type::Array: return *arr_;
    case Type::Object: {
      Array keys;
      for (const auto& kv : obj_->items) keys.emplace_back(kv.first);
      return keys;
    }
    case Type::String: {
      check_size(s_->size(), kMaxItems, "iterating a string of");
      const Utf8Index chars(*s_);
      Array out;
      out.reserve(chars.size());
      for (size_t i = 0; i < chars.size(); ++i) out.emplace_back(std::string(chars.at(i)));
      return out;
    }
    case Type::Undefined:
    case Type::None: return {};
    default: fail("jinja: '{}' is not iterable", type_name());
  }
}

int64_t Value::length() const {
  switch (type_) {
    case Type::Array: return int64_t(arr_->size());
    case Type::Object: return int64_t(obj_->items.size());
    case Type::String: return int64_t(utf8_length(*s_));
    case Type::Undefined: return 0;
    default: fail("jinja: object of type '{}' has no length", type_name());
  }
}

bool operator==(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.as_double() == b.as_double();
  if (a.is_bool() || b.is_bool()) {
    if ((a.is_bool() || a.is_int()) && (b.is_bool() || b.is_int())) return a.as_int() == b.as_int();
    return false;
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case Value::Type::Undefined:
    case Value::Type::None: return true;
    case Value::Type::String: return a.str() == b.str();
    case Value::Type::Array: {
      if (&a.array() == &b.array()) return true;  // (Python compares a container with itself by identity)
      const NestingLevel level;
      return a.array() == b.array();
    }
    case Value::Type::Object: {
      if (&a.object() == &b.object()) return true;
      const NestingLevel level;
      const auto &x = a.object().items, &y = b.object().items;
      if (x.size() != y.size()) return false;
      for (const auto& [k, v] : x) {
        const Value* o = b.object().find(k);
        if (!o || !(*o == v)) return false;
      }
      return true;
    }
    default: return false;
  }
}

int Value::compare(const Value& a, const Value& b) {
  if ((a.is_number() || a.is_bool()) && (b.is_number() || b.is_bool())) {
    double x = a.as_double(), y = b.as_double();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) return a.str().compare(b.str()) < 0 ? -1 : a.str() == b.str() ? 0 : 1;
  if (a.is_array() && b.is_array()) {
    const Array &x = a.array(), &y = b.array();
    if (&x == &y) return 0;
    const NestingLevel level;
    for (size_t i = 0; i < std::min(x.size(), y.size()); ++i)
      if (int c = compare(x[i], y[i])) return c;
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  fail("jinja: cannot compare '{}' with '{}'", a.type_name(), b.type_name());
}

void check_size(size_t n, size_t limit, const char* what) {
  if (n > limit) fail("jinja: {} {} (more than the limit of {})", what, n, limit);
}

}  // namespace moesrv::jinja
