// A compiled regular expression for tokenizer pre-tokenizers, run by PCRE2 (Perl-compatible,
// Debian's libpcre2-8) as the tokenizer file writes it: tokenizer.json's Split patterns and the
// GPT-2 pattern of its ByteLevel pre-tokenizer (Hugging Face tokenizers' own engine is
// Oniguruma; PCRE2 reads the same syntax for these patterns: \p{L}, (?i:...), (?!\S), {1,3}).
//
// Compiled with PCRE2_UTF | PCRE2_UCP (\s, \w and \d by Unicode properties) and
// PCRE2_MATCH_INVALID_UTF: text that is not valid UTF-8 is matched piecewise, an invalid byte
// never matching any part of the pattern, so every byte string can be searched.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

class Regex {
 public:
  // Throws loom::Error "<where>: regex ...: <PCRE2's message> at offset N" when it does not compile.
  Regex(const std::string& pattern, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  struct Match {
    size_t begin;
    size_t end;  // > begin: empty matches are not reported
  };
  // Every non-empty, non-overlapping match in `text`, left to right (as a global search does).
  // Thread-safe: each call has its own match data.
  std::vector<Match> find_all(std::string_view text) const;
  const std::string& pattern() const { return pattern_; }

 private:
  struct Code;
  std::string pattern_;
  std::unique_ptr<Code> code_;
};

// Splits `text` by `regex` with Hugging Face's "Isolated" behaviour: every match is a piece,
// and so is every non-empty stretch between matches. The pieces tile the text.
std::vector<std::string_view> split_isolated(const Regex& regex, std::string_view text);

}  // namespace loom
