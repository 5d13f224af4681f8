// Filters, tests, methods and global functions of the Jinja subset, as @huggingface/jinja
// defines them (names and behaviour from the Jinja documentation's built-in filters and tests).
#include <algorithm>
#include <cmath>
#include <ctime>
#include <unordered_set>

#include <unicode/locid.h>
#include <unicode/unistr.h>

#include "loom/core/error.h"
#include "loom/data/jinja.h"
#include "loom/data/jinja_runtime.h"

namespace loom::jinja {

const Value* Args::kw(const std::string& key) const {
  for (const auto& [k, v] : keyword)
    if (k == key) return &v;
  return nullptr;
}

const Value* Args::at(size_t i, const std::string& key) const {
  if (i < positional.size()) return &positional[i];
  return kw(key);
}

namespace {

[[noreturn]] void fail(const std::string& what) { throw RuntimeError(what); }

std::string case_map(const std::string& s, bool upper) {
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(s);
  if (upper) u.toUpper(icu::Locale::getRoot());
  else u.toLower(icu::Locale::getRoot());
  std::string out;
  u.toUTF8String(out);
  check_string_size(out.size());  // (a case mapping can lengthen a string: "ß" -> "SS")
  return out;
}

bool ascii_word(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

std::string title_case(const std::string& s) {
  std::string out = s;
  for (size_t i = 0; i < out.size(); ++i)
    if (ascii_word(out[i]) && (i == 0 || !ascii_word(out[i - 1])))
      out[i] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[i])));
  return out;
}

std::string capitalize(const std::string& s) {
  if (s.empty()) return s;
  const size_t n = utf8_length(s, 0);
  return case_map(s.substr(0, n), true) + s.substr(n);
}

// JavaScript's parseInt(s, 10) and parseFloat(s); NaN when no number starts the text.
double parse_int(const std::string& s) {
  const std::string t = js_trim(s, true, false);
  size_t i = 0;
  const bool neg = i < t.size() && t[i] == '-';
  if (i < t.size() && (t[i] == '-' || t[i] == '+')) ++i;
  const size_t digits = i;
  double v = 0;
  while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) v = v * 10 + (t[i++] - '0');
  if (i == digits) return std::nan("");
  return neg ? -v : v;
}

double parse_float(const std::string& s) {
  const std::string t = js_trim(s, true, false);
  if (t.empty() || !(std::isdigit(static_cast<unsigned char>(t[0])) || t[0] == '-' || t[0] == '+' || t[0] == '.'))
    return std::nan("");
  char* end = nullptr;
  const double v = std::strtod(t.c_str(), &end);
  return end == t.c_str() ? std::nan("") : v;
}

bool starts_or_ends(const Value& self, const std::vector<Value>& args, bool start) {
  const char* name = start ? "startswith" : "endswith";
  auto test = [&](const std::string& p) {
    const std::string& s = self.str;
    return p.size() <= s.size() && (start ? s.compare(0, p.size(), p) == 0 : s.compare(s.size() - p.size(), p.size(), p) == 0);
  };
  if (args.empty()) fail(str_cat(name, "() requires at least one argument"));
  if (args[0].kind == Kind::String) return test(args[0].str);
  if (!args[0].is_array()) fail(str_cat(name, "() argument must be a string or tuple of strings"));
  for (const Value& item : *args[0].arr) {
    if (item.kind != Kind::String) fail(str_cat(name, "() tuple elements must be strings"));
    if (test(item.str)) return true;
  }
  return false;
}

