// Parser of the Jinja subset (see jinja.h): the grammar of @huggingface/jinja.
#include <algorithm>
#include <array>
#include <string_view>

#include "loom/core/error.h"
#include "loom/data/jinja.h"

namespace loom::jinja {
namespace {
constexpr int kMaxDepth = 200;  // nesting of expressions and blocks

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
  // At the '=' after `name`: the KwArg name=value (a keyword argument, a parameter's default).
  AstPtr keyword_value(const Ast& name) {
    ++cur;
    AstPtr kw = node(Node::KwArg, name.pos, name.text);
    kw->kids.push_back(expression());
    return kw;
  }
  // "%}", the statements up to {% end %}, and that tag.
  void body_until_end(Ast& n, const char* end) {
    expect(Tok::CloseStmt, "%}");
    block_until(n.body, {end});
    expect_end(end);
  }
  AstPtr set_statement(size_t pos);
  AstPtr macro_statement(size_t pos);
  AstPtr call_statement(size_t pos);
  AstPtr filter_statement(size_t pos);
  void parameters(Ast& owner);
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
  if (name.value == "macro") return macro_statement(name.pos);
  if (name.value == "call") return call_statement(name.pos);
  if (name.value == "filter") return filter_statement(name.pos);
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

// (a, b=default, ...) of a macro or a call block's caller: names, each once, the defaulted last.
void Parser::parameters(Ast& owner) {
  expect(Tok::LParen, "(");
  const size_t first = owner.kids.size();
  bool defaulted = false;
  while (!is(Tok::RParen)) {
    if (is(Tok::Power) || (is(Tok::Multiplicative) && toks[cur].value == "*"))
      fail("argument unpacking is not allowed in parameter declarations");
    AstPtr param = expression();
    if (param->type != Node::Ident) fail("expected a name for a parameter");
    if (is(Tok::Equals)) {
      param = keyword_value(*param);
      defaulted = true;
    } else if (defaulted) {
      fail("a parameter without a default follows one with a default");
    }
    for (size_t i = first; i < owner.kids.size(); ++i)
      if (owner.kids[i]->text == param->text) fail("duplicate parameter name: " + param->text);
    owner.kids.push_back(std::move(param));
    if (is(Tok::Comma)) ++cur;
  }
  ++cur;
}

// {% macro name(params) %}...{% endmacro %}
AstPtr Parser::macro_statement(size_t pos) {
  if (!is(Tok::Ident)) fail("expected a name after macro");
  AstPtr n = node(Node::Macro, pos, toks[cur++].value);
  parameters(*n);
  body_until_end(*n, "endmacro");
  return n;
}

// {% call[(params)] macro(args) %}...{% endcall %}: calls the macro with `caller` defined as a
// function rendering the body.
AstPtr Parser::call_statement(size_t pos) {
  AstPtr n = node(Node::CallBlock, pos);
  n->kids.push_back(nullptr);
  if (is(Tok::LParen)) parameters(*n);
  if (!is(Tok::Ident)) fail("expected a macro name after call");
  AstPtr call = node(Node::Call, toks[cur].pos);
  call->kids.push_back(node(Node::Ident, toks[cur].pos, toks[cur].value));
  ++cur;
  arguments(*call);
  n->kids[0] = std::move(call);
  body_until_end(*n, "endcall");
  return n;
}

// {% filter name[(args)] %}...{% endfilter %}: the body's output through the filter.
AstPtr Parser::filter_statement(size_t pos) {
  AstPtr n = node(Node::FilterBlock, pos);
  if (!is(Tok::Ident)) fail("expected a filter name");
  AstPtr f = node(Node::Ident, toks[cur].pos, toks[cur].value);
  ++cur;
  if (is(Tok::LParen)) {
    AstPtr call = node(Node::Call, f->pos);
    call->kids.push_back(std::move(f));
    arguments(*call);
    f = std::move(call);
  }
  n->kids.push_back(std::move(f));
  body_until_end(*n, "endfilter");
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

// (a, b, *list, key=value, **dict): positional arguments first, at most one `*list` (no positional
// argument after it) and `**dict` last.
void Parser::arguments(Ast& call) {
  expect(Tok::LParen, "(");
  bool keyword = false, spread = false;
  while (!is(Tok::RParen)) {
    if (is(Tok::Power)) {
      AstPtr n = node(Node::Spread, toks[cur++].pos);
      n->flag = true;
      n->kids.push_back(expression());
      call.kids.push_back(std::move(n));
      if (is(Tok::Comma)) ++cur;
      if (!is(Tok::RParen)) fail("`**` must be applied to the final argument");
      break;
    }
    AstPtr arg;
    if (is(Tok::Multiplicative) && toks[cur].value == "*") {
      if (spread) fail("only one `*` argument unpacking is allowed");
      spread = true;
      arg = node(Node::Spread, toks[cur++].pos);
      arg->kids.push_back(expression());
    } else {
      arg = expression();
    }
    if (is(Tok::Equals) && arg->type != Node::Spread) {
      if (arg->type != Node::Ident) fail("expected a name for a keyword argument");
      arg = keyword_value(*arg);
      keyword = true;
    } else if (keyword) {
      fail("positional arguments must come before keyword arguments");
    } else if (spread && arg->type != Node::Spread) {
      fail("positional arguments must not follow `*` argument unpacking");
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

AstPtr parse(const std::vector<Token>& tokens, const std::string& source) {
  Parser parser{tokens, source};
  AstPtr program = parser.node(Node::Program, 0);
  while (parser.cur < tokens.size()) program->body.push_back(parser.any());
  return program;
}

}  // namespace loom::jinja
