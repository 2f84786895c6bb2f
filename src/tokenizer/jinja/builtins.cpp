#include "tokenizer/jinja/builtins.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>

#include "tokenizer/jinja/interpreter.h"
#include "util/error.h"

namespace moesrv::jinja {
namespace {

bool is_py_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

const Value& arg(std::vector<Value>& args, KwArgs& kwargs, size_t pos, const char* name, const Value& def) {
  for (auto& [k, v] : kwargs)
    if (k == name) return v;
  return pos < args.size() ? args[pos] : def;
}

const std::string& need_str(const Value& v, const char* what) {
  if (!v.is_string()) fail("jinja: {} expects a string, got {}", what, v.type_name());
  return v.str();
}

std::vector<std::string> py_split(const std::string& s, const Value& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep.is_none() || sep.is_undefined()) {  // split on whitespace runs
    size_t i = 0;
    while (i < s.size()) {
      while (i < s.size() && is_py_space(s[i])) ++i;
      if (i >= s.size()) break;
      if (maxsplit >= 0 && int64_t(out.size()) == maxsplit) {
        std::string rest = s.substr(i);
        while (!rest.empty() && is_py_space(rest.back())) rest.pop_back();
        out.push_back(rest);
        return out;
      }
      size_t j = i;
      while (j < s.size() && !is_py_space(s[j])) ++j;
      out.push_back(s.substr(i, j - i));
      i = j;
    }
    return out;
  }
  const std::string& d = need_str(sep, "split");
  if (d.empty()) fail("jinja: split with empty separator");
  size_t start = 0, pos;
  while ((maxsplit < 0 || int64_t(out.size()) < maxsplit) && (pos = s.find(d, start)) != std::string::npos) {
    out.push_back(s.substr(start, pos - start));
    start = pos + d.size();
  }
  out.push_back(s.substr(start));
  return out;
}

Array to_values(const std::vector<std::string>& v) {
  Array a;
  for (const auto& s : v) a.emplace_back(s);
  return a;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to, int64_t count = -1) {
  if (from.empty()) return s;
  size_t pos = 0;
  for (int64_t n = 0; (count < 0 || n < count) && (pos = s.find(from, pos)) != std::string::npos; ++n) {
    s.replace(pos, from.size(), to);
    pos += to.size();
  }
  return s;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// Attribute lookup with dotted paths ("function.name"), as selectattr/map/sort use.
Value attr_path(const Value& v, const std::string& path) {
  Value cur = v;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
    cur = numeric && cur.is_array() ? cur.get(Value(int64_t(std::stoll(part)))) : cur.get(part);
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
}

std::string capitalize(const std::string& s) {
  std::string r = s;
  std::transform(r.begin(), r.end(), r.begin(), ::tolower);
  if (!r.empty()) r[0] = char(::toupper(r[0]));
  return r;
}

std::string title(const std::string& s) {
  std::string r = s;
  bool start = true;
  for (char& c : r) {
    if (std::isalpha(static_cast<unsigned char>(c))) {
      c = start ? char(::toupper(c)) : char(::tolower(c));
      start = false;
    } else {
      start = !std::isdigit(static_cast<unsigned char>(c));
    }
  }
  return r;
}

std::string upper(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), ::toupper);
  return s;
}
std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), ::tolower);
  return s;
}

// select/reject/selectattr/rejectattr share this: args are (attr?, test, test args...).
Value select_items(Interpreter& in, const Value& seq, std::vector<Value>& args, bool by_attr, bool keep) {
  Array out;
  size_t k = 0;
  std::string attr = by_attr ? need_str(args.at(k++), "selectattr") : "";
  std::string test = k < args.size() ? need_str(args[k++], "select") : "";
  std::vector<Value> test_args(args.begin() + std::min(k, args.size()), args.end());
  for (const auto& item : seq.iterate()) {
    Value v = by_attr ? attr_path(item, attr) : item;
    bool ok = test.empty() ? v.truthy() : in.test(test, v, test_args);
    if (ok == keep) out.push_back(item);
  }
  return Value(std::move(out));
}

}  // namespace