// str.split(sep=None, maxsplit=-1) as Python defines it.
Value split(const std::string& s, const std::vector<Value>& args) {
  const Value sep = args.empty() ? Value::null() : args[0];
  const Value maxsplit = args.size() > 1 ? args[1] : Value::integer(-1);
  if (sep.kind != Kind::String && sep.kind != Kind::Null) fail("sep argument must be a string or null");
  if (maxsplit.kind != Kind::Int) fail("maxsplit argument must be a number");
  const double max = maxsplit.num;
  List parts;
  if (sep.kind == Kind::Null) {
    const std::string t = js_trim(s, true, false);
    for (size_t i = 0; i < t.size();) {
      if (js_space_at(t, i) > 0) {
        i += js_space_at(t, i);
        continue;
      }
      if (max != -1 && static_cast<double>(parts.size()) >= max) {
        parts.push_back(Value::string(t.substr(i)));
        break;
      }
      check_items(parts.size() + 1);
      size_t j = i;
      while (j < t.size() && js_space_at(t, j) == 0) j += utf8_length(t, j);
      parts.push_back(Value::string(t.substr(i, j - i)));
      i = j;
    }
    return Value::array(std::move(parts));
  }
  if (sep.str.empty()) fail("empty separator");
  size_t from = 0;
  for (size_t at; (at = s.find(sep.str, from)) != std::string::npos; from = at + sep.str.size()) {
    if (max != -1 && static_cast<double>(parts.size()) >= max) break;
    check_items(parts.size() + 2);
    parts.push_back(Value::string(s.substr(from, at - from)));
  }
  parts.push_back(Value::string(s.substr(from)));
  return Value::array(std::move(parts));
}

Value replace(const std::string& s, const std::vector<Value>& args) {
  if (args.size() < 2) fail("replace() requires at least two arguments");
  if (args[0].kind != Kind::String || args[1].kind != Kind::String) fail("replace() arguments must be strings");
  Value count = Value::null();
  if (args.size() > 2) count = args[2].kind == Kind::KwArgs ? (args[2].get("count") ? *args[2].get("count") : Value::null()) : args[2];
  if (count.kind != Kind::Int && count.kind != Kind::Null) fail("replace() count argument must be a number or null");
  const std::string& from = args[0].str;
  const std::string& to = args[1].str;
  double left = count.kind == Kind::Null || count.num < 0 ? INFINITY : count.num;
  std::string out;  // checked against the string limit as it grows
  if (from.empty()) {
    for (size_t i = 0; i < s.size();) {
      const size_t len = utf8_length(s, i);
      if (left-- > 0) out += to;
      out.append(s, i, len);
      check_string_size(out.size());
      i += len;
    }
    if (left > 0) out += to;
    check_string_size(out.size());
    return Value::string(out);
  }
  size_t pos = 0;
  for (size_t at; left > 0 && (at = s.find(from, pos)) != std::string::npos; pos = at + from.size(), --left) {
    out.append(s, pos, at - pos);
    out += to;
    check_string_size(out.size());
  }
  out.append(s, pos);
  check_string_size(out.size());
  return Value::string(out);
}

Value string_method(const Value& self, const std::string& name) {
  auto method = [&self](auto body) { return Value::function([self, body](std::vector<Value>& args) { return body(self, args); }); };
  using V = const Value&;
  using A = std::vector<Value>&;
  if (name == "upper") return method([](V s, A) { return Value::string(case_map(s.str, true)); });
  if (name == "lower") return method([](V s, A) { return Value::string(case_map(s.str, false)); });
  if (name == "strip") return method([](V s, A) { return Value::string(js_trim(s.str, true, true)); });
  if (name == "rstrip") return method([](V s, A) { return Value::string(js_trim(s.str, false, true)); });
  if (name == "lstrip") return method([](V s, A) { return Value::string(js_trim(s.str, true, false)); });
  if (name == "title") return method([](V s, A) { return Value::string(title_case(s.str)); });
  if (name == "capitalize") return method([](V s, A) { return Value::string(capitalize(s.str)); });
  if (name == "length") return Value::integer(static_cast<double>(utf16_length(self.str)));
  if (name == "startswith") return method([](V s, A a) { return Value::boolean(starts_or_ends(s, a, true)); });
  if (name == "endswith") return method([](V s, A a) { return Value::boolean(starts_or_ends(s, a, false)); });
  if (name == "split") return method([](V s, A a) { return split(s.str, a); });
  if (name == "replace") return method([](V s, A a) { return replace(s.str, a); });
  return Value::undefined();
}

