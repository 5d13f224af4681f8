// Lexer and parser of the Jinja subset (see jinja.h): the token rules and grammar are those of
// @huggingface/jinja, which renders with trim_blocks and lstrip_blocks on, as Hugging Face does.
#include <algorithm>
#include <array>
#include <string_view>

#include "loom/core/error.h"
#include "loom/data/jinja.h"

namespace loom::jinja {
namespace {

constexpr int kMaxDepth = 200;  // nesting of expressions and blocks

bool is_word(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

// The template after HF's preprocessing, with each byte's offset in the original.
struct Source {
  std::string text;
  std::vector<size_t> origin;
  void push(char c, size_t from) {
    text.push_back(c);
    origin.push_back(from);
  }
};

// Drops one final newline; lstrip_blocks: spaces and tabs at a line start before "{%", "{#" or
// "{-"; trim_blocks: the newline right after "%}", "#}" or "-}".
Source preprocess(const std::string& in) {
  const size_t n = in.size() - (!in.empty() && in.back() == '\n' ? 1 : 0);
  Source lstripped;
  for (size_t i = 0; i < n;) {
    const bool line_start = i == 0 || in[i - 1] == '\n' || in[i - 1] == '\r' ||
                            (i >= 3 && (in.compare(i - 3, 3, "\u2028") == 0 || in.compare(i - 3, 3, "\u2029") == 0));
    if (line_start) {
      size_t j = i;
      while (j < n && (in[j] == ' ' || in[j] == '\t')) ++j;
      if (j > i && j + 1 < n && in[j] == '{' && (in[j + 1] == '%' || in[j + 1] == '#' || in[j + 1] == '-')) i = j;
    }
    lstripped.push(in[i], i);
    ++i;
  }
  Source out;
  const std::string& s = lstripped.text;
  for (size_t i = 0; i < s.size(); ++i) {
    out.push(s[i], lstripped.origin[i]);
    if ((s[i] == '%' || s[i] == '#' || s[i] == '-') && i + 2 < s.size() + 0 && s[i + 1] == '}' && s[i + 2] == '\n') {
      out.push('}', lstripped.origin[i + 1]);
      i += 2;
    }
  }
  return out;
}

struct Lexer {
  const std::string& original;
  Source src;
  std::vector<Token> tokens;
  size_t pos = 0;
  int curly_depth = 0;

  [[noreturn]] void fail(const std::string& what) const {
    fail_at(original, pos < src.origin.size() ? src.origin[pos] : original.size(), what);
  }
  size_t here() const { return pos < src.origin.size() ? src.origin[pos] : original.size(); }
  void push(Tok type, std::string value, size_t at) { tokens.push_back({type, std::move(value), at}); }
  bool at(std::string_view s) const { return src.text.compare(pos, s.size(), s) == 0; }
  char ch(size_t i) const { return i < src.text.size() ? src.text[i] : '\0'; }

  // One character of a run (string literal, digits, name, whitespace): backslash escapes are
  // decoded in every run, as the reference does; reaching the end inside a run is an error.
  template <typename Pred>
  std::string consume_while(Pred pred) {
    std::string out;
    while (pos < src.text.size() && pred(pos)) {
      if (src.text[pos] == '\\') {
        escape(out);
        continue;
      }
      out.push_back(src.text[pos++]);
      if (pos >= src.text.size()) fail("unexpected end of template");
    }
    return out;
  }
  void escape(std::string& out);
  void strip_trailing_text();
  void skip_space() {
    while (pos < src.text.size()) {
      const size_t n = js_space_at(src.text, pos);
      if (n == 0) break;
      pos += n;
    }
  }
  bool text();
  void comment();
  bool sign();
  bool symbol();
  void run();
};

void Lexer::escape(std::string& out) {
  if (++pos >= src.text.size()) fail("unexpected end of template after a backslash");
  const char e = src.text[pos++];
  if (e == 'x' || e == 'u') {
    const size_t len = e == 'x' ? 2 : 4;
    const std::string hex = src.text.substr(pos, len);
    if (hex.size() != len || !std::all_of(hex.begin(), hex.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); }))
      fail("invalid escape \\" + std::string(1, e) + hex);
    const unsigned cp = static_cast<unsigned>(std::stoul(hex, nullptr, 16));
    if (cp >= 0xD800 && cp < 0xE000) fail("a \\u escape of a lone surrogate is not supported");
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    pos += len;
    return;
  }
  static constexpr std::array<std::pair<char, char>, 9> kEscapes = {
      {{'n', '\n'}, {'t', '\t'}, {'r', '\r'}, {'b', '\b'}, {'f', '\f'}, {'v', '\v'}, {'\'', '\''}, {'"', '"'}, {'\\', '\\'}}};
  for (const auto& [k, v] : kEscapes)
    if (e == k) {
      out.push_back(v);
      return;
    }
  --pos;
  fail("unexpected escaped character '" + std::string(1, e) + "'");
}

// "{%-", "{{-", "{#-": the text before loses its trailing whitespace (and goes if nothing is left).
void Lexer::strip_trailing_text() {
  if (tokens.empty() || tokens.back().type != Tok::Text) return;
  std::string& t = tokens.back().value;
  t = js_trim(t, false, true);
  if (t.empty()) tokens.pop_back();
}

// Text up to the next "{%", "{{" or "{#", after a tag or at the start.
bool Lexer::text() {
  const bool after_tag = tokens.empty() || tokens.back().type == Tok::CloseStmt ||
                         tokens.back().type == Tok::CloseExpr || tokens.back().type == Tok::Comment;
  if (!after_tag) return false;
  const size_t start = pos;
  while (pos < src.text.size() && !(src.text[pos] == '{' && (ch(pos + 1) == '%' || ch(pos + 1) == '{' || ch(pos + 1) == '#')))
    ++pos;
  if (pos == start) return false;
  push(Tok::Text, src.text.substr(start, pos - start), src.origin[start]);
  return true;
}

void Lexer::comment() {
  const size_t at = here();
  pos += 2;
  const bool strip_before = ch(pos) == '-';
  if (strip_before) ++pos;
  std::string body;
  while (ch(pos) != '#' || ch(pos + 1) != '}') {
    if (pos + 2 >= src.text.size()) fail("missing end of comment tag");
    body.push_back(src.text[pos++]);
  }
  const bool strip_after = !body.empty() && body.back() == '-';
  if (strip_after) body.pop_back();
  if (strip_before) strip_trailing_text();
  push(Tok::Comment, body, at);
  pos += 2;
  if (strip_after) skip_space();
}

// '-' or '+' where an operand is expected: a signed number literal or a unary operator.
bool Lexer::sign() {
  const char c = ch(pos);
  if (c != '-' && c != '+') return false;
  if (tokens.empty() || tokens.back().type == Tok::Text) fail("unexpected character '" + std::string(1, c) + "'");
  const Tok last = tokens.back().type;
  if (last == Tok::Ident || last == Tok::Number || last == Tok::String || last == Tok::RParen || last == Tok::RBracket)
    return false;
  const size_t at = here();
  ++pos;
  std::string num = consume_while([&](size_t i) { return is_digit(src.text[i]); });
  if (!num.empty() && ch(pos) == '.' && is_digit(ch(pos + 1))) {
    ++pos;
    num.push_back('.');
    num += consume_while([&](size_t i) { return is_digit(src.text[i]); });
  }
  push(num.empty() ? Tok::Unary : Tok::Number, str_cat(c, num), at);
  return true;
}

bool Lexer::symbol() {
  static constexpr std::array<std::pair<std::string_view, Tok>, 27> kTable = {{
      {"{%", Tok::OpenStmt},       {"%}", Tok::CloseStmt},      {"{{", Tok::OpenExpr},       {"}}", Tok::CloseExpr},
      {"(", Tok::LParen},          {")", Tok::RParen},          {"{", Tok::LBrace},          {"}", Tok::RBrace},
      {"[", Tok::LBracket},        {"]", Tok::RBracket},        {",", Tok::Comma},           {".", Tok::Dot},
      {":", Tok::Colon},           {"|", Tok::Pipe},            {"<=", Tok::Comparison},     {">=", Tok::Comparison},
      {"==", Tok::Comparison},     {"!=", Tok::Comparison},     {"<", Tok::Comparison},      {">", Tok::Comparison},
      {"+", Tok::Additive},        {"-", Tok::Additive},        {"~", Tok::Additive},        {"**", Tok::Power},
      {"*", Tok::Multiplicative},  {"//", Tok::Multiplicative}, {"/", Tok::Multiplicative},
  }};
  auto take = [&](std::string_view s, Tok type) {
    push(type, std::string(s), here());
    if (type == Tok::OpenExpr) curly_depth = 0;
    if (type == Tok::LBrace) ++curly_depth;
    if (type == Tok::RBrace) --curly_depth;
    pos += s.size();
    return true;
  };
  for (const auto& [s, type] : kTable) {
    if (s == "}}" && curly_depth > 0) continue;
    if (at(s)) return take(s, type);
  }
  if (at("%")) return take("%", Tok::Multiplicative);
  if (at("=")) return take("=", Tok::Equals);
  return false;
}

void Lexer::run() {
  while (pos < src.text.size()) {
    if (text()) continue;
    if (at("{#")) {
      comment();
      continue;
    }
    if (at("{%-") || at("{{-")) {
      strip_trailing_text();
      const bool stmt = at("{%-");
      push(stmt ? Tok::OpenStmt : Tok::OpenExpr, stmt ? "{%" : "{{", here());
      if (!stmt) curly_depth = 0;
      pos += 3;
      continue;
    }
    for (size_t n; pos < src.text.size() && (n = js_space_at(src.text, pos)) > 0;) {
      pos += n;
      if (pos >= src.text.size()) fail("unexpected end of template");
    }
    if (at("-%}") || at("-}}")) {
      const bool stmt = at("-%}");
      push(stmt ? Tok::CloseStmt : Tok::CloseExpr, stmt ? "%}" : "}}", here());
      pos += 3;
      skip_space();
      continue;
    }
    if (sign() || symbol()) continue;
    const char c = src.text[pos];
    const size_t at_pos = here();
    if (c == '\'' || c == '"') {
      ++pos;
      std::string s = consume_while([&](size_t i) { return src.text[i] != c; });
      ++pos;
      push(Tok::String, std::move(s), at_pos);
    } else if (is_digit(c)) {
      std::string num = consume_while([&](size_t i) { return is_digit(src.text[i]); });
      if (tokens.back().type != Tok::Dot && ch(pos) == '.' && is_digit(ch(pos + 1))) {
        ++pos;
        num.push_back('.');
    num += consume_while([&](size_t i) { return is_digit(src.text[i]); });
      }
      push(Tok::Number, std::move(num), at_pos);
    } else if (is_word(c)) {
      push(Tok::Ident, consume_while([&](size_t i) { return is_word(src.text[i]); }), at_pos);
    } else {
      fail("unexpected character '" + std::string(1, c) + "'");
    }
  }
}

// ---- Parser ----

struct Parser {
  const std::vector<Token>& toks;
  const std::string& source;
  size_t cur = 0;
  int depth = 0;

