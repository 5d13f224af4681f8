// Values of the Jinja subset: construction, truthiness, printing, JSON, equality and the
// JavaScript string rules (whitespace, UTF-16 lengths) that @huggingface/jinja inherits.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "loom/core/error.h"
#include "loom/data/jinja.h"
#include "loom/data/jinja_runtime.h"

namespace loom::jinja {

namespace {
Value of_kind(Kind kind) {
  Value v;
  v.kind = kind;
  return v;
}
}  // namespace

Value Value::null() { return of_kind(Kind::Null); }
Value Value::boolean(bool x) {
  Value v = of_kind(Kind::Bool);
  v.b = x;
  return v;
}
Value Value::integer(double x) {
  Value v = of_kind(Kind::Int);
  v.num = x;
  return v;
}
Value Value::floating(double x) {
  Value v = of_kind(Kind::Float);
  v.num = x;
  return v;
}
Value Value::string(std::string x) {
  Value v;
  v.kind = Kind::String;
  v.str = std::move(x);
  return v;
}
Value Value::array(List x, Kind kind) {
  check_items(x.size());
  Value v;
  v.kind = kind;
  for (const Value& item : x) v.depth = std::max(v.depth, item.depth);
  check_value_depth(++v.depth);
  v.arr = std::make_shared<List>(std::move(x));
  return v;
}
Value Value::object(Dict x, Kind kind) {
  check_items(x.size());
  Value v;
  v.kind = kind;
  for (const auto& entry : x) v.depth = std::max(v.depth, entry.second.depth);
  check_value_depth(++v.depth);
  v.obj = std::make_shared<Dict>(std::move(x));
  return v;
}
Value Value::function(Callable f) {
  Value v;
  v.kind = Kind::Function;
  v.fn = std::make_shared<Callable>(std::move(f));
  return v;
}

const Value* Value::get(const std::string& key) const {
  if (!obj) return nullptr;
  for (const auto& [k, v] : *obj)
    if (k == key) return &v;
  return nullptr;
}

void Value::set(const std::string& key, Value v) {
  check_value_depth(v.depth + 1);
  depth = std::max(depth, v.depth + 1);
  for (auto& [k, old] : *obj)
    if (k == key) {
      old = std::move(v);
      return;
    }
  check_items(obj->size() + 1);
  obj->emplace_back(key, std::move(v));
}

void check_string_size(size_t bytes) {
  if (bytes > kMaxStringBytes)
    throw RuntimeError(str_cat("a string of more than ", kMaxStringBytes >> 20, " MiB (the limit of a chat template's "
                               "strings and of its output)"));
}

void check_items(size_t items) {
  if (items > kMaxItems)
    throw RuntimeError("a list or dict of more than 2^20 items (the limit of a chat template's lists)");
}

void check_value_depth(int depth) {
  if (depth > kMaxValueDepth)
    throw RuntimeError(str_cat("lists and dicts nested more than ", kMaxValueDepth, " deep (the limit of a chat "
                               "template's values)"));
}

uint64_t value_work(const Value& v) {
  if (v.kind == Kind::String) return v.str.size();
  uint64_t work = 0;
  if (v.arr) {
    work += v.arr->size() * kItemBytes;
    for (const Value& x : *v.arr) work += x.str.size();
  } else if (v.obj) {
    work += v.obj->size() * kItemBytes;
    for (const auto& [k, x] : *v.obj) work += k.size() + x.str.size();
  }
  return work;
}

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::Undefined: return "UndefinedValue";
    case Kind::Null: return "NullValue";
    case Kind::Bool: return "BooleanValue";
    case Kind::Int: return "IntegerValue";
    case Kind::Float: return "FloatValue";
    case Kind::String: return "StringValue";
    case Kind::Array: return "ArrayValue";
    case Kind::Tuple: return "TupleValue";
    case Kind::Object: return "ObjectValue";
    case Kind::Namespace: return "NamespaceValue";
    case Kind::KwArgs: return "KeywordArgumentsValue";
    case Kind::Function: return "FunctionValue";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined:
    case Kind::Null: return false;
    case Kind::Bool: return v.b;
    case Kind::Int:
    case Kind::Float: return v.num != 0 && !std::isnan(v.num);
    case Kind::String: return !v.str.empty();
    case Kind::Array:
    case Kind::Tuple: return !v.arr->empty();
    case Kind::Object:
    case Kind::KwArgs: return !v.obj->empty();
    case Kind::Namespace:
    case Kind::Function: return true;
  }
  return false;
}