Value entries(const Value& obj, int which) {  // 0 items, 1 keys, 2 values
  List out;
  for (const auto& [k, v] : *obj.obj) {
    if (which == 0) out.push_back(Value::array({Value::string(k), v}));
    else out.push_back(which == 1 ? Value::string(k) : v);
  }
  return Value::array(std::move(out));
}

// A method holds its dict: as deep as a list of it (a chain of methods of dicts of methods
// nests as lists do).
Value held(Value method, const Value& self) {
  check_value_depth(self.depth + 1);
  method.depth = self.depth + 1;
  return method;
}

Value object_method(const Value& self, const std::string& name) {
  if (name == "get")
    return held(Value::function([self](std::vector<Value>& args) {
      if (args.empty() || args[0].kind != Kind::String)
        fail(str_cat("Dict key must be a string: got ", args.empty() ? "UndefinedValue" : kind_name(args[0].kind)));
      const Value* v = self.get(args[0].str);
      return v ? *v : args.size() > 1 ? args[1] : Value::null();
    }), self);
  for (int which = 0; which < 3; ++which)
    if (name == (which == 0 ? "items" : which == 1 ? "keys" : "values"))
      return held(Value::function([self, which](std::vector<Value>&) { return entries(self, which); }), self);
  return Value::undefined();
}

int compare(const Value& a, const Value& b, bool case_sensitive) {
  const bool a_nil = a.kind == Kind::Null || a.kind == Kind::Undefined;
  const bool b_nil = b.kind == Kind::Null || b.kind == Kind::Undefined;
  if (a_nil || b_nil) {
    if (a.kind == b.kind) return 0;
    fail(str_cat("Cannot compare ", kind_name(a.kind), " with ", kind_name(b.kind)));
  }
  auto num = [](const Value& v) { return v.kind == Kind::Bool ? (v.b ? 1.0 : 0.0) : v.num; };
  if ((a.is_number() || a.kind == Kind::Bool) && (b.is_number() || b.kind == Kind::Bool))
    return num(a) < num(b) ? -1 : num(a) > num(b) ? 1 : 0;
  if (a.kind != b.kind) fail(str_cat("Cannot compare different types: ", kind_name(a.kind), " and ", kind_name(b.kind)));
  if (a.kind != Kind::String) fail(str_cat("Cannot compare type: ", kind_name(a.kind)));
  const std::string x = case_sensitive ? a.str : case_map(a.str, false);
  const std::string y = case_sensitive ? b.str : case_map(b.str, false);
  return x < y ? -1 : x > y ? 1 : 0;
}

// item.a.b (a dotted path; integer parts index arrays), or undefined.
Value attribute_path(const Value& item, const std::string& path) {
  Value v = item;
  size_t from = 0;
  while (true) {
    const size_t dot = path.find('.', from);
    const std::string part = path.substr(from, dot == std::string::npos ? std::string::npos : dot - from);
    if (v.kind == Kind::Object || v.kind == Kind::KwArgs || v.kind == Kind::Namespace) {
      const Value* x = v.get(part);
      v = x ? *x : Value::undefined();
    } else if (v.is_array()) {
      const double i = parse_int(part);
      if (std::isnan(i) || i < 0 || i >= static_cast<double>(v.arr->size())) return Value::undefined();
      v = Value((*v.arr)[static_cast<size_t>(i)]);
    } else {
      return Value::undefined();
    }
    if (dot == std::string::npos) return v;
    from = dot + 1;
  }
}