  [[noreturn]] void fail(const std::string& what) const {
    fail_at(source, cur < toks.size() ? toks[cur].pos : source.size(), what);
  }
  const Token& peek() const {
    if (cur >= toks.size()) fail("unexpected end of template");
    return toks[cur];
  }
  bool is(Tok t, size_t ahead = 0) const { return cur + ahead < toks.size() && toks[cur + ahead].type == t; }
  bool is_ident(std::string_view name, size_t ahead = 0) const { return is(Tok::Ident, ahead) && toks[cur + ahead].value == name; }
  bool is_statement(std::initializer_list<std::string_view> names) const {
    if (!is(Tok::OpenStmt) || !is(Tok::Ident, 1)) return false;
    return std::find(names.begin(), names.end(), toks[cur + 1].value) != names.end();
  }
  const Token& expect(Tok t, const char* what) {
    if (!is(t)) fail(std::string("expected ") + what);
    return toks[cur++];
  }
  void expect_end(const char* name) {
    expect(Tok::OpenStmt, "{%");
    if (!is_ident(name)) fail(std::string("expected ") + name);
    ++cur;
    expect(Tok::CloseStmt, "%}");
  }
  AstPtr node(Node type, size_t pos, std::string text = {}) {
    auto n = std::make_unique<Ast>();
    n->type = type;
    n->pos = pos;
    n->text = std::move(text);
    return n;
  }
  AstPtr binary(AstPtr left, const Token& op, AstPtr right) {
    AstPtr n = node(Node::Binary, op.pos, op.value);
    n->kids.push_back(std::move(left));
    n->kids.push_back(std::move(right));
    return n;
  }
  struct Depth {
    Parser& p;
    explicit Depth(Parser& parser) : p(parser) {
      if (++p.depth > kMaxDepth) p.fail("template nested too deeply");
    }
    ~Depth() { --p.depth; }
  };