// Shortest round-trip digits, placed as ECMAScript's Number::toString places them.
std::string js_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  if (v == 0) return "0";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), std::fabs(v), std::chars_format::scientific);
  const std::string sci(buf, res.ptr);
  const size_t e_at = sci.find('e');
  std::string digits = sci.substr(0, 1) + (e_at > 2 ? sci.substr(2, e_at - 2) : "");
  const int n = std::atoi(sci.c_str() + e_at + 1) + 1;  // v = 0.digits * 10^n
  const int k = static_cast<int>(digits.size());
  std::string out = v < 0 ? "-" : "";
  if (k <= n && n <= 21) return out + digits + std::string(static_cast<size_t>(n - k), '0');
  if (0 < n && n <= 21) return str_cat(out, digits.substr(0, static_cast<size_t>(n)), ".", digits.substr(static_cast<size_t>(n)));
  if (-6 < n && n <= 0) return str_cat(out, "0.", std::string(static_cast<size_t>(-n), '0'), digits);
  const int e = n - 1;
  out += digits.substr(0, 1);
  if (k > 1) out += str_cat(".", digits.substr(1));
  return str_cat(out, "e", e < 0 ? "-" : "+", std::abs(e));
}

namespace {

std::string float_text(double v) {
  if (v == 0 && std::signbit(v)) return "-0.0";
  if (std::isfinite(v) && std::floor(v) == v && std::fabs(v) < 1e21) {
    char buf[400];
    std::snprintf(buf, sizeof(buf), "%.1f", v);
    return buf;
  }
  return js_number(v);
}

void append_hex4(std::string& out, unsigned u) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "\\u%04x", u & 0xFFFF);
  out += buf;
}

// JSON.stringify of a string; ensure_ascii escapes every UTF-16 unit from U+007F up.
std::string json_string(const std::string& s, bool ensure_ascii) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        default:
          if (c < 0x20 || (ensure_ascii && c == 0x7f)) append_hex4(out, c);
          else out.push_back(static_cast<char>(c));
      }
      ++i;
      continue;
    }
    const size_t len = utf8_length(s, i);
    if (!ensure_ascii) {
      out.append(s, i, len);
    } else {
      const uint32_t cp = decode_utf8(s, i, len);
      if (cp > 0xFFFF) {
        append_hex4(out, 0xD800 + ((cp - 0x10000) >> 10));
        append_hex4(out, 0xDC00 + ((cp - 0x10000) & 0x3FF));
      } else {
        append_hex4(out, cp);
      }
    }
    i += len;
  }
  return out + "\"";
}

}  // namespace

namespace {

// to_json into `out`, which is checked against the string limit as it grows (an indent of 1000
// over nested lists grows fast), `depth` levels down (a namespace can hold itself).
void json_into(std::string& out, const Value& v, const JsonOptions& options, int depth) {
  switch (v.kind) {
    case Kind::Null: out += "null"; return;
    case Kind::Undefined: out += options.undefined_as_null ? "null" : "undefined"; return;
    case Kind::Bool: out += v.b ? "true" : "false"; return;
    case Kind::Int:
    case Kind::Float: out += std::isfinite(v.num) ? js_number(v.num) : "null"; return;
    case Kind::String:
      check_string_size(out.size() + v.str.size());
      out += json_string(v.str, options.ensure_ascii);
      check_string_size(out.size());
      return;
    case Kind::Array:
    case Kind::Object:
    case Kind::Namespace: break;
    default: throw RuntimeError(str_cat("cannot convert to JSON: ", kind_name(v.kind)));
  }
  check_value_depth(depth + 1);
  const bool indented = options.indent > 0;
  const std::string item_sep = options.separators ? options.item_sep : indented ? "," : ", ";
  const std::string key_sep = options.separators ? options.key_sep : ": ";
  const std::string unit = indented ? std::string(static_cast<size_t>(options.indent), ' ') : "";
  std::string base = "\n";
  for (int i = 0; i < depth; ++i) base += unit;
  const std::string child = base + unit;
  const bool is_array = v.kind == Kind::Array;
  out += is_array ? "[" : "{";
  if (is_array) {
    for (size_t i = 0; i < v.arr->size(); ++i) {
      if (i > 0) out += item_sep;
      if (indented) out += child;
      check_string_size(out.size());
      json_into(out, (*v.arr)[i], options, depth + 1);
    }
  } else {
    Dict entries = *v.obj;
    if (options.sort_keys)
      std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = 0; i < entries.size(); ++i) {
      if (i > 0) out += item_sep;
      if (indented) out += child;
      out += json_string(entries[i].first, options.ensure_ascii);
      out += key_sep;
      check_string_size(out.size());
      json_into(out, entries[i].second, options, depth + 1);
    }
  }
  if (indented && (is_array ? !v.arr->empty() : !v.obj->empty())) out += base;
  out += is_array ? "]" : "}";
  check_string_size(out.size());
}

}  // namespace

std::string to_json(const Value& v, const JsonOptions& options, int depth) {
  std::string out;
  json_into(out, v, options, depth);
  return out;
}