Value sorted(const Value& arr, bool reverse, bool case_sensitive, const Value& attribute) {
  auto key = [&](const Value& item) {
    if (attribute.kind == Kind::Null) return item;
    return attribute_path(item, attribute.kind == Kind::Int ? js_number(attribute.num) : attribute.str);
  };
  // Each item's key once (lower-cased once, not at every comparison), then the order of the keys.
  const List& items = *arr.arr;
  std::vector<Value> keys;
  keys.reserve(items.size());
  for (const Value& item : items) {
    Value k = key(item);
    if (!case_sensitive && k.kind == Kind::String) k.str = case_map(k.str, false);
    keys.push_back(std::move(k));
  }
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const int c = compare(keys[a], keys[b], true);
    return reverse ? c > 0 : c < 0;
  });
  List out;
  out.reserve(items.size());
  for (const size_t i : order) out.push_back(items[i]);
  return Value::array(std::move(out));
}

std::string join_values(const List& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    const Value& v = items[i];
    if (i) out += sep;
    if (v.kind != Kind::Null && v.kind != Kind::Undefined) out += to_concat(v);
    check_string_size(out.size());
  }
  return out;
}

// A key equal for two values exactly when strict_equal holds (numbers by value, NaN never).
std::string identity(const Value& v) {
  if (v.is_number()) {
    if (std::isnan(v.num)) return str_cat("N", static_cast<const void*>(&v));  // (unequal to everything)
    const double d = v.num == 0 ? 0.0 : v.num;  // (-0 === 0)
    return str_cat("n", std::string(reinterpret_cast<const char*>(&d), sizeof d));
  }
  switch (v.kind) {
    case Kind::Undefined: return "u";
    case Kind::Null: return "z";
    case Kind::Bool: return v.b ? "t" : "f";
    case Kind::String: return "s" + v.str;
    default:
      if (v.arr) return str_cat("a", static_cast<const void*>(v.arr.get()));
      if (v.obj) return str_cat("o", static_cast<const void*>(v.obj.get()));
      return str_cat("c", static_cast<const void*>(v.fn.get()));
  }
}

Value array_filter(const std::string& name, const Value& a) {
  const List& items = *a.arr;
  if (name == "list") return a;
  if (name == "first") return items.empty() ? Value::undefined() : items.front();
  if (name == "last") return items.empty() ? Value::undefined() : items.back();
  if (name == "length") return Value::integer(static_cast<double>(items.size()));
  if (name == "reverse") return Value::array(List(items.rbegin(), items.rend()));
  if (name == "sort") return sorted(a, false, false, Value::null());
  if (name == "join") return Value::string(join_values(items, ""));
  if (name == "string") {
    JsonOptions options;
    options.undefined_as_null = false;
    return Value::string(to_json(a, options));
  }
  if (name == "unique") {
    List out;
    std::unordered_set<std::string> seen;
    for (const Value& x : items)
      if (seen.insert(identity(x)).second) out.push_back(x);
    return Value::array(std::move(out));
  }
  fail("Unknown ArrayValue filter: " + name);
}

std::string indent_lines(const std::string& s, size_t width, bool first, bool blank) {
  std::string out;
  size_t start = 0, line = 0;
  while (true) {
    const size_t nl = s.find('\n', start);
    const std::string x = s.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
    if (line > 0) out += "\n";
    out += ((line == 0 && !first) || (x.empty() && !blank)) ? x : std::string(width, ' ') + x;
    check_string_size(out.size());
    if (nl == std::string::npos) return out;
    start = nl + 1;
    ++line;
  }
}

Value string_filter(const std::string& name, const Value& s) {
  if (name == "length" || name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    Value m = string_method(s, name);
    std::vector<Value> none;
    return m.kind == Kind::Function ? (*m.fn)(none) : m;
  }
  if (name == "trim") return Value::string(js_trim(s.str, true, true));
  if (name == "indent") return Value::string(indent_lines(s.str, 4, false, false));
  if (name == "join" || name == "string") return s;
  if (name == "int") {
    const double v = parse_int(s.str);
    return Value::integer(std::isnan(v) ? 0 : v);
  }
  if (name == "float") {
    const double v = parse_float(s.str);
    return Value::floating(std::isnan(v) ? 0 : v);
  }
  fail("Unknown StringValue filter: " + name);
}