  AstPtr any();
  AstPtr statement();
  void block_until(std::vector<AstPtr>& out, std::initializer_list<std::string_view> names) {
    while (!is_statement(names)) out.push_back(any());
  }
  AstPtr set_statement(size_t pos);
  AstPtr if_statement(size_t pos);
  AstPtr for_statement(size_t pos);
  AstPtr sequence(bool primary_only);
  AstPtr expression();
  AstPtr logical(bool is_or);
  AstPtr negation();
  AstPtr comparison();
  AstPtr left_assoc(Tok type, AstPtr (Parser::*next)());
  AstPtr additive();
  AstPtr multiplicative();
  AstPtr power();
  AstPtr test();
  AstPtr filter();
  AstPtr unary_sign();
  AstPtr call_member();
  AstPtr call(AstPtr callee);
  void arguments(Ast& call);
  AstPtr member(AstPtr object);
  AstPtr subscript();
  AstPtr primary();
};

AstPtr Parser::any() {
  Depth guard(*this);
  const Token& t = peek();
  switch (t.type) {
    case Tok::Comment: ++cur; return node(Node::Comment, t.pos, t.value);
    case Tok::Text: ++cur; return node(Node::Text, t.pos, t.value);
    case Tok::OpenStmt: return statement();
    case Tok::OpenExpr: {
      ++cur;
      AstPtr e = expression();
      expect(Tok::CloseExpr, "}}");
      return e;
    }
    default: fail("unexpected '" + t.value + "'");
  }
}

AstPtr Parser::statement() {
  ++cur;  // {%
  if (!is(Tok::Ident)) fail("expected a statement name");
  const Token& name = toks[cur++];
  if (name.value == "set") return set_statement(name.pos);
  if (name.value == "if") {
    AstPtr n = if_statement(name.pos);
    expect_end("endif");
    return n;
  }
  if (name.value == "for") {
    AstPtr n = for_statement(name.pos);
    expect_end("endfor");
    return n;
  }
  if (name.value == "break" || name.value == "continue") {
    expect(Tok::CloseStmt, "%}");
    return node(name.value == "break" ? Node::Break : Node::Continue, name.pos);
  }
  --cur;
  fail("unsupported statement '" + name.value + "'");
}

AstPtr Parser::set_statement(size_t pos) {
  AstPtr n = node(Node::Set, pos);
  n->kids.push_back(sequence(false));
  if (is(Tok::Equals)) {
    ++cur;
    n->kids.push_back(sequence(false));
  } else {
    expect(Tok::CloseStmt, "%}");
    block_until(n->body, {"endset"});
    expect(Tok::OpenStmt, "{%");
    ++cur;
  }
  expect(Tok::CloseStmt, "%}");
  return n;
}

AstPtr Parser::if_statement(size_t pos) {
  AstPtr n = node(Node::If, pos);
  n->kids.push_back(expression());
  expect(Tok::CloseStmt, "%}");
  block_until(n->body, {"elif", "else", "endif"});
  if (is_statement({"elif"})) {
    cur += 2;
    n->alt.push_back(if_statement(toks[cur - 1].pos));
  } else if (is_statement({"else"})) {
    cur += 2;
    expect(Tok::CloseStmt, "%}");
    block_until(n->alt, {"endif"});
  }
  return n;
}

AstPtr Parser::for_statement(size_t pos) {
  AstPtr n = node(Node::For, pos);
  AstPtr var = sequence(true);
  if (var->type != Node::Ident && var->type != Node::TupleLit) fail("expected a name or a tuple of names after for");
  n->kids.push_back(std::move(var));
  if (!is_ident("in")) fail("expected 'in' after the loop variable");
  ++cur;
  n->kids.push_back(expression());
  expect(Tok::CloseStmt, "%}");
  block_until(n->body, {"endfor", "else"});
  if (is_statement({"else"})) {
    cur += 2;
    expect(Tok::CloseStmt, "%}");
    block_until(n->alt, {"endfor"});
  }
  return n;
}

AstPtr Parser::sequence(bool primary_only) {
  const size_t pos = peek().pos;
  AstPtr first = primary_only ? primary() : expression();
  if (!is(Tok::Comma)) return first;
  AstPtr tuple = node(Node::TupleLit, pos);
  tuple->kids.push_back(std::move(first));
  while (is(Tok::Comma)) {
    ++cur;
    tuple->kids.push_back(primary_only ? primary() : expression());
  }
  return tuple;
}

// a if cond else b; a if cond (a or undefined).
AstPtr Parser::expression() {
  Depth guard(*this);
  AstPtr a = logical(true);
  if (!is_ident("if")) return a;
  const size_t pos = toks[cur++].pos;
  AstPtr cond = logical(true);
  if (!is_ident("else")) {
    AstPtr n = node(Node::Select, pos);
    n->kids.push_back(std::move(a));
    n->kids.push_back(std::move(cond));
    return n;
  }
  ++cur;
  AstPtr n = node(Node::Ternary, pos);
  n->kids.push_back(std::move(cond));
  n->kids.push_back(std::move(a));
  n->kids.push_back(expression());
  return n;
}

AstPtr Parser::logical(bool is_or) {
  AstPtr left = is_or ? logical(false) : negation();
  const char* op = is_or ? "or" : "and";
  while (is_ident(op)) {
    const Token& t = toks[cur++];
    left = binary(std::move(left), t, is_or ? logical(false) : negation());
  }
  return left;
}

AstPtr Parser::negation() {
  if (!is_ident("not")) return comparison();
  Depth guard(*this);
  AstPtr n = node(Node::Unary, toks[cur++].pos, "not");
  n->kids.push_back(negation());
  return n;
}

AstPtr Parser::comparison() {
  AstPtr left = additive();
  while (true) {
    Token op{Tok::Comparison, "", 0};
    if (is_ident("not") && is_ident("in", 1)) {
      op = {Tok::Ident, "not in", toks[cur].pos};
      cur += 2;
    } else if (is_ident("in") || is(Tok::Comparison)) {
      op = toks[cur++];
    } else {
      return left;
    }
    left = binary(std::move(left), op, additive());
  }
}

// One level of left-associative binary operators of token type `type` over `next`.
AstPtr Parser::left_assoc(Tok type, AstPtr (Parser::*next)()) {
  AstPtr left = (this->*next)();
  while (is(type)) {
    const Token& op = toks[cur++];
    left = binary(std::move(left), op, (this->*next)());
  }
  return left;
}

AstPtr Parser::additive() { return left_assoc(Tok::Additive, &Parser::multiplicative); }
AstPtr Parser::multiplicative() { return left_assoc(Tok::Multiplicative, &Parser::power); }
AstPtr Parser::power() { return left_assoc(Tok::Power, &Parser::test); }

AstPtr Parser::test() {
  AstPtr operand = filter();
  while (is_ident("is")) {
    const size_t pos = toks[cur++].pos;
    const bool negate = is_ident("not");
    if (negate) ++cur;
    AstPtr name = primary();
    if (name->type != Node::Ident) fail("expected a test name after 'is'");
    AstPtr n = node(Node::Test, pos, name->text);
    n->flag = negate;
    n->kids.push_back(std::move(operand));
    operand = std::move(n);
  }
  return operand;
}

AstPtr Parser::filter() {
  AstPtr operand = unary_sign();
  while (is(Tok::Pipe)) {
    const size_t pos = toks[cur++].pos;
    AstPtr f = primary();
    if (f->type != Node::Ident) fail("expected a filter name after '|'");
    if (is(Tok::LParen)) f = call(std::move(f));
    AstPtr n = node(Node::Filter, pos);
    n->kids.push_back(std::move(operand));
    n->kids.push_back(std::move(f));
    operand = std::move(n);
  }
  return operand;
}

AstPtr Parser::unary_sign() {
  if ((is(Tok::Unary) || is(Tok::Additive)) && (toks[cur].value == "-" || toks[cur].value == "+")) {
    Depth guard(*this);
    const Token& op = toks[cur++];
    AstPtr n = node(Node::Unary, op.pos, op.value);
    n->kids.push_back(unary_sign());
    return n;
  }
  return call_member();
}

AstPtr Parser::call_member() {
  AstPtr m = member(primary());
  return is(Tok::LParen) ? call(std::move(m)) : std::move(m);
}

AstPtr Parser::call(AstPtr callee) {
  Depth guard(*this);
  AstPtr n = node(Node::Call, peek().pos);
  n->kids.push_back(std::move(callee));
  arguments(*n);
  n = member(std::move(n));
  return is(Tok::LParen) ? call(std::move(n)) : std::move(n);
}

// (a, b, key=value): positional arguments first.
void Parser::arguments(Ast& call) {
  expect(Tok::LParen, "(");
  bool keyword = false;
  while (!is(Tok::RParen)) {
    if (is(Tok::Power) || (is(Tok::Multiplicative) && toks[cur].value == "*")) fail("argument unpacking is not supported");
    AstPtr arg = expression();
    if (is(Tok::Equals)) {
      ++cur;
      if (arg->type != Node::Ident) fail("expected a name for a keyword argument");
      AstPtr kw = node(Node::KwArg, arg->pos, arg->text);
      kw->kids.push_back(expression());
      arg = std::move(kw);
      keyword = true;
    } else if (keyword) {
      fail("positional arguments must come before keyword arguments");
    }
    call.kids.push_back(std::move(arg));
    if (is(Tok::Comma)) ++cur;
  }
  ++cur;
}

AstPtr Parser::member(AstPtr object) {
  while (is(Tok::Dot) || is(Tok::LBracket)) {
    const Token& op = toks[cur++];
    AstPtr n = node(Node::Member, op.pos);
    n->flag = op.type == Tok::LBracket;
    n->kids.push_back(std::move(object));
    if (n->flag) {
      n->kids.push_back(subscript());
      expect(Tok::RBracket, "]");
    } else {
      AstPtr prop = primary();
      if (prop->type != Node::Ident && prop->type != Node::Int) fail("expected a name or an integer after '.'");
      n->kids.push_back(std::move(prop));
    }
    object = std::move(n);
  }
  return object;
}

// [i] or a slice [start:stop:step], any part omitted.
AstPtr Parser::subscript() {
  const size_t pos = peek().pos;
  std::vector<AstPtr> parts;
  bool slice = false;
  while (!is(Tok::RBracket)) {
    if (is(Tok::Colon)) {
      parts.push_back(nullptr);
      ++cur;
      slice = true;
    } else {
      parts.push_back(expression());
      if (is(Tok::Colon)) {
        ++cur;
        slice = true;
      }
    }
  }
  if (parts.empty()) fail("expected an index or a slice");
  if (!slice) return std::move(parts[0]);
  if (parts.size() > 3) fail("a slice has at most 3 parts");
  AstPtr n = node(Node::Slice, pos);
  parts.resize(3);
  for (AstPtr& p : parts) n->kids.push_back(std::move(p));
  return n;
}

AstPtr Parser::primary() {
  Depth guard(*this);
  const Token& t = peek();
  ++cur;
  switch (t.type) {
    case Tok::Number: {
      AstPtr n = node(t.value.find('.') != std::string::npos ? Node::Float : Node::Int, t.pos);
      n->num = std::strtod(t.value.c_str(), nullptr);
      return n;
    }
    case Tok::String: {
      std::string s = t.value;
      while (is(Tok::String)) s += toks[cur++].value;
      return node(Node::Str, t.pos, std::move(s));
    }
    case Tok::Ident: return node(Node::Ident, t.pos, t.value);
    case Tok::LParen: {
      AstPtr e = sequence(false);
      expect(Tok::RParen, ")");
      return e;
    }
    case Tok::LBracket: {
      AstPtr n = node(Node::ArrayLit, t.pos);
      while (!is(Tok::RBracket)) {
        n->kids.push_back(expression());
        if (is(Tok::Comma)) ++cur;
      }
      ++cur;
      return n;
    }
    case Tok::LBrace: {
      AstPtr n = node(Node::ObjectLit, t.pos);
      while (!is(Tok::RBrace)) {
        n->kids.push_back(expression());
        expect(Tok::Colon, "':' between a key and its value");
        n->kids.push_back(expression());
        if (is(Tok::Comma)) ++cur;
      }
      ++cur;
      return n;
    }
    default: --cur; fail("unexpected '" + t.value + "'");
  }
}

}  // namespace

std::vector<Token> tokenize(const std::string& source) {
  Lexer lexer{source, preprocess(source), {}};
  lexer.run();
  return std::move(lexer.tokens);
}

AstPtr parse(const std::vector<Token>& tokens, const std::string& source) {
  Parser parser{tokens, source};
  AstPtr program = parser.node(Node::Program, 0);
  while (parser.cur < tokens.size()) program->body.push_back(parser.any());
  return program;
}

}  // namespace loom::jinja
