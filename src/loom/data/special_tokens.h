// What tokenizer.json and tokenizer.model tokenizers share: added tokens found in the text
// before pre-tokenization, tokenizer_config.json's BOS/EOS keys, and JSON reading whose errors
// name the file and the key.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/core/file_io.h"    // read_text_file
#include "loom/core/json_file.h"  // read_json_file
#include "loom/data/tokenizer.h"

namespace loom {

// A JSON file being read: errors name the file and the key path ("model.merges[3]").
struct JsonFile {
  std::string path;
  // obj[key] when obj is an object holding a non-null key, else nullptr. `where` is obj's key
  // path ("" for the root); throws naming `where` when obj is not an object.
  const nlohmann::json* find(const nlohmann::json& obj, const std::string& where, const char* key) const;
  // obj[key], which must be present and not null.
  const nlohmann::json& at(const nlohmann::json& obj, const std::string& where, const char* key) const;
  std::string string_at(const nlohmann::json& obj, const std::string& where, const char* key) const;
  // obj[key] as a bool; `fallback` when absent or null.
  bool flag(const nlohmann::json& obj, const std::string& where, const char* key, bool fallback) const;
  // A loom::Error "<path>: key <key>: <what>".
  [[noreturn]] void fail(const std::string& key, const std::string& what) const;
};
std::string key_path(const std::string& where, const std::string& key);

// An added token: its text and id; special ones are matched only when the caller parses them.
// The flags of Hugging Face tokenizers' AddedToken (tokenizer/added_vocabulary.rs): lstrip / rstrip
// make a match take in the whitespace on its left / right (its regexes \s*$ and ^\s*: Unicode
// White_Space), which the text around it then lacks; single_word keeps a match only where no word
// character (\w: Alphabetic, marks, Nd, Pc, Join_Control) touches it on either side.
struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
};

// A stretch of text, or one added token (token >= 0) found in it.
struct TextSegment {
  std::string_view text;
  int32_t token = -1;
};

// Splits text at added tokens as Hugging Face tokenizers does (AddedVocabulary::find_matches):
// leftmost match first, and at one position the longest token; the search goes on after each
// match as found (a single_word match refused there included), the stripped whitespace aside.
// Special tokens are matched only with `with_special`. A token's segment holds what its match
// took in (the token and the whitespace it stripped).
class AddedTokenSplitter {
 public:
  explicit AddedTokenSplitter(std::vector<AddedToken> tokens);
  std::vector<TextSegment> split(std::string_view text, bool with_special) const;
  bool empty() const { return tokens_.empty(); }

 private:
  // The longest token that matches text at pos, or nullptr.
  const AddedToken* match_at(std::string_view text, size_t pos, bool with_special) const;

  std::vector<AddedToken> tokens_;                   // longest first
  std::vector<std::vector<uint32_t>> by_first_byte_;  // [byte] -> indices into tokens_, longest first
};

// A tokenizer whose files name BOS / EOS / end of text (tokenizer.json, tokenizer.model): the
// three accessors read `specials_`, which the constructor fills.
class TokenizerWithSpecials : public Tokenizer {
 public:
  int32_t eot_token() const override { return specials_.eot; }
  std::optional<int32_t> bos_token() const override { return specials_.bos; }
  std::optional<int32_t> eos_token() const override { return specials_.eos; }

 protected:
  struct {
    std::optional<int32_t> bos, eos;
    int32_t eot = -1;
  } specials_;
};

// tokenizer_config.json (Hugging Face transformers): the keys that change what encode adds.
struct TokenizerConfig {
  std::optional<bool> add_bos_token;
  std::optional<bool> add_eos_token;
  std::optional<std::string> bos_token;  // the token's text ("<s>")
  std::optional<std::string> eos_token;
};
// The file at `path` when it exists, else every key absent.
TokenizerConfig read_tokenizer_config(const std::string& path);

}  // namespace loom
