// Lexer of the Jinja subset (see jinja.h): the token rules of @huggingface/jinja, which renders
// with trim_blocks and lstrip_blocks on, as Hugging Face does.
#include <algorithm>
#include <array>
#include <string_view>

#include "loom/core/error.h"
#include "loom/data/jinja.h"

namespace loom::jinja {
namespace {


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

// {% generation %} and {% endgeneration %} (transformers' markers of the assistant's tokens) are
// removed with the whitespace around them; a '-' in the tag keeps that side's whitespace out, as
// the reference's regex /(\s*){%(-?)\s*(?:end)?generation\s*(-?)%}(\s*)/g does. With `marks`,
// each tag leaves its mark (kGenerationBegin / kGenerationEnd) where it stood, in the text between
// the whitespace kept on either side; `found` counts the tags.
Source drop_generation_tags(const Source& in, bool marks, size_t* found = nullptr) {
  const std::string& s = in.text;
  Source out;
  size_t copied = 0;  // s[0, copied) is in `out` or dropped
  auto copy = [&](size_t from, size_t to) {
    for (size_t k = from; k < to; ++k) out.push(s[k], in.origin[k]);
  };
  auto skip_space = [&](size_t j) {
    while (const size_t k = js_space_at(s, j)) j += k;
    return j;
  };
  for (size_t i = s.find("{%"); i != std::string::npos; i = s.find("{%", i)) {
    size_t j = i + 2;
    const bool strip_before = j < s.size() && s[j] == '-';
    j = skip_space(j + (strip_before ? 1 : 0));
    const bool end_tag = s.compare(j, 13, "endgeneration") == 0;
    if (end_tag) j += 3;
    if (s.compare(j, 10, "generation") != 0) {
      i += 2;
      continue;
    }
    j = skip_space(j + 10);
    const bool strip_after = j < s.size() && s[j] == '-';
    j += strip_after ? 1 : 0;
    if (s.compare(j, 2, "%}") != 0) {
      i += 2;
      continue;
    }
    j += 2;
    size_t before = i;
    while (const size_t k = before > copied ? js_space_before(s, before) : 0) {
      if (before - k < copied) break;
      before -= k;
    }
    const size_t after = skip_space(j);
    copy(copied, before);
    if (!strip_before) copy(before, i);
    if (marks) out.push(end_tag ? kGenerationEnd : kGenerationBegin, i);
    if (found != nullptr) ++*found;
    if (!strip_after) copy(j, after);
    copied = i = after;
  }
  copy(copied, s.size());
  return out;
}

struct Lexer {
  const std::string& original;
  Source src;
  std::vector<Token> tokens;
  size_t pos = 0;
  int curly_depth = 0;
  // Whether the text holds generation marks (drop_generation_tags): whitespace handling then sees
  // through a mark, as the reference, which has no marks, does. Without, bytes 0xFE and 0xFF in a
  // template are text as any other.
  bool marks = false;
  // Marks that skip_space passed over: the next text begins with them.
  std::string pending_marks;

  [[noreturn]] void fail(const std::string& what) const {
    fail_at(original, pos < src.origin.size() ? src.origin[pos] : original.size(), what);
  }
  size_t here() const { return here_of(pos); }
  size_t here_of(size_t i) const { return i < src.origin.size() ? src.origin[i] : original.size(); }
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
      if (marks && is_generation_mark(src.text[pos])) {
        pending_marks.push_back(src.text[pos++]);
        continue;
      }
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
// Generation marks among that whitespace stay, in order, at the end of what is left.
void Lexer::strip_trailing_text() {
  if (tokens.empty() || tokens.back().type != Tok::Text) return;
  std::string& t = tokens.back().value;
  if (!marks || t.find_first_of(std::string{kGenerationBegin, kGenerationEnd}) == std::string::npos) {
    t = js_trim(t, false, true);
  } else {
    std::string kept;
    size_t end = t.size();
    while (end > 0) {
      if (is_generation_mark(t[end - 1])) {
        kept.insert(kept.begin(), t[--end]);
      } else if (const size_t n = js_space_before(t, end)) {
        end -= n;
      } else {
        break;
      }
    }
    t = t.substr(0, end) + kept;
  }
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
  if (pos == start && pending_marks.empty()) return false;
  push(Tok::Text, pending_marks + src.text.substr(start, pos - start), here_of(start));
  pending_marks.clear();
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

}  // namespace

std::vector<Token> tokenize(const std::string& source, bool generation_marks) {
  Lexer lexer{source, drop_generation_tags(preprocess(source), generation_marks), {}, 0, 0, generation_marks, {}};
  lexer.run();
  if (!lexer.pending_marks.empty()) lexer.push(Tok::Text, std::move(lexer.pending_marks), source.size());
  return std::move(lexer.tokens);
}

size_t count_generation_tags(const std::string& source) {
  size_t found = 0;
  drop_generation_tags(preprocess(source), false, &found);
  return found;
}

}  // namespace loom::jinja