std::string to_output(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined: return "undefined";
    case Kind::Null: return "null";
    case Kind::Bool: return v.b ? "true" : "false";
    case Kind::Int: return js_number(v.num);
    case Kind::Float: return float_text(v.num);
    case Kind::String: return v.str;
    case Kind::Function: return "[function]";
    default: {
      JsonOptions options;
      options.undefined_as_null = false;
      return to_json(v, options);
    }
  }
}

std::string to_concat(const Value& v) {
  switch (v.kind) {
    case Kind::Int:
    case Kind::Float: return js_number(v.num);
    case Kind::Array:
    case Kind::Tuple: {
      std::string out;
      for (size_t i = 0; i < v.arr->size(); ++i) {
        if (i) out.push_back(',');
        out += to_output((*v.arr)[i]);
        check_string_size(out.size());
      }
      return out;
    }
    case Kind::Object:
    case Kind::Namespace:
    case Kind::KwArgs: return "[object Map]";
    default: return to_output(v);
  }
}

namespace {

double numeric(const Value& v) { return v.kind == Kind::Bool ? (v.b ? 1 : 0) : v.num; }

// JavaScript's Number(string) for decimal text (enough for the comparisons templates make).
double js_to_number(const std::string& s) {
  const std::string t = js_trim(s, true, true);
  if (t.empty()) return 0;
  char* end = nullptr;
  const double d = std::strtod(t.c_str(), &end);
  return end == t.c_str() + t.size() ? d : std::nan("");
}

bool same_object(const Value& a, const Value& b) {
  if (a.arr || b.arr) return a.arr == b.arr;
  if (a.obj || b.obj) return a.obj == b.obj;
  return a.fn == b.fn;
}

bool is_reference(const Value& v) { return v.arr || v.obj || v.fn; }

}  // namespace

bool loose_equal(const Value& a, const Value& b) {
  const bool a_nullish = a.kind == Kind::Undefined || a.kind == Kind::Null;
  const bool b_nullish = b.kind == Kind::Undefined || b.kind == Kind::Null;
  if (a_nullish || b_nullish) return a_nullish && b_nullish;
  if (is_reference(a) && is_reference(b)) return same_object(a, b);
  if (is_reference(a) || is_reference(b)) {
    const Value& ref = is_reference(a) ? a : b;
    const Value& other = is_reference(a) ? b : a;
    if (ref.fn) return false;
    return loose_equal(Value::string(ref.arr ? to_concat(ref) : "[object Map]"), other);
  }
  if (a.kind == Kind::String && b.kind == Kind::String) return a.str == b.str;
  const double x = a.kind == Kind::String ? js_to_number(a.str) : numeric(a);
  const double y = b.kind == Kind::String ? js_to_number(b.str) : numeric(b);
  return x == y;
}

bool strict_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.num == b.num;
  if (a.kind != b.kind && !(is_reference(a) && is_reference(b))) return false;
  switch (a.kind) {
    case Kind::Undefined:
    case Kind::Null: return true;
    case Kind::Bool: return a.b == b.b;
    case Kind::String: return a.str == b.str;
    default: return same_object(a, b);
  }
}

// ---- UTF-8 and JavaScript's whitespace ----

size_t utf8_length(const std::string& s, size_t i) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
  if (i + n > s.size()) return 1;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 1;
  return n;
}

uint32_t decode_utf8(const std::string& s, size_t i, size_t len) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  if (len == 1) return c < 0x80 ? c : 0xFFFD;  // an ill-formed byte
  uint32_t cp = c & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

namespace {
bool js_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000 || cp == 0xFEFF;
}
}  // namespace

size_t js_space_at(const std::string& s, size_t pos) {
  if (pos >= s.size()) return 0;
  const size_t len = utf8_length(s, pos);
  return js_space(decode_utf8(s, pos, len)) ? len : 0;
}

size_t js_space_before(const std::string& s, size_t end) {
  for (size_t len = 1; len <= 3 && len <= end; ++len) {
    const size_t start = end - len;
    if (utf8_length(s, start) == len && js_space_at(s, start) == len) return len;
  }
  return 0;
}

std::string js_trim(const std::string& s, bool start, bool end) {
  size_t b = 0, e = s.size();
  if (start)
    for (size_t n; b < e && (n = js_space_at(s, b)) > 0;) b += n;
  if (end)
    for (size_t n; e > b && (n = js_space_before(s, e)) > 0;) e -= n;
  return s.substr(b, e - b);
}

size_t utf16_length(const std::string& s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t len = utf8_length(s, i);
    n += len == 4 ? 2 : 1;
    i += len;
  }
  return n;
}

void fail_at(const std::string& source, size_t pos, const std::string& what) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < pos && i < source.size(); ++i) {
    if (source[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  std::string msg = what;
  for (char& c : msg)
    if (c == '\n' || c == '\r') c = ' ';
  throw Error(str_cat("chat template: line ", line, ", column ", col, ": ", msg));
}

}  // namespace loom::jinja