std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  auto strip_char = [&](char c) {
    if (chars.is_none() || chars.is_undefined()) return is_py_space(c);
    return chars.str().find(c) != std::string::npos;
  };
  size_t b = 0, e = s.size();
  if (left)
    while (b < e && strip_char(s[b])) ++b;
  if (right)
    while (e > b && strip_char(s[e - 1])) --e;
  return s.substr(b, e - b);
}

Value py_slice(const Value& seq, const Value& start_v, const Value& stop_v, const Value& step_v) {
  Array items;
  bool is_str = seq.is_string();
  static const std::string kEmpty;
  Utf8Index chars(is_str ? seq.str() : kEmpty);
  if (!is_str) {
    if (!seq.is_array()) fail("jinja: cannot slice '{}'", seq.type_name());
    items = seq.array();
  }
  int64_t n = is_str ? int64_t(chars.size()) : int64_t(items.size());
  int64_t step = step_v.is_none() ? 1 : step_v.as_int();
  if (step == 0) fail("jinja: slice step cannot be zero");
  auto norm = [&](const Value& v, int64_t def, int64_t lo, int64_t hi) {
    if (v.is_none()) return def;
    int64_t x = v.as_int();
    if (x < 0) x += n;
    return std::clamp(x, lo, hi);
  };
  int64_t start = step > 0 ? norm(start_v, 0, 0, n) : norm(start_v, n - 1, -1, n - 1);
  int64_t stop = step > 0 ? norm(stop_v, n, 0, n) : norm(stop_v, -1, -1, n - 1);
  std::string s;
  Array out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (is_str) s += chars.at(size_t(i));
    else out.push_back(items[i]);
  }
  return is_str ? Value(s) : Value(std::move(out));
}

