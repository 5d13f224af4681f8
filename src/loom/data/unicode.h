// GPT-2's pre-tokenizer: the split of text into the pieces that BPE merges within.
//
// GPT-2 (and the JavaScript reference, gpt-3-encoder's Encoder.js) split text with the regex
//
//   /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu
//
// Gpt2PreTokenizer is a hand-written scanner over UTF-8 code points that returns exactly the
// matches of that regex, with JavaScript's meaning of each class (the `u` flag):
//   \p{L}  general categories Lu Ll Lt Lm Lo             (ICU u_charType)
//   \p{N}  general categories Nd Nl No                   (ICU u_charType)
//   \s     U+0009-000D, U+FEFF, U+2028, U+2029 and Zs (U+0020, U+00A0, U+1680, U+2000-200A,
//          U+202F, U+205F, U+3000); NOT U+001C-001F or U+0085, which Python's \s would include.
// Alternatives are tried in order at each position, as a backtracking regex does; the case
// analysis is in unicode.cpp. The contractions are case-sensitive ("'S" is "'" then "S").
//
// Bytes that are not valid UTF-8 (strictly: no overlongs, no surrogates, nothing above
// U+10FFFF) are scanned one byte at a time as members of [^\s\p{L}\p{N}], so every byte string
// splits, and the pieces always concatenate back to the input.
#pragma once
#include <cstddef>
#include <string_view>

namespace loom {

// What a code point is to GPT-2's regex. Every code point is exactly one of these.
enum CodePointClass : unsigned char {
  CODE_POINT_CLASS_SPACE,   // \s (JavaScript)
  CODE_POINT_CLASS_LETTER,  // \p{L}
  CODE_POINT_CLASS_NUMBER,  // \p{N}
  CODE_POINT_CLASS_OTHER,   // [^\s\p{L}\p{N}], and every byte of invalid UTF-8
};

struct ScannedCodePoint {
  CodePointClass cls;
  size_t bytes;  // 1..4: its length in the UTF-8 text
};

// The class and length of the code point starting at text[pos] (pos < text.size()).
ScannedCodePoint scan_code_point(std::string_view text, size_t pos);

// Splits text into GPT-2's pre-tokens, in order; the pieces tile the text exactly.
//   Gpt2PreTokenizer split(text);
//   for (std::string_view piece = split.next(); !piece.empty(); piece = split.next()) ...
// The pieces are views into `text`, which must outlive the pre-tokenizer.
class Gpt2PreTokenizer {
 public:
  explicit Gpt2PreTokenizer(std::string_view text) : text_(text) {}
  // The next piece, or an empty view once the text is exhausted.
  std::string_view next();

 private:
  size_t contraction_bytes(size_t pos) const;
  size_t class_run_end(size_t pos, CodePointClass cls) const;
  size_t space_match_end(size_t pos) const;

  std::string_view text_;
  size_t pos_ = 0;  // byte offset of the next piece
};

}  // namespace loom