Value plain_filter(const std::string& name, const Value& v) {
  if (name == "safe") return v;
  if (name == "tojson") return Value::string(to_json(v, {}));
  if (v.is_array()) return array_filter(name, v);
  if (v.kind == Kind::String) return string_filter(name, v);
  if (v.is_number()) {
    if (name == "abs") return v.kind == Kind::Int ? Value::integer(std::fabs(v.num)) : Value::floating(std::fabs(v.num));
    if (name == "int") return Value::integer(std::floor(v.num));
    if (name == "float") return Value::floating(v.num);
    if (name == "string") return Value::string(to_output(v));
    fail("Unknown NumericValue filter: " + name);
  }
  if (v.is_object()) {
    if (name == "items") return entries(v, 0);
    if (name == "length") return Value::integer(static_cast<double>(v.obj->size()));
    Value m = object_method(v, name);
    if (m.kind == Kind::Undefined) fail("Unknown ObjectValue filter: " + name);
    std::vector<Value> none;
    return (*m.fn)(none);
  }
  if (v.kind == Kind::Bool) {
    if (name == "bool") return v;
    if (name == "int") return Value::integer(v.b ? 1 : 0);
    if (name == "float") return Value::floating(v.b ? 1 : 0);
    if (name == "string") return Value::string(v.b ? "true" : "false");
    fail("Unknown BooleanValue filter: " + name);
  }
  fail(str_cat("Cannot apply filter \"", name, "\" to type: ", kind_name(v.kind)));
}

bool flag_arg(const Args& args, size_t i, const std::string& key, const char* what) {
  const Value* v = args.at(i, key);
  if (v == nullptr) return false;
  if (v->kind != Kind::Bool) fail(str_cat(what, " must be a boolean"));
  return v->b;
}

Value tojson_filter(const Value& v, const Args& args) {
  JsonOptions options;
  const Value* indent = args.kw("indent");
  if (indent && indent->kind != Kind::Int && indent->kind != Kind::Null) fail("If set, indent must be a number");
  if (indent && indent->kind == Kind::Int) options.indent = static_cast<int>(std::clamp(indent->num, -1.0, 1000.0));
  const Value* ascii = args.kw("ensure_ascii");
  const Value* sort = args.kw("sort_keys");
  if ((ascii && ascii->kind != Kind::Bool) || (sort && sort->kind != Kind::Bool)) fail("If set, ensure_ascii and sort_keys must be booleans");
  options.ensure_ascii = ascii && ascii->b;
  options.sort_keys = sort && sort->b;
  if (const Value* sep = args.kw("separators"); sep && sep->kind != Kind::Null) {
    if (!sep->is_array() || sep->arr->size() != 2 || (*sep->arr)[0].kind != Kind::String || (*sep->arr)[1].kind != Kind::String)
      fail("separators must be a tuple of two strings");
    options.separators = true;
    options.item_sep = (*sep->arr)[0].str;
    options.key_sep = (*sep->arr)[1].str;
  }
  return Value::string(to_json(v, options));
}

Value map_filter(const Value& v, const Args& args) {
  const Value* attr = args.kw("attribute");
  if (attr == nullptr) fail("`map` expressions without `attribute` set are not currently supported.");
  if (attr->kind != Kind::String) fail("attribute must be a string");
  List out;
  for (const Value& item : *v.arr) {
    if (item.kind != Kind::Object && item.kind != Kind::KwArgs && item.kind != Kind::Namespace) fail("items in map must be an object");
    const Value x = attribute_path(item, attr->str);
    const Value* fallback = args.kw("default");
    out.push_back(x.kind == Kind::Undefined && fallback ? *fallback : x);
  }
  return Value::array(std::move(out));
}