bool apply_test(Interpreter& in, const std::string& name, const Value& v, std::vector<Value>& args, bool& found) {
  found = true;
  auto a0 = [&]() -> const Value& {
    if (args.empty()) fail("jinja: test '{}' needs an argument", name);
    return args[0];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.is_int();
  if (name == "float") return v.type() == Value::Type::Float;
  if (name == "boolean") return v.is_bool();
  if (name == "true") return v.is_bool() && v.as_bool();
  if (name == "false") return v.is_bool() && !v.as_bool();
  if (name == "mapping") return v.is_object();
  if (name == "sequence") return v.is_array() || v.is_string() || v.is_object();
  if (name == "iterable") return v.is_array() || v.is_string() || v.is_object();
  if (name == "callable") return v.is_function();
  if (name == "odd") return v.as_int() % 2 != 0;
  if (name == "even") return v.as_int() % 2 == 0;
  if (name == "divisibleby") return a0().as_int() != 0 && v.as_int() % a0().as_int() == 0;
  if (name == "lower") return v.is_string() && lower(v.str()) == v.str();
  if (name == "upper") return v.is_string() && upper(v.str()) == v.str();
  if (name == "equalto" || name == "eq" || name == "==" || name == "sameas") return v == a0();
  if (name == "ne" || name == "!=") return v != a0();
  if (name == "gt" || name == "greaterthan" || name == ">") return Value::compare(v, a0()) > 0;
  if (name == "ge" || name == ">=") return Value::compare(v, a0()) >= 0;
  if (name == "lt" || name == "lessthan" || name == "<") return Value::compare(v, a0()) < 0;
  if (name == "le" || name == "<=") return Value::compare(v, a0()) <= 0;
  if (name == "in") {
    const Value& hay = a0();
    if (hay.is_string()) return v.is_string() && hay.str().find(v.str()) != std::string::npos;
    for (const auto& x : hay.iterate())
      if (x == v) return true;
    return false;
  }
  found = false;
  return false;
}

Value apply_filter(Interpreter& in, const std::string& name, Value v, std::vector<Value>& args, KwArgs& kwargs,
                   bool& found) {
  found = true;
  static const Value kNone = Value::none();
  if (name == "tojson") {
    Value indent = arg(args, kwargs, 0, "indent", kNone);
    Value ascii = arg(args, kwargs, 1, "ensure_ascii", Value(false));
    Value seps = arg(args, kwargs, 2, "separators", kNone);
    Value sort = arg(args, kwargs, 3, "sort_keys", Value(false));
    std::string item_sep = indent.is_none() ? ", " : ",", key_sep = ": ";
    if (seps.is_array() && seps.array().size() == 2) {
      item_sep = seps.array()[0].str();
      key_sep = seps.array()[1].str();
    }
    return Value(v.to_json(indent.is_none() ? -1 : int(indent.as_int()), ascii.truthy(), item_sep, key_sep, sort.truthy()));
  }
  if (name == "trim" || name == "strip") return Value(py_strip(need_str(v, "trim"), arg(args, kwargs, 0, "chars", kNone), true, true));
  if (name == "length" || name == "count") return Value(v.length());
  if (name == "string") return Value(v.to_str());
  if (name == "safe") return v;
  if (name == "escape" || name == "e") return Value(html_escape(v.to_str()));
  if (name == "upper") return Value(upper(need_str(v, "upper")));
  if (name == "lower") return Value(lower(need_str(v, "lower")));
  if (name == "capitalize") return Value(capitalize(need_str(v, "capitalize")));
  if (name == "title") return Value(title(need_str(v, "title")));
  if (name == "items") {
    if (v.is_undefined() || v.is_none()) return Value(Array{});
    if (!v.is_object()) fail("jinja: items expects a mapping, got {}", v.type_name());
    Array out;
    for (const auto& [k, x] : v.object().items) out.emplace_back(Array{Value(k), x});
    return Value(std::move(out));
  }
  if (name == "dictsort") {
    Value items = apply_filter(in, "items", v, args, kwargs, found);
    Array a = items.array();
    std::stable_sort(a.begin(), a.end(), [](const Value& x, const Value& y) {
      return x.array()[0].str() < y.array()[0].str();
    });
    return Value(std::move(a));
  }
  if (name == "list") return Value(v.iterate());
  if ((name == "first" || name == "last") && v.is_string()) {  // (a long message's text is not split into a list)
    const Utf8Index chars(v.str());
    if (chars.size() == 0) return Value();
    return Value(std::string(chars.at(name == "first" ? 0 : chars.size() - 1)));
  }
  if (name == "first") {
    Array a = v.iterate();
    return a.empty() ? Value() : a.front();
  }
  if (name == "last") {
    Array a = v.iterate();
    return a.empty() ? Value() : a.back();
  }
  if (name == "reverse") {
    if (v.is_string()) return py_slice(v, kNone, kNone, Value(-1));
    Array a = v.iterate();
    std::reverse(a.begin(), a.end());
    return Value(std::move(a));
  }
  if (name == "join") {
    Value sep = arg(args, kwargs, 0, "d", Value(""));
    Value attr = arg(args, kwargs, 1, "attribute", kNone);
    const std::string sep_s = sep.to_str();
    // A join over a string's characters: the separators alone may exceed the bound; fail before splitting it (nested
    // joins over characters grow ~|sep| times each).
    if (v.is_string()) {
      size_t chars = 0;
      for (unsigned char ch : v.str()) chars += (ch & 0xC0) != 0x80;  // UTF-8 characters
      if (chars > 1) check_size((chars - 1) * sep_s.size(), kMaxStringBytes, "a joined string of bytes");
      if (attr.is_none()) {  // the characters straight into the result (no value per character)
        check_size(v.str().size(), kMaxItems, "iterating a string of");
        const Utf8Index str(v.str());
        std::string out;
        for (size_t i = 0; i < str.size(); ++i) {
          if (i) out += sep_s;
          out += str.at(i);
        }
        check_size(out.size(), kMaxStringBytes, "a joined string of bytes");
        return Value(std::move(out));
      }
    }
    const Array items = v.iterate();
    std::string out;
    bool first = true;
    for (const auto& x : items) {
      if (!first) out += sep_s;
      first = false;
      out += (attr.is_none() ? x : attr_path(x, attr.to_str())).to_str();
      check_size(out.size(), kMaxStringBytes, "a joined string of bytes");
    }
    return Value(out);
  }
  if (name == "default" || name == "d") {
    Value def = arg(args, kwargs, 0, "default_value", Value(""));
    bool boolean = arg(args, kwargs, 1, "boolean", Value(false)).truthy();
    return (v.is_undefined() || (boolean && !v.truthy())) ? def : v;
  }
  if (name == "replace") {
    int64_t count = arg(args, kwargs, 2, "count", Value(int64_t(-1))).as_int();
    return Value(replace_all(need_str(v, "replace"), args.at(0).to_str(), args.at(1).to_str(), count));
  }
  if (name == "int") {
    if (v.is_string()) {
      try {
        return Value(int64_t(std::stoll(v.str())));
      } catch (...) {
        return arg(args, kwargs, 0, "default", Value(int64_t(0)));
      }
    }
    return Value(v.is_number() || v.is_bool() ? v.as_int() : 0);
  }
  if (name == "float") {
    if (v.is_string()) {
      try {
        return Value(std::stod(v.str()));
      } catch (...) {
        return Value(0.0);
      }
    }
    return Value(v.as_double());
  }
  if (name == "abs") return v.is_int() ? Value(int64_t(std::llabs(v.as_int()))) : Value(std::fabs(v.as_double()));
  if (name == "round") {
    int64_t prec = arg(args, kwargs, 0, "precision", Value(int64_t(0))).as_int();
    double m = std::pow(10.0, double(prec));
    return Value(std::round(v.as_double() * m) / m);
  }
  if (name == "select" || name == "reject") return select_items(in, v, args, false, name == "select");
  if (name == "selectattr" || name == "rejectattr") return select_items(in, v, args, true, name == "selectattr");
  if (name == "map") {
    Value attr = arg(args, kwargs, size_t(-1), "attribute", kNone);
    Array out;
    if (!attr.is_none()) {
      Value def = arg(args, kwargs, size_t(-1), "default", Value());
      for (const auto& x : v.iterate()) {
        Value r = attr_path(x, attr.to_str());
        out.push_back(r.is_undefined() ? def : r);
      }
      return Value(std::move(out));
    }
    std::string filter = need_str(args.at(0), "map");
    std::vector<Value> rest(args.begin() + 1, args.end());
    for (const auto& x : v.iterate()) {
      std::vector<Value> a = rest;
      KwArgs kw = kwargs;
      out.push_back(in.filter(filter, x, a, kw));
    }
    return Value(std::move(out));
  }
  if (name == "unique") {
    Array out;
    for (const auto& x : v.iterate())
      if (std::find(out.begin(), out.end(), x) == out.end()) out.push_back(x);
    return Value(std::move(out));
  }
  if (name == "sort") {
    bool reverse = arg(args, kwargs, 0, "reverse", Value(false)).truthy();
    Value attr = arg(args, kwargs, 2, "attribute", kNone);
    Array a = v.iterate();
    auto key = [&](const Value& x) { return attr.is_none() ? x : attr_path(x, attr.to_str()); };
    std::stable_sort(a.begin(), a.end(), [&](const Value& x, const Value& y) {
      int c = Value::compare(key(x), key(y));
      return reverse ? c > 0 : c < 0;
    });
    return Value(std::move(a));
  }
  if (name == "sum") {
    Value attr = arg(args, kwargs, size_t(-1), "attribute", kNone);
    Value total(int64_t(0));
    for (const auto& x : v.iterate()) {
      Value y = attr.is_none() ? x : attr_path(x, attr.to_str());
      total = (total.is_int() && y.is_int()) ? Value(total.as_int() + y.as_int()) : Value(total.as_double() + y.as_double());
    }
    return total;
  }
  if (name == "min" || name == "max") {
    Array a = v.iterate();
    if (a.empty()) return Value();
    auto it = std::min_element(a.begin(), a.end(), [&](const Value& x, const Value& y) {
      return name == "min" ? Value::compare(x, y) < 0 : Value::compare(x, y) > 0;
    });
    return *it;
  }
  if (name == "indent") {
    int64_t width = arg(args, kwargs, 0, "width", Value(int64_t(4))).as_int();
    bool first = arg(args, kwargs, 1, "first", Value(false)).truthy();
    bool blank = arg(args, kwargs, 2, "blank", Value(false)).truthy();
    std::string pad(size_t(width), ' '), out;
    auto lines = py_split(need_str(v, "indent"), Value("\n"), -1);
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i) out += '\n';
      bool empty = py_strip(lines[i], kNone, true, true).empty();
      if ((i > 0 || first) && (blank || !empty)) out += pad;
      out += lines[i];
    }
    return Value(out);
  }
  if (name == "wordcount") return Value(int64_t(py_split(need_str(v, "wordcount"), kNone, -1).size()));
  found = false;
  return Value();
}

