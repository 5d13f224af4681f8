// GPT-2's pre-tokenizer as a scanner; the regex and the class definitions are in unicode.h.
//
// At each position the regex tries its alternatives in order; with c the code point there:
//   1. c is "'" and the text continues with s t m d / re ve ll  -> that contraction.
//   2. c is U+0020 and the next code point is a letter, number or other: the space plus the
//      maximal run of that class (" ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+").
//   3. c is a letter, number or other: the maximal run of its class.
//   4. c is whitespace: let the maximal whitespace run have k code points. At the end of the
//      text "\s+(?!\S)" takes all k; before a non-space it backtracks to k-1, leaving the last
//      whitespace to start the next piece (so " world" keeps its space); when k = 1 that
//      alternative fails and "\s+" takes the single code point.
#include "loom/data/unicode.h"

#include <unicode/uchar.h>

#include <array>
#include <cstdint>

namespace loom {
namespace {

constexpr std::array<CodePointClass, 128> make_ascii_classes() {
  std::array<CodePointClass, 128> table{};
  for (int c = 0; c < 128; ++c) {
    CodePointClass cls = CODE_POINT_CLASS_OTHER;
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) cls = CODE_POINT_CLASS_LETTER;
    if (c >= '0' && c <= '9') cls = CODE_POINT_CLASS_NUMBER;
    if ((c >= 0x09 && c <= 0x0D) || c == ' ') cls = CODE_POINT_CLASS_SPACE;
    table[static_cast<size_t>(c)] = cls;
  }
  return table;
}
constexpr std::array<CodePointClass, 128> kAsciiClasses = make_ascii_classes();  // [byte]

CodePointClass classify(UChar32 cp) {
  if (cp == 0xFEFF || cp == 0x2028 || cp == 0x2029) return CODE_POINT_CLASS_SPACE;
  switch (u_charType(cp)) {
    case U_SPACE_SEPARATOR:
      return CODE_POINT_CLASS_SPACE;
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      return CODE_POINT_CLASS_LETTER;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER:
      return CODE_POINT_CLASS_NUMBER;
    default:
      return CODE_POINT_CLASS_OTHER;
  }
}

bool is_continuation(unsigned char b) { return (b & 0xC0) == 0x80; }

// Decodes the multi-byte sequence at text[pos] (lead byte >= 0x80) strictly (RFC 3629);
// returns its length, or 0 when the bytes there are not valid UTF-8.
size_t decode_multibyte(std::string_view text, size_t pos, UChar32& cp) {
  const auto at = [&](size_t i) { return static_cast<unsigned char>(text[pos + i]); };
  const size_t left = text.size() - pos;
  const unsigned char b0 = at(0);
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    if (left < 2 || !is_continuation(at(1))) return 0;
    cp = ((b0 & 0x1F) << 6) | (at(1) & 0x3F);
    return 2;
  }
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    if (left < 3 || !is_continuation(at(1)) || !is_continuation(at(2))) return 0;
    if (b0 == 0xE0 && at(1) < 0xA0) return 0;  // overlong
    if (b0 == 0xED && at(1) > 0x9F) return 0;  // UTF-16 surrogate
    cp = ((b0 & 0x0F) << 12) | ((at(1) & 0x3F) << 6) | (at(2) & 0x3F);
    return 3;
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    if (left < 4 || !is_continuation(at(1)) || !is_continuation(at(2)) || !is_continuation(at(3))) return 0;
    if (b0 == 0xF0 && at(1) < 0x90) return 0;  // overlong
    if (b0 == 0xF4 && at(1) > 0x8F) return 0;  // above U+10FFFF
    cp = ((b0 & 0x07) << 18) | ((at(1) & 0x3F) << 12) | ((at(2) & 0x3F) << 6) | (at(3) & 0x3F);
    return 4;
  }
  return 0;
}

}  // namespace

ScannedCodePoint scan_code_point(std::string_view text, size_t pos) {
  const unsigned char b0 = static_cast<unsigned char>(text[pos]);
  if (b0 < 0x80) return {kAsciiClasses[b0], 1};
  UChar32 cp = 0;
  const size_t bytes = decode_multibyte(text, pos, cp);
  if (bytes == 0) return {CODE_POINT_CLASS_OTHER, 1};
  return {classify(cp), bytes};
}

std::string_view Gpt2PreTokenizer::next() {
  const size_t start = pos_;
  if (start >= text_.size()) return {};
  size_t end = start + contraction_bytes(start);  // case 1
  if (end == start) {
    const bool space_then_more = text_[start] == ' ' && start + 1 < text_.size();
    const CodePointClass after_space = space_then_more ? scan_code_point(text_, start + 1).cls : CODE_POINT_CLASS_SPACE;
    const CodePointClass here = scan_code_point(text_, start).cls;
    if (after_space != CODE_POINT_CLASS_SPACE) end = class_run_end(start + 1, after_space);  // case 2
    else if (here != CODE_POINT_CLASS_SPACE) end = class_run_end(start, here);               // case 3
    else end = space_match_end(start);                                                       // case 4
  }
  pos_ = end;
  return text_.substr(start, end - start);
}

// Bytes of the contraction ('s 't 're 've 'm 'll 'd) at pos, or 0 when there is none.
size_t Gpt2PreTokenizer::contraction_bytes(size_t pos) const {
  if (text_[pos] != '\'' || pos + 1 >= text_.size()) return 0;
  const char c1 = text_[pos + 1];
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  if (pos + 2 >= text_.size()) return 0;
  const char c2 = text_[pos + 2];
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  return 0;
}

// End of the maximal run of code points of class `cls` starting at pos.
size_t Gpt2PreTokenizer::class_run_end(size_t pos, CodePointClass cls) const {
  while (pos < text_.size()) {
    const ScannedCodePoint cp = scan_code_point(text_, pos);
    if (cp.cls != cls) break;
    pos += cp.bytes;
  }
  return pos;
}

// End of the whitespace match at pos: "\s+(?!\S)", else "\s+" (case 4 above).
size_t Gpt2PreTokenizer::space_match_end(size_t pos) const {
  size_t last_start = pos;  // start of the run's last code point
  size_t count = 0;
  while (pos < text_.size()) {
    const ScannedCodePoint cp = scan_code_point(text_, pos);
    if (cp.cls != CODE_POINT_CLASS_SPACE) break;
    last_start = pos;
    pos += cp.bytes;
    ++count;
  }
  if (pos == text_.size() || count == 1) return pos;
  return last_start;
}

}  // namespace loom