Value call_filter(const std::string& name, const Value& v, const Args& args) {
  if (name == "tojson") return tojson_filter(v, args);
  if (name == "join") {
    if (v.kind != Kind::String && !v.is_array()) fail(str_cat("Cannot apply filter \"join\" to type: ", kind_name(v.kind)));
    const Value* sep = args.at(0, "separator");
    if (sep && sep->kind != Kind::String) fail("separator must be a string");
    if (v.is_array()) return Value::string(join_values(*v.arr, sep ? sep->str : ""));
    std::string out;  // the characters of the string, joined
    for (size_t i = 0; i < v.str.size();) {
      const size_t len = utf8_length(v.str, i);
      if (i > 0 && sep) out += sep->str;
      out.append(v.str, i, len);
      check_string_size(out.size());
      i += len;
    }
    return Value::string(out);
  }
  if (name == "default") {
    const Value* fallback = args.at(0, "");
    const bool boolean = flag_arg(args, 1, "boolean", "`default` filter flag");
    if (v.kind == Kind::Undefined || (boolean && !truthy(v))) return fallback ? *fallback : Value::string("");
    return v;
  }
  if (v.is_array() && name == "sort") {
    const Value* attribute = args.at(2, "attribute");
    return sorted(v, flag_arg(args, 0, "reverse", "reverse"), flag_arg(args, 1, "case_sensitive", "case_sensitive"),
                  attribute ? *attribute : Value::null());
  }
  if (v.is_array() && name == "map") return map_filter(v, args);
  if (v.kind == Kind::String && name == "indent") {
    const Value* width = args.at(0, "width");
    if (width && width->kind != Kind::Int) fail("width must be a number");
    const size_t w = width ? static_cast<size_t>(std::clamp(width->num, 0.0, 1000.0)) : 4;
    return Value::string(indent_lines(v.str, w, args.at(1, "first") && truthy(*args.at(1, "first")),
                                      args.at(2, "blank") && truthy(*args.at(2, "blank"))));
  }
  if (v.kind == Kind::String && name == "replace") {
    std::vector<Value> all = args.positional;
    all.push_back(Value::object(args.keyword, Kind::KwArgs));
    return replace(v.str, all);
  }
  if (v.is_object()) {
    Value m = object_method(v, name);
    if (m.kind != Kind::Function) fail("Unknown ObjectValue filter: " + name);
    std::vector<Value> all = args.positional;
    if (!args.keyword.empty()) all.push_back(Value::object(args.keyword, Kind::KwArgs));
    return (*m.fn)(all);
  }
  if (v.is_array() || v.kind == Kind::String) fail(str_cat("Unknown ", v.is_array() ? "ArrayValue" : "StringValue", " filter: ", name));
  fail(str_cat("Cannot apply filter \"", name, "\" to type: ", kind_name(v.kind)));
}

}  // namespace

Value apply_filter(const std::string& name, const Value& operand, const Args* args) {
  if (name == "int" || name == "float") {
    if (args == nullptr && operand.kind != Kind::Bool && operand.kind != Kind::String && !operand.is_number())
      fail(str_cat("Cannot apply filter \"", name, "\" to type: ", kind_name(operand.kind)));
  }
  return args ? call_filter(name, operand, *args) : plain_filter(name, operand);
}

bool has_test(const std::string& name) {
  static constexpr const char* kTests[] = {"boolean", "callable", "odd",    "even",   "false", "true",
                                           "none",    "string",   "number", "integer", "iterable", "mapping",
                                           "sequence", "lower",   "upper",  "defined", "undefined", "equalto", "eq"};
  return std::any_of(std::begin(kTests), std::end(kTests), [&](const char* t) { return name == t; });
}

