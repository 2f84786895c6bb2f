// JSON Schema (the subset tool parameters and response_format use) compiled to a node graph, and a
// character-level matcher that accepts exactly the JSON texts valid under it. The matcher state is a fixed-size
// value (no heap), so constrained decoding can copy it per candidate token cheaply.
//
// Supported: type (string or list), enum, const, properties, required, additionalProperties (bool or schema),
// items, minItems/maxItems, minLength/maxLength, anyOf/oneOf (the branch is chosen by the value's JSON type),
// $ref to "#/$defs/..", "#/definitions/.." or "#". Numbers: at most 15 integer and 15 fraction digits.
// Other keywords (pattern, minimum, format, ...) are accepted and not enforced.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moesrv {

class JsonSchema {
 public:
  enum Type : uint8_t { kString = 1, kInteger = 2, kNumber = 4, kBoolean = 8, kNull = 16, kObject = 32, kArray = 64 };
  static constexpr uint8_t kAnyType = 127;

  struct Node {
    uint8_t types = kAnyType;
    std::vector<std::string> enums;  // JSON texts of allowed values, sorted; empty: no enum
    // object
    std::vector<std::string> keys;  // JSON-escaped property names (no quotes), sorted
    std::vector<int> key_nodes;     // node of each key's value
    uint64_t required = 0;          // bit per key (the first 64 keys)
    bool additional = true;         // keys other than `keys` allowed
    int additional_node = 0;        // their value schema
    // array
    int items = 0;
    int min_items = 0, max_items = -1;
    // string
    int min_length = 0, max_length = -1;
    // anyOf: branches by JSON type (first branch allowing that type wins)
    std::vector<int> any_of;
    uint32_t min_chars = 0;  // characters of the shortest valid value (kFar: none)
  };
  static constexpr uint32_t kFar = 1u << 24;  // "no way to complete" for character counts

  // Throws std::invalid_argument naming what is wrong.
  static std::shared_ptr<const JsonSchema> compile(const nlohmann::json& schema);
  // Any JSON object (response_format json_object) / any JSON value.
  static std::shared_ptr<const JsonSchema> any_object();
  static std::shared_ptr<const JsonSchema> any_value();

  const Node& node(int i) const { return nodes_[size_t(i)]; }
  int root() const { return root_; }
  // Index of `key` (JSON-escaped) in node.keys, -1 if absent.
  static int key_index(const Node& n, const std::string& key);

 private:
  friend struct SchemaCompiler;
  void compute_min_chars();  // fills Node::min_chars (json_closing.cpp)
  std::vector<Node> nodes_;  // node 0: any value
  int root_ = 0;
};

// GLM writes argument values of this schema as raw text (strings, untyped values, string enums); others as JSON.
bool json_value_is_text(const JsonSchema::Node& n);

class JsonMatcher {
 public:
  JsonMatcher() = default;
  // Matches one value of `node`. trailing_ws: whitespace after the value is accepted.
  JsonMatcher(const JsonSchema* schema, int node, bool trailing_ws = true);
  bool feed(char c);      // false: `c` cannot continue a valid text (the state is then unspecified)
  bool complete() const;  // what was fed is a whole value (more may still follow, e.g. digits)
  bool started() const { return started_; }
  bool valid() const { return schema_ != nullptr; }
  // When the matcher is inside a string whose content is free (no enum or key constraint) and at a character
  // boundary: how many more characters it may hold (INT32_MAX: unbounded). -1 otherwise.
  int32_t free_string_room() const;
  // Characters that must still be written, at least, to complete the value (JsonSchema::kFar: it cannot be).
  uint32_t chars_to_complete() const;

  static constexpr int kMaxDepth = 24;
  static constexpr int kMaxSpaces = 16;
  static constexpr int kMaxDigits = 15;

 private:
  enum Kind : uint8_t { kValue, kObject, kArray, kString, kNumber, kLiteral, kEnum };
  struct Frame {
    uint16_t node = 0;
    Kind kind = kValue;
    uint8_t phase = 0;
    uint16_t lo = 0, hi = 0, off = 0;  // candidate range (enum literals or keys) and characters typed
    uint16_t count = 0;                // array items / string characters / digits
    uint64_t used = 0;                 // object: keys given
    int16_t key = -1;                  // object: the key whose value is being read (-1: additional)
    uint8_t str_phase = 0;             // string lexing: characters, escape, \u digits
    uint8_t utf8_need = 0, utf8_lo = 0x80, utf8_hi = 0xBF, hex_left = 0;
    bool free_key = false;  // object key not among the declared ones (additional allowed)
  };
  bool feed_frame(char c);
  bool start_value(Frame& f, char c);
  bool string_char(Frame& f, char c, bool& closed);
  bool narrow(const std::vector<std::string>& cands, Frame& f, char c, const Frame* obj) const;
  bool enum_done(const Frame& f) const;
  static bool key_free(const Frame& obj, size_t idx) { return idx >= 64 || !(obj.used >> idx & 1); }
  bool any_key_left(const Frame& obj, const JsonSchema::Node& n) const;
  uint32_t frame_rest(const Frame& f, bool top) const;  // json_closing.cpp
  void pop_done();
  Frame& top() { return stack_[size_t(depth_ - 1)]; }
  const Frame& top() const { return stack_[size_t(depth_ - 1)]; }
  bool push(Frame f);

  const JsonSchema* schema_ = nullptr;
  std::array<Frame, kMaxDepth> stack_{};
  int8_t depth_ = 0;
  bool done_ = false, started_ = false, trailing_ws_ = true;
  uint8_t spaces_ = 0;
};

}  // namespace moesrv
