// Runtime values of the Jinja interpreter, with Python-like semantics (arrays and objects are
// shared references, objects keep insertion order, str()/repr()/json.dumps formatting).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace moesrv::jinja {

// Memory that values hold during a render (lists, mappings, strings, functions), counted on this thread while a
// RenderMemory lives: a template that would hold more than kMaxLiveBytes at once fails (a list extended by itself
// in a loop, many large ranges) instead of exhausting the host. Nothing is counted outside a render; memory freed
// in a render that it did not count only makes room.
constexpr int64_t kMaxLiveBytes = int64_t(512) << 20;
class RenderMemory {
 public:
  RenderMemory();
  ~RenderMemory();
  RenderMemory(const RenderMemory&) = delete;
  RenderMemory& operator=(const RenderMemory&) = delete;
  static void charge(size_t bytes);  // fails past kMaxLiveBytes
  static void release(size_t bytes);

 private:
  RenderMemory* outer_;
  int64_t live_ = 0;
};

// std::allocator that charges RenderMemory for what it hands out.
template <class T>
struct CountedAllocator {
  using value_type = T;
  CountedAllocator() = default;
  template <class U>
  CountedAllocator(const CountedAllocator<U>&) {}
  T* allocate(size_t n) {
    RenderMemory::charge(n * sizeof(T));
    try {
      return std::allocator<T>().allocate(n);
    } catch (...) {
      RenderMemory::release(n * sizeof(T));
      throw;
    }
  }
  void deallocate(T* p, size_t n) {
    RenderMemory::release(n * sizeof(T));
    std::allocator<T>().deallocate(p, n);
  }
  friend bool operator==(const CountedAllocator&, const CountedAllocator&) { return true; }
};

class Value;
using Array = std::vector<Value, CountedAllocator<Value>>;
using KwArgs = std::vector<std::pair<std::string, Value>>;
using Function = std::function<Value(std::vector<Value>& args, KwArgs& kwargs)>;

struct Object {
  std::vector<std::pair<std::string, Value>, CountedAllocator<std::pair<std::string, Value>>> items;
  const Value* find(const std::string& key) const;
  void set(const std::string& key, Value v);
};

class Value {
 public:
  enum class Type { Undefined, None, Bool, Int, Float, String, Array, Object, Function };

  Value() = default;  // undefined
  static Value none() { Value v; v.type_ = Type::None; return v; }
  Value(bool b) : type_(Type::Bool), i_(b) {}
  Value(int v) : type_(Type::Int), i_(v) {}
  Value(int64_t v) : type_(Type::Int), i_(v) {}
  Value(double v) : type_(Type::Float), f_(v) {}
  // (each counted by RenderMemory)
  Value(std::string s);
  Value(const char* s) : Value(std::string(s)) {}
  Value(Array a);
  Value(Object o);
  Value(Function f);
  static Value from_json(const nlohmann::ordered_json& j);

  Type type() const { return type_; }
  bool is_undefined() const { return type_ == Type::Undefined; }
  bool is_none() const { return type_ == Type::None; }
  bool is_bool() const { return type_ == Type::Bool; }
  bool is_int() const { return type_ == Type::Int; }
  bool is_number() const { return type_ == Type::Int || type_ == Type::Float; }
  bool is_string() const { return type_ == Type::String; }
  bool is_array() const { return type_ == Type::Array; }
  bool is_object() const { return type_ == Type::Object; }
  bool is_function() const { return type_ == Type::Function; }

  bool as_bool() const { return i_ != 0; }
  int64_t as_int() const;  // ints, bools, floats (truncated)
  double as_double() const;
  const std::string& str() const { return *s_; }
  Array& array() const { return *arr_; }
  Object& object() const { return *obj_; }
  const Function& function() const { return *fn_; }

  bool truthy() const;
  // Python str(): what {{ value }} prints.
  std::string to_str() const;
  // Python repr() (used inside containers).
  std::string repr() const;
  // json.dumps(value, ensure_ascii, indent, separators=(item_sep, key_sep), sort_keys).
  std::string to_json(int indent = -1, bool ensure_ascii = false, const std::string& item_sep = ", ",
                      const std::string& key_sep = ": ", bool sort_keys = false) const;
  std::string type_name() const;

  // Attribute / item access; undefined when missing.
  Value get(const std::string& key) const;
  Value get(const Value& key) const;
  // Elements of an iterable (array items, object keys, string characters).
  Array iterate() const;
  int64_t length() const;

  friend bool operator==(const Value& a, const Value& b);
  friend bool operator!=(const Value& a, const Value& b) { return !(a == b); }
  // Ordering for numbers and strings; throws on other types.
  static int compare(const Value& a, const Value& b);

 private:
  Type type_ = Type::Undefined;
  int64_t i_ = 0;
  double f_ = 0;
  std::shared_ptr<std::string> s_;
  std::shared_ptr<Array> arr_;
  std::shared_ptr<Object> obj_;
  std::shared_ptr<Function> fn_;
};

// The number of code points of a UTF-8 string, split as Utf8Index splits it.
size_t utf8_length(const std::string& s);

// The code points of a UTF-8 string by index (each as long as its lead byte's sequence says, cut at the end; a stray
// byte is one), without a string per code point: a string of one-byte code points is indexed by byte, any other
// keeps a 4-byte offset per code point. Holds `s` by reference.
class Utf8Index {
 public:
  explicit Utf8Index(const std::string& s);
  size_t size() const { return starts_.empty() ? s_.size() : starts_.size() - 1; }
  std::string_view at(size_t i) const {
    if (starts_.empty()) return std::string_view(s_).substr(i, 1);
    return std::string_view(s_).substr(starts_[i], starts_[i + 1] - starts_[i]);
  }

 private:
  const std::string& s_;
  std::vector<uint32_t> starts_;  // code point i: bytes [starts_[i], starts_[i + 1]); empty when each is one byte
};

// Limits that keep a hostile template (from a model package or a request) from exhausting memory: a string value or
// the rendered output of at most kMaxStringBytes, a list (range, a string's characters) of at most kMaxItems.
constexpr size_t kMaxStringBytes = size_t(64) << 20;
constexpr size_t kMaxItems = size_t(1) << 20;
// Fails naming `what` when `n` exceeds `limit`.
void check_size(size_t n, size_t limit, const char* what);

}  // namespace moesrv::jinja