bool apply_test(const std::string& name, const Value& v, const Value* arg) {
  const Kind k = v.kind;
  if (name == "boolean") return k == Kind::Bool;
  if (name == "callable") return k == Kind::Function;
  if (name == "odd" || name == "even") {
    if (k != Kind::Int) fail(str_cat("cannot ", name, " on ", kind_name(k)));
    return (std::fmod(v.num, 2) != 0) == (name == "odd");
  }
  if (name == "false" || name == "true") return k == Kind::Bool && v.b == (name == "true");
  if (name == "none") return k == Kind::Null;
  if (name == "string") return k == Kind::String;
  if (name == "number") return v.is_number();
  if (name == "integer") return k == Kind::Int;
  if (name == "iterable") return k == Kind::Array || k == Kind::String;
  if (name == "mapping") return v.is_object();
  if (name == "sequence") return v.is_array() || v.is_object() || k == Kind::String;
  if (name == "lower" || name == "upper") return k == Kind::String && v.str == case_map(v.str, name == "upper");
  if (name == "defined") return k != Kind::Undefined;
  if (name == "undefined") return k == Kind::Undefined;
  if (name == "equalto" || name == "eq") {
    if (arg == nullptr) fail(str_cat("the test ", name, " needs a value to compare with"));
    return strict_equal(v, *arg);
  }
  fail("Unknown test: " + name);
}

Value member_of(const Value& object, const Value& property) {
  if (object.kind == Kind::Object || object.kind == Kind::KwArgs || object.kind == Kind::Namespace) {
    if (property.kind != Kind::String) fail(str_cat("Cannot access property with non-string: got ", kind_name(property.kind)));
    if (const Value* v = object.get(property.str)) return *v;
    return object.kind == Kind::Namespace ? Value::undefined() : object_method(object, property.str);
  }
  if (object.is_array() || object.kind == Kind::String) {
    if (property.kind == Kind::Int) {
      const double n = object.kind == Kind::String ? static_cast<double>(utf16_length(object.str)) : static_cast<double>(object.arr->size());
      const double i = property.num < 0 ? property.num + n : property.num;
      if (i < 0 || i >= n) return Value::undefined();
      if (object.is_array()) return (*object.arr)[static_cast<size_t>(i)];
      size_t at = 0;  // the i-th code point
      for (double k = 0; k < i && at < object.str.size(); ++k) at += utf8_length(object.str, at);
      return at < object.str.size() ? Value::string(object.str.substr(at, utf8_length(object.str, at))) : Value::undefined();
    }
    if (property.kind != Kind::String)
      fail(str_cat("Cannot access property with non-string/non-number: got ", kind_name(property.kind)));
    if (object.kind == Kind::String) return string_method(object, property.str);
    return property.str == "length" ? Value::integer(static_cast<double>(object.arr->size())) : Value::undefined();
  }
  if (property.kind != Kind::String) fail(str_cat("Cannot access property with non-string: got ", kind_name(property.kind)));
  return Value::undefined();
}

Value slice_of(const Value& object, const Value& start_v, const Value& stop_v, const Value& step_v) {
  if (!object.is_array() && object.kind != Kind::String) fail("Slice object must be an array or string");
  for (const Value* v : {&start_v, &stop_v, &step_v})
    if (v->kind != Kind::Int && v->kind != Kind::Undefined) fail("Slice start, stop and step must be integers or undefined");
  // A string's code points by their byte offsets (the last entry: the string's end).
  std::vector<uint32_t> cps;
  if (object.kind == Kind::String) {
    check_string_size(object.str.size());
    for (size_t i = 0; i < object.str.size(); i += utf8_length(object.str, i)) cps.push_back(static_cast<uint32_t>(i));
    cps.push_back(static_cast<uint32_t>(object.str.size()));
  }
  const double len = object.kind == Kind::String ? static_cast<double>(cps.size() - 1) : static_cast<double>(object.arr->size());
  const double step = step_v.kind == Kind::Int ? step_v.num : 1;
  if (step == 0) return object.kind == Kind::String ? Value::string("") : Value::array({});
  double start, stop;
  if (step > 0) {
    start = start_v.kind == Kind::Undefined ? 0 : start_v.num < 0 ? std::max(len + start_v.num, 0.0) : std::min(start_v.num, len);
    stop = stop_v.kind == Kind::Undefined ? len : stop_v.num < 0 ? std::max(len + stop_v.num, 0.0) : std::min(stop_v.num, len);
  } else {
    start = start_v.kind == Kind::Undefined ? len - 1 : start_v.num < 0 ? std::max(len + start_v.num, -1.0) : std::min(start_v.num, len - 1);
    stop = stop_v.kind == Kind::Undefined ? -1 : stop_v.num < -1 ? std::max(len + stop_v.num, -1.0) : std::min(stop_v.num, len - 1);
  }
  const double dir = step > 0 ? 1 : -1;
  List items;
  std::string text;
  for (double i = start; dir * i < dir * stop; i += step) {
    const auto k = static_cast<size_t>(i);
    if (object.kind == Kind::String) text.append(object.str, cps[k], cps[k + 1] - cps[k]);
    else items.push_back((*object.arr)[k]);
  }
  return object.kind == Kind::String ? Value::string(text) : Value::array(std::move(items));
}