Value call_method(const Value& self, const std::string& name, std::vector<Value>& args, KwArgs& kwargs, bool& found) {
  found = true;
  static const Value kNone = Value::none();
  if (self.is_string()) {
    const std::string& s = self.str();
    auto affix = [&](bool prefix) {
      const Value& a = args.at(0);
      Array cands = a.is_array() ? a.array() : Array{a};
      for (const auto& c : cands) {
        const std::string& x = need_str(c, prefix ? "startswith" : "endswith");
        if (prefix ? s.starts_with(x) : s.ends_with(x)) return true;
      }
      return false;
    };
    if (name == "startswith") return Value(affix(true));
    if (name == "endswith") return Value(affix(false));
    if (name == "strip") return Value(py_strip(s, arg(args, kwargs, 0, "chars", kNone), true, true));
    if (name == "lstrip") return Value(py_strip(s, arg(args, kwargs, 0, "chars", kNone), true, false));
    if (name == "rstrip") return Value(py_strip(s, arg(args, kwargs, 0, "chars", kNone), false, true));
    if (name == "split")
      return Value(to_values(py_split(s, arg(args, kwargs, 0, "sep", kNone), arg(args, kwargs, 1, "maxsplit", Value(int64_t(-1))).as_int())));
    if (name == "rsplit" && args.size() <= 1 && kwargs.empty()) return Value(to_values(py_split(s, arg(args, kwargs, 0, "sep", kNone), -1)));
    if (name == "splitlines") return Value(to_values(py_split(replace_all(s, "\r\n", "\n"), Value("\n"), -1)));
    if (name == "upper") return Value(upper(s));
    if (name == "lower") return Value(lower(s));
    if (name == "title") return Value(title(s));
    if (name == "capitalize") return Value(capitalize(s));
    if (name == "replace")
      return Value(replace_all(s, args.at(0).to_str(), args.at(1).to_str(), args.size() > 2 ? args[2].as_int() : -1));
    if (name == "find" || name == "index" || name == "rfind") {
      size_t p = name == "rfind" ? s.rfind(need_str(args.at(0), "find")) : s.find(need_str(args.at(0), "find"));
      if (p == std::string::npos && name == "index") fail("jinja: substring not found");
      return Value(p == std::string::npos ? int64_t(-1) : int64_t(p));
    }
    if (name == "count") {
      const std::string& x = need_str(args.at(0), "count");
      int64_t n = 0;
      for (size_t p = 0; !x.empty() && (p = s.find(x, p)) != std::string::npos; p += x.size()) ++n;
      return Value(n);
    }
    if (name == "join") {
      std::string out;
      bool first = true;
      for (const auto& x : args.at(0).iterate()) {
        if (!first) out += s;
        first = false;
        out += x.to_str();
      }
      return Value(out);
    }
    if (name == "isdigit") return Value(!s.empty() && std::all_of(s.begin(), s.end(), ::isdigit));
    if (name == "isspace") return Value(!s.empty() && std::all_of(s.begin(), s.end(), is_py_space));
  } else if (self.is_object()) {
    Object& o = self.object();
    if (name == "get") {
      const Value* v = o.find(args.at(0).to_str());
      return v ? *v : (args.size() > 1 ? args[1] : kNone);
    }
    if (name == "items") {
      Array out;
      for (const auto& [k, x] : o.items) out.emplace_back(Array{Value(k), x});
      return Value(std::move(out));
    }
    if (name == "keys") return Value(self.iterate());
    if (name == "values") {
      Array out;
      for (const auto& kv : o.items) out.push_back(kv.second);
      return Value(std::move(out));
    }
    if (name == "update") {
      for (const auto& [k, x] : args.at(0).object().items) o.set(k, x);
      return kNone;
    }
  } else if (self.is_array()) {
    Array& a = self.array();
    if (name == "append") {
      a.push_back(args.at(0));
      return kNone;
    }
    if (name == "extend") {
      for (const auto& x : args.at(0).iterate()) a.push_back(x);
      return kNone;
    }
    if (name == "pop") {
      if (a.empty()) fail("jinja: pop from empty list");
      int64_t i = args.empty() ? int64_t(a.size()) - 1 : args[0].as_int();
      if (i < 0) i += int64_t(a.size());
      Value r = a.at(size_t(i));
      a.erase(a.begin() + i);
      return r;
    }
    if (name == "index") {
      for (size_t i = 0; i < a.size(); ++i)
        if (a[i] == args.at(0)) return Value(int64_t(i));
      fail("jinja: value not in list");
    }
    if (name == "count") return Value(int64_t(std::count(a.begin(), a.end(), args.at(0))));
  }
  found = false;
  return Value();
}

