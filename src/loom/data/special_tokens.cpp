// Added-token splitting, tokenizer_config.json and JSON key errors (special_tokens.h).
#include "loom/data/special_tokens.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <unicode/uchar.h>
#include <unicode/utf8.h>

#include "loom/core/error.h"

namespace loom {

std::string key_path(const std::string& where, const std::string& key) { return where.empty() ? key : where + "." + key; }

void JsonFile::fail(const std::string& key, const std::string& what) const {
  throw Error(str_cat(path, ": key ", key.empty() ? "(root)" : key, ": ", what));
}

const nlohmann::json* JsonFile::find(const nlohmann::json& obj, const std::string& where, const char* key) const {
  if (!obj.is_object()) fail(where, "expected a JSON object");
  const auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

const nlohmann::json& JsonFile::at(const nlohmann::json& obj, const std::string& where, const char* key) const {
  const nlohmann::json* value = find(obj, where, key);
  if (value == nullptr) fail(key_path(where, key), "missing");
  return *value;
}

std::string JsonFile::string_at(const nlohmann::json& obj, const std::string& where, const char* key) const {
  const nlohmann::json& value = at(obj, where, key);
  if (!value.is_string()) fail(key_path(where, key), "expected a string");
  return value.get<std::string>();
}

bool JsonFile::flag(const nlohmann::json& obj, const std::string& where, const char* key, bool fallback) const {
  const nlohmann::json* value = find(obj, where, key);
  if (value == nullptr) return fallback;
  if (!value->is_boolean()) fail(key_path(where, key), "expected true or false");
  return value->get<bool>();
}

AddedTokenSplitter::AddedTokenSplitter(std::vector<AddedToken> tokens) : tokens_(std::move(tokens)), by_first_byte_(256) {
  std::erase_if(tokens_, [](const AddedToken& t) { return t.content.empty(); });
  std::stable_sort(tokens_.begin(), tokens_.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  for (size_t i = 0; i < tokens_.size(); ++i)
    by_first_byte_[static_cast<unsigned char>(tokens_[i].content[0])].push_back(static_cast<uint32_t>(i));
}

const AddedToken* AddedTokenSplitter::match_at(std::string_view text, size_t pos, bool with_special) const {
  for (const uint32_t i : by_first_byte_[static_cast<unsigned char>(text[pos])]) {
    const AddedToken& token = tokens_[i];
    if ((with_special || !token.special) && text.substr(pos).starts_with(token.content)) return &token;
  }
  return nullptr;
}

namespace {

// Rust's regex \s (Unicode White_Space), which tokenizers' lstrip / rstrip take in; ill-formed
// bytes are not whitespace.
bool is_whitespace(UChar32 c) { return c >= 0 && u_isUWhiteSpace(c); }

// Rust's regex \w (Unicode's word characters, UTS #18): Alphabetic, marks, decimal digits,
// connector punctuation and Join_Control.
bool is_word(UChar32 c) {
  if (c < 0) return false;
  const int8_t type = u_charType(c);
  return u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL) ||
         type == U_NON_SPACING_MARK || type == U_ENCLOSING_MARK || type == U_COMBINING_SPACING_MARK ||
         type == U_DECIMAL_DIGIT_NUMBER || type == U_CONNECTOR_PUNCTUATION;
}

// The code point before byte `end` (end > 0), or a negative value for an ill-formed byte.
UChar32 code_point_before(std::string_view text, size_t end) {
  int32_t i = static_cast<int32_t>(end);
  UChar32 c = 0;
  U8_PREV(text.data(), 0, i, c);
  return c;
}

UChar32 code_point_at(std::string_view text, size_t pos) {
  int32_t i = static_cast<int32_t>(pos);
  UChar32 c = 0;
  U8_NEXT(text.data(), i, static_cast<int32_t>(text.size()), c);
  return c;
}

// Where the whitespace that ends text[0, end) begins (tokenizers' space_leftmost_at_end).
size_t whitespace_begin(std::string_view text, size_t end) {
  while (end > 0) {
    int32_t i = static_cast<int32_t>(end);
    UChar32 c = 0;
    U8_PREV(text.data(), 0, i, c);
    if (!is_whitespace(c)) break;
    end = static_cast<size_t>(i);
  }
  return end;
}

// Where the whitespace that starts text[pos, ...) ends (tokenizers' space_rightmost_at_start).
size_t whitespace_end(std::string_view text, size_t pos) {
  while (pos < text.size()) {
    int32_t i = static_cast<int32_t>(pos);
    UChar32 c = 0;
    U8_NEXT(text.data(), i, static_cast<int32_t>(text.size()), c);
    if (!is_whitespace(c)) break;
    pos = static_cast<size_t>(i);
  }
  return pos;
}

}  // namespace

// AddedVocabulary::find_matches of tokenizers: for each match, in the order found, a single_word
// token touching a word character is skipped; lstrip moves its start back over whitespace, but not
// before the end of the previous match; rstrip moves its end past whitespace. The text between
// the previous match's end and this start, when not empty, is a segment of its own.
std::vector<TextSegment> AddedTokenSplitter::split(std::string_view text, bool with_special) const {
  std::vector<TextSegment> segments;
  size_t plain_start = 0;  // the end of the previous match (tokenizers' start_offset)
  for (size_t pos = 0; pos < text.size() && !tokens_.empty();) {
    const AddedToken* token = match_at(text, pos, with_special);
    if (token == nullptr) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + token->content.size();
    pos = stop;  // the search goes on after the match as found, whatever is stripped
    if (token->single_word && ((start > 0 && is_word(code_point_before(text, start))) ||
                               (stop < text.size() && is_word(code_point_at(text, stop)))))
      continue;
    if (token->lstrip) start = std::max(whitespace_begin(text, start), plain_start);
    if (token->rstrip) stop = whitespace_end(text, stop);
    start = std::min(start, stop);  // an lstrip held back by a previous rstrip past this match
    if (start > plain_start) segments.push_back({text.substr(plain_start, start - plain_start), -1});
    segments.push_back({text.substr(start, stop - start), token->id});
    plain_start = stop;
  }
  if (plain_start < text.size()) segments.push_back({text.substr(plain_start), -1});
  return segments;
}

namespace {

// bos_token / eos_token: a string, or an AddedToken object {"content": ...}; null is absent.
std::optional<std::string> config_token(const JsonFile& file, const nlohmann::json& root, const char* key) {
  const nlohmann::json* value = file.find(root, "", key);
  if (value == nullptr) return std::nullopt;
  if (value->is_string()) return value->get<std::string>();
  return file.string_at(*value, key, "content");
}

std::optional<bool> config_flag(const JsonFile& file, const nlohmann::json& root, const char* key) {
  if (file.find(root, "", key) == nullptr) return std::nullopt;
  return file.flag(root, "", key, false);
}

}  // namespace

TokenizerConfig read_tokenizer_config(const std::string& path) {
  TokenizerConfig config;
  if (!std::filesystem::exists(path)) return config;
  const JsonFile file{path};
  const nlohmann::json root = read_json_file(path);
  config.add_bos_token = config_flag(file, root, "add_bos_token");
  config.add_eos_token = config_flag(file, root, "add_eos_token");
  config.bos_token = config_token(file, root, "bos_token");
  config.eos_token = config_token(file, root, "eos_token");
  return config;
}

}  // namespace loom