namespace {

Value namespace_fn(std::vector<Value>& args) {
  Dict entries;
  const bool has_kw = !args.empty() && args.back().kind == Kind::KwArgs;
  const size_t positional = args.size() - (has_kw ? 1 : 0);
  if (positional > 1) fail(str_cat("namespace expected at most 1 argument, got ", positional));
  Value ns = Value::object({}, Kind::Namespace);
  if (positional == 1) {
    const Value& src = args[0];
    if (src.kind == Kind::Object || src.kind == Kind::KwArgs) {
      for (const auto& [k, v] : *src.obj) ns.set(k, v);
    } else if (src.is_array()) {
      for (const Value& pair : *src.arr) {
        if (!pair.is_array() || pair.arr->size() != 2 || (*pair.arr)[0].kind != Kind::String)
          fail("namespace expected an object or an iterable of [key, value] pairs");
        ns.set((*pair.arr)[0].str, (*pair.arr)[1]);
      }
    } else {
      fail(str_cat("'", kind_name(src.kind), "' object is not iterable"));
    }
  }
  if (has_kw)
    for (const auto& [k, v] : *args.back().obj) ns.set(k, v);
  return ns;
}

Value range_fn(std::vector<Value>& args) {
  for (const Value& a : args)
    if (!a.is_number()) fail("range() arguments must be numbers");
  if (args.empty() || args.size() > 3) fail("range() takes 1 to 3 arguments");
  const double start = args.size() == 1 ? 0 : args[0].num;
  const double stop = args.size() == 1 ? args[0].num : args[1].num;
  const double step = args.size() == 3 ? args[2].num : 1;
  if (step == 0) fail("range() step must not be zero");
  List out;
  for (double i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (out.size() >= kMaxItems) fail("range() of more than 2^20 numbers (the limit of a chat template's lists)");
    out.push_back(Value::integer(i));
  }
  return Value::array(std::move(out));
}

// strftime_now(format): local time, with the directives the reference knows (%Y %m %d %b %B %H %M %%).
Value strftime_fn(std::vector<Value>& args) {
  if (args.empty() || args[0].kind != Kind::String) fail("strftime_now() expects a format string");
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  const std::string& f = args[0].str;
  std::string out;
  char buf[64];
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] != '%' || i + 1 >= f.size() || std::string("YmdbBHM%").find(f[i + 1]) == std::string::npos) {
      out += f[i];
      continue;
    }
    const char d = f[++i];
    const char fmt[3] = {'%', d, '\0'};
    std::strftime(buf, sizeof(buf), fmt, &tm);
    out += buf;
    check_string_size(out.size());
  }
  return Value::string(out);
}

}  // namespace

Dict builtin_globals() {
  return {
      {"namespace", Value::function(namespace_fn)},
      {"false", Value::boolean(false)},
      {"true", Value::boolean(true)},
      {"none", Value::null()},
      {"raise_exception", Value::function([](std::vector<Value>& args) -> Value {
         fail("raise_exception: " + (args.empty() ? std::string() : to_concat(args[0])));
       })},
      {"range", Value::function(range_fn)},
      {"strftime_now", Value::function(strftime_fn)},
      {"True", Value::boolean(true)},
      {"False", Value::boolean(false)},
      {"None", Value::null()},
  };
}

}  // namespace loom::jinja
