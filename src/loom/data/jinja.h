// The Jinja subset that Hugging Face chat templates use, with the semantics of Hugging Face's
// JavaScript implementation @huggingface/jinja (rendering byte for byte as it does): lexer
// (jinja_lex.cpp), parser (jinja_parse.cpp), values and operators (jinja_value.cpp), filters, tests and methods
// (jinja_filters.cpp), the interpreter (jinja_eval.cpp). Internal to chat_template.cpp; see
// chat_template.h for the interface and docs/tokenizers.md for the supported subset.
// References: the Jinja template designer documentation (jinja.palletsprojects.com/templates)
// and Hugging Face's chat templating guide (huggingface.co/docs/transformers/chat_templating).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace loom::jinja {

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, as a JS Map
using Callable = std::function<Value(std::vector<Value>& args)>;

enum class Kind { Undefined, Null, Bool, Int, Float, String, Array, Tuple, Object, Namespace, KwArgs, Function };

// A runtime value. Numbers are doubles, as in JavaScript (Int and Float differ in printing and
// arithmetic typing). Arrays, objects and functions are shared: equality between them is identity.
// `depth`: how deeply a list, dict or method holds other values (1 + the deepest it holds; 0 for
// the rest), limited to kMaxValueDepth when it is made (jinja_runtime.h), so that no chain of
// values is deeper than that between two namespaces (which the interpreter clears at the end).
struct Value {
  Kind kind = Kind::Undefined;
  int depth = 0;
  bool b = false;
  double num = 0;
  std::string str;
  std::shared_ptr<List> arr;
  std::shared_ptr<Dict> obj;
  std::shared_ptr<Callable> fn;

  static Value undefined() { return {}; }
  static Value null();
  static Value boolean(bool v);
  static Value integer(double v);
  static Value floating(double v);
  static Value string(std::string v);
  static Value array(List v, Kind kind = Kind::Array);
  static Value object(Dict v, Kind kind = Kind::Object);
  static Value function(Callable f);

  bool is_array() const { return kind == Kind::Array || kind == Kind::Tuple; }
  bool is_object() const { return kind == Kind::Object || kind == Kind::KwArgs; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float; }
  // obj's value for key, or nullptr.
  const Value* get(const std::string& key) const;
  // Sets obj's key (the depth of this handle follows; other handles of a namespace keep theirs).
  void set(const std::string& key, Value v);
};

// The type name @huggingface/jinja gives a kind ("StringValue"), for error messages.
const char* kind_name(Kind kind);
// Python-style truthiness as the JS implementation defines it (an empty array is false).
bool truthy(const Value& v);
// What {{ v }} prints.
std::string to_output(const Value& v);
// What `~` and `+` concatenate: JavaScript's toString of the underlying value.
std::string to_concat(const Value& v);
// JavaScript's Number.prototype.toString.
std::string js_number(double v);
// tojson: indent <= 0 means none; item_sep / key_sep replace the defaults when `separators`.
struct JsonOptions {
  int indent = -1;
  bool ensure_ascii = false;
  bool sort_keys = false;
  bool separators = false;
  std::string item_sep, key_sep;
  bool undefined_as_null = true;
};
// Errors (RuntimeError) past the string limit or kMaxValueDepth levels (a namespace can hold itself).
std::string to_json(const Value& v, const JsonOptions& options, int depth = 0);
// JS `==` between the values and JS `===` (used by `in`).
bool loose_equal(const Value& a, const Value& b);
bool strict_equal(const Value& a, const Value& b);

// Strings (UTF-8): JavaScript's whitespace (\s) and the operations on it.
size_t js_space_at(const std::string& s, size_t pos);      // length of the \s character at pos, or 0
size_t js_space_before(const std::string& s, size_t end);  // length of the \s character ending at end, or 0
std::string js_trim(const std::string& s, bool start, bool end);
size_t utf16_length(const std::string& s);

// ---- Syntax ----

enum class Tok {
  Text, Number, String, Ident, Equals, LParen, RParen, OpenStmt, CloseStmt, OpenExpr, CloseExpr,
  LBracket, RBracket, LBrace, RBrace, Comma, Dot, Colon, Pipe, Additive, Multiplicative, Power,
  Comparison, Unary, Comment
};
struct Token {
  Tok type;
  std::string value;
  size_t pos;  // offset in the template as given
};

// Raises a loom::Error "chat template: line L, column C: what".
[[noreturn]] void fail_at(const std::string& source, size_t pos, const std::string& what);

// The tokens of `source` after HF's preprocessing (trim_blocks, lstrip_blocks, - markers).
// {% generation %} / {% endgeneration %} tags (transformers' markers of the assistant's text) are
// removed as the reference removes them; with `generation_marks`, each leaves a mark byte
// (kGenerationBegin / kGenerationEnd) in the text where it stood, which the rendering then
// carries to the output (whitespace control sees through the marks).
std::vector<Token> tokenize(const std::string& source, bool generation_marks = false);
// How many {% generation %} and {% endgeneration %} tags `source` holds.
size_t count_generation_tags(const std::string& source);
// Bytes that UTF-8 text never holds.
inline constexpr char kGenerationBegin = '\xFF', kGenerationEnd = '\xFE';
inline bool is_generation_mark(char c) { return c == kGenerationBegin || c == kGenerationEnd; }

enum class Node {
  Program, Text, If, For, Break, Continue, Set, Comment, Macro, CallBlock, FilterBlock,
  Int, Float, Str, ArrayLit, TupleLit, ObjectLit, Ident, Member, Call, Unary, Binary, Filter,
  Test, Select, Ternary, Slice, KwArg, Spread  // Spread: *list (flag false) or **dict (flag true) in a call
};
struct Ast {
  Node type;
  size_t pos = 0;
  std::string text;  // Text/Str/Ident value, operator, test name
  double num = 0;
  bool flag = false;  // Member: computed; Test: negated
  // Operands / elements / object keys and values alternating. Macro: its parameters (Ident, or
  // KwArg holding the default); CallBlock: the Call, then the caller's parameters; FilterBlock:
  // the filter (Ident or Call).
  std::vector<std::unique_ptr<Ast>> kids;
  std::vector<std::unique_ptr<Ast>> body, alt;  // statements (If/For/Set/Macro/CallBlock/FilterBlock)
};
using AstPtr = std::unique_ptr<Ast>;

AstPtr parse(const std::vector<Token>& tokens, const std::string& source);

// Renders a parsed program with `globals` (name -> value) declared over the built-ins, within
// the limits of jinja_runtime.h (each exceeded one is an Error naming it).
std::string render(const Ast& program, const std::string& source, const Dict& globals);

}  // namespace loom::jinja
