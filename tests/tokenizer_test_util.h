// What the tokenizer tests share: the repository, temporary folders, files, and the text
// fragments that exercise pre-tokenizers and BPE.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace loom::tokenizer_test {

namespace fs = std::filesystem;

// The repository: $LOOM_SOURCE_DIR (ctest sets it), else the current directory.
inline fs::path source_dir() {
  const char* dir = std::getenv("LOOM_SOURCE_DIR");
  return dir && *dir ? fs::path(dir) : fs::current_path();
}

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
class TempDir {
 public:
  explicit TempDir(const std::string& name)
      : path_(fs::temp_directory_path() / ("loom_test_tokenizer_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  fs::path operator/(const std::string& name) const { return path_ / name; }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

inline void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
  ASSERT_TRUE(out.good()) << path;
}

inline std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Pieces that exercise every branch of GPT-2's regex and the BPE: scripts, CJK, emoji (with
// skin tone and ZWJ), accents precomposed and combining, every kind of whitespace JS's \s has
// (and U+0085, U+001F, which it has not), contractions in both cases, numbers of each kind,
// punctuation runs, the end-of-text literal, and quote/comma runs that hit the reference's
// comma-joined merge keys.
inline const std::vector<std::string>& corpus_fragments() {
  static const std::vector<std::string> fragments = {
      "Hello", " world", "Hello world", "GPT-2", " the", "The", "x", " a", "  ", "   ", "\t", "\n", "\n\n",
      "\r\n", " \n", "\t\t", " \t ", "\v", "\f", "I'm", "you're", " we've", "they'll", "he'd", "it's", "IT'S",
      "It'S", "'s", "'", "''", " 're", "don't", "DON'T", "rock'n'roll", "'ll've", "123", " 456", "3.14159",
      "1,000,000", "2024", "½", "²", "Ⅻ", "٣٤", "!!!", "?!", "...", "—", "--", " (", ")", "[x]",
      "{\"a\": 1, \"b\": [2, 3]}", "\",\"", ",\"", "\",", "\"", ",", ",\"\",", "\"],[\"", "'],'", "<|endoftext|>",
      "中文", "日本語のテキスト", "한국어", "😀", "👍🏽", "👨‍👩‍👧", "e\u0301", "café", "naïve", "Ω", "ﬁ",
      "\u00a0", "\u3000", "\u2028", "\u2029", "\u200b", "\u0085", "\u001f", "\ufeff", "\u2003", "\u1680",
      "Straße", "Ελληνικά", "русский", "עברית", "العربية", "हिन्दी", "ไทย", "$", "€100", "@user", "#tag",
      "http://example.com/a?b=c&d=e", "   leading", "trailing   ", "x\u0301\u0302", "ǅ", "ʰ", "\x7f",
      "ａｂｃ", "１２３", "🇫🇷", "\u0300", " \u0301x", "Ǆungla", "μ", "∑", "x²+y²",
  };
  return fragments;
}

// At least `count` test strings for a reference comparison: every fragment alone, the same
// with `extra` (e.g. special tokens) appended, long whitespace runs, \r\n, digit runs, then
// concatenations of 2-6 fragments drawn by a fixed-seed mt19937. Valid UTF-8 only.
inline std::vector<std::string> reference_strings(const std::vector<std::string>& extra, size_t count) {
  std::vector<std::string> strings = corpus_fragments();
  for (const std::string& e : extra) {
    strings.push_back(e);
    strings.push_back(std::string("Hello").append(e).append(" world"));
    strings.push_back(std::string(" ").append(e).append(e).append("\n").append(e).append("x"));
  }
  for (const size_t n : {1, 2, 3, 7, 16, 40}) {
    strings.push_back(std::string(n, ' ').append("x").append(n, ' '));
    strings.push_back(std::string("a").append(n, '\n').append("b\r\n\r\n c\t\t").append(n, ' '));
    strings.push_back(std::string(n, '7').append(" ").append(std::to_string(n * 1234567)).append(".").append(std::to_string(n)));
  }
  // Where JavaScript's \s (U+FEFF, not U+0085) and PCRE2's / Oniguruma's (U+0085, not U+FEFF)
  // differ, next to punctuation, letters, spaces and newlines.
  for (const char* s : {"!\u0085!", "a\u0085\u0085 b", ".\ufeff x", "\ufeff\ufeff\n", " \u0085\n", "x\u00a0\u00a0 y",
                        "'\ufeffs", "\u0085\u0085\u0085", "(\ufeff)", "1\u00852"})
    strings.emplace_back(s);
  std::vector<std::string> pool = corpus_fragments();
  pool.insert(pool.end(), extra.begin(), extra.end());
  std::mt19937 rng(20250101);
  while (strings.size() < count) {
    std::string s;
    for (size_t i = 0, n = 2 + rng() % 5; i < n; ++i) s += pool[rng() % pool.size()];
    strings.push_back(s);
  }
  return strings;
}

// Runs `command` (a shell line); the test fails loudly naming it when it exits non-zero.
inline bool run_command(const std::string& command) {
  const int status = std::system(command.c_str());
  EXPECT_EQ(status, 0) << command;
  return status == 0;
}

// Debian's python3 with sentencepiece: $LOOM_PYTHON (ctest sets it), else /usr/bin/python3.
inline std::string python() {
  const char* python = std::getenv("LOOM_PYTHON");
  return python && *python ? python : "/usr/bin/python3";
}

inline std::string sentencepiece_script() { return (source_dir() / "tools" / "sentencepiece_reference.py").string(); }

// tools/sentencepiece_reference.py train DIR OPTIONS: DIR/tokenizer.model and tokenizer.vocab
// (piece <tab> score per line). False, and a test failure naming the command, when it fails.
inline bool train_sentencepiece(const std::string& dir, const std::string& options = "") {
  return run_command(python() + " \"" + sentencepiece_script() + "\" train \"" + dir + "\" " + options);
}

// A string for a failure message: JSON-escaped, invalid UTF-8 replaced.
inline std::string shown(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Asserts that actual[i] == expected[i] for every string, listing the first few differences.
inline void expect_same_ids(const std::string& label, const std::vector<std::string>& strings,
                            const std::vector<std::vector<int32_t>>& expected,
                            const std::vector<std::vector<int32_t>>& actual) {
  ASSERT_EQ(expected.size(), strings.size()) << label << ": the reference gave no ids for some strings";
  ASSERT_EQ(actual.size(), strings.size());
  size_t differences = 0;
  for (size_t i = 0; i < strings.size(); ++i) {
    if (expected[i] == actual[i]) continue;
    if (++differences <= 5)
      ADD_FAILURE() << label << ": string " << i << " " << shown(strings[i]) << "\n  reference: "
                    << nlohmann::json(expected[i]).dump() << "\n  loom:      " << nlohmann::json(actual[i]).dump();
  }
  EXPECT_EQ(differences, 0u) << label << ": " << differences << " of " << strings.size() << " strings differ";
}

}  // namespace loom::tokenizer_test