Object builtin_globals() {
  Object g;
  g.set("raise_exception", Value(Function([](std::vector<Value>& args, KwArgs&) -> Value {
    fail("chat template error: {}", args.empty() ? std::string("raise_exception") : args[0].to_str());
  })));
  g.set("namespace", Value(Function([](std::vector<Value>& args, KwArgs& kwargs) {
    Object ns;
    if (!args.empty() && args[0].is_object()) ns = args[0].object();
    for (auto& [k, v] : kwargs) ns.set(k, v);
    return Value(std::move(ns));
  })));
  g.set("dict", Value(Function([](std::vector<Value>& args, KwArgs& kwargs) {
    Object d;
    if (!args.empty() && args[0].is_object()) d = args[0].object();
    for (auto& [k, v] : kwargs) d.set(k, v);
    return Value(std::move(d));
  })));
  g.set("range", Value(Function([](std::vector<Value>& args, KwArgs&) {
    int64_t start = 0, stop = 0, step = 1;
    if (args.size() == 1) stop = args[0].as_int();
    else if (args.size() >= 2) {
      start = args[0].as_int();
      stop = args[1].as_int();
      if (args.size() > 2) step = args[2].as_int();
    }
    if (step == 0) fail("jinja: range step cannot be zero");
    const double n = (double(stop) - double(start)) / double(step);
    check_size(n > 0 ? size_t(std::min(n, 1e18)) : 0, kMaxItems, "a range of");
    Array out;
    out.reserve(n > 0 ? size_t(std::ceil(n)) : 0);
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.emplace_back(i);
    return Value(std::move(out));
  })));
  g.set("strftime_now", Value(Function([](std::vector<Value>& args, KwArgs&) {
    std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[256];
    size_t n = std::strftime(buf, sizeof buf, args.empty() ? "%Y-%m-%d" : args[0].to_str().c_str(), &tm);
    return Value(std::string(buf, n));
  })));
  return g;
}

}  // namespace moesrv::jinja
