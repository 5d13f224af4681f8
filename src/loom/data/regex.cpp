// PCRE2 behind loom::Regex (regex.h). PCRE2's API: pcre2_compile, pcre2_jit_compile,
// pcre2_match with per-call match data (pcre2api(3)).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "loom/data/regex.h"

#include <pcre2.h>

#include "loom/core/error.h"

namespace loom {

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  const int n = pcre2_get_error_message(code, buffer, sizeof(buffer));
  return n < 0 ? "PCRE2 error " + std::to_string(code) : std::string(reinterpret_cast<const char*>(buffer));
}

// The byte length of a well-formed UTF-8 sequence at text[pos], or 1 for anything else: where
// a search resumes after an empty match.
size_t step_at(std::string_view text, size_t pos) {
  const auto b = static_cast<unsigned char>(text[pos]);
  const size_t len = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 1;
  if (pos + len > text.size()) return 1;
  for (size_t i = 1; i < len; ++i)
    if ((static_cast<unsigned char>(text[pos + i]) & 0xC0) != 0x80) return 1;
  return len;
}

}  // namespace

Regex::Regex(const std::string& pattern, const std::string& where) : pattern_(pattern), code_(std::make_unique<Code>()) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
  LOOM_CHECK(code_->code != nullptr, where, ": regex does not compile: ", pcre2_message(error), " at offset ", offset);
  // JIT is an optimisation only: where it is unavailable the interpreter matches the same.
  (void)pcre2_jit_compile(code_->code, PCRE2_JIT_COMPLETE);
}

Regex::~Regex() = default;

std::vector<Regex::Match> Regex::find_all(std::string_view text) const {
  std::vector<Match> matches;
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
      pcre2_match_data_create_from_pattern(code_->code, nullptr), &pcre2_match_data_free);
  LOOM_CHECK(data != nullptr, "regex ", pattern_, ": out of memory for match data");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start < text.size()) {
    const int rc = pcre2_match(code_->code, subject, text.size(), start, 0, data.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    LOOM_CHECK(rc >= 0, "regex ", pattern_, ": matching failed: ", pcre2_message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    const size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      matches.push_back({begin, end});
      start = end;
    } else {
      start = begin + step_at(text, begin);
    }
  }
  return matches;
}

std::vector<std::string_view> split_isolated(const Regex& regex, std::string_view text) {
  std::vector<std::string_view> pieces;
  size_t previous = 0;
  for (const Regex::Match& m : regex.find_all(text)) {
    if (m.begin > previous) pieces.push_back(text.substr(previous, m.begin - previous));
    pieces.push_back(text.substr(m.begin, m.end - m.begin));
    previous = m.end;
  }
  if (previous < text.size()) pieces.push_back(text.substr(previous));
  return pieces;
}

}  // namespace loom
