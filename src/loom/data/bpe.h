// Byte-level BPE in GPT-2's format (Radford et al. 2019, "Language Models are Unsupervised
// Multitask Learners", section 2.2): loading and encoding (bpe.cpp), training (bpe_train.cpp).
//
// A vocabulary is a directory with two files:
//   encoder.json  {"token": id, ...}: ids 0..n-1, each token written in GPT-2's byte alphabet
//                 (bytes_to_unicode: byte b is the code point b when b is printable Latin-1,
//                 else 256 + k, so that every byte is one visible character); "<|endoftext|>"
//                 is the end-of-text token.
//   vocab.bpe     "#version: 0.2", then one merge "left right" per line, best (rank 0) first.
//
// Encoding (bpe.cpp): split the text with GPT-2's pre-tokenizer (unicode.h); in each piece
// start from one token per byte and repeatedly merge the adjacent pair of lowest rank, every
// occurrence of it left to right, until no adjacent pair has a rank.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loom/data/tokenizer.h"

namespace loom {

// GPT-2's byte alphabet: [byte] -> the code point that stands for it in encoder.json/vocab.bpe.
std::array<char32_t, 256> gpt2_byte_alphabet();
// The token string of raw bytes in that alphabet (UTF-8): "\x20hi" -> "Ġhi".
std::string gpt2_bytes_to_token(std::string_view bytes);

class BpeTokenizer final : public Tokenizer {
 public:
  // Reads dir/encoder.json and dir/vocab.bpe and checks them (dense ids, every merge's parts
  // and result in encoder.json, "<|endoftext|>" present); `name` is what name() returns.
  BpeTokenizer(const std::string& dir, std::string name);

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> tokens) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(token_bytes_.size()); }
  int32_t eot_token() const override { return eot_token_; }
  std::string name() const override { return name_; }
  // The merges in rank order as vocab.bpe lists them: "left right", in GPT-2's byte alphabet.
  std::vector<std::string> merge_lines() const;

 private:
  struct MergeRule {
    int32_t rank;    // line of the merge in vocab.bpe, 0 = merged first
    int32_t merged;  // id of the merged token
  };
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  struct CachedPiece {
    uint32_t offset;  // into cache_tokens_
    uint32_t count;
  };

  void load_encoder(const std::string& path, std::unordered_map<std::string, int32_t>& ids);
  void load_merges(const std::string& path, const std::unordered_map<std::string, int32_t>& ids);
  void add_merge(int32_t left, int32_t right, MergeRule rule);
  const MergeRule* find_merge(int32_t left, int32_t right) const;
  // Appends the tokens of one pre-token to `out`, from the cache or by merge_piece into `scratch`.
  void encode_piece(std::string_view piece, std::vector<int32_t>& scratch, std::vector<int32_t>& out) const;
  void merge_piece(std::string_view piece, std::vector<int32_t>& tokens) const;

  std::string name_;
  int32_t eot_token_ = -1;
  std::vector<std::string> token_bytes_;                // [id] -> the raw bytes it stands for
  std::array<int32_t, 256> byte_token_{};               // [byte] -> id of the one-byte token
  std::unordered_map<uint64_t, MergeRule> merges_;      // [(left id << 32) | right id]

  // BPE result per distinct piece of at most kCacheMaxPieceBytes, shared by all calls and
  // guarded by cache_mutex_ (encode is thread-safe; concurrent callers contend for it). Cleared
  // when it would pass kCacheMaxPieces pieces or kCacheMaxTokens tokens (tens of MB at most).
  static constexpr size_t kCacheMaxPieceBytes = 256;
  static constexpr size_t kCacheMaxPieces = size_t{1} << 18;
  static constexpr size_t kCacheMaxTokens = size_t{1} << 22;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, CachedPiece, StringHash, std::equal_to<>> cache_;  // [piece bytes]
  mutable std::vector<int32_t> cache_tokens_;  // [sum of cached piece lengths]
};

// GPT-2's BPE from a directory with encoder.json + vocab.bpe (GPT-2's own: kGpt2DefaultDir).
// A missing file is a loom::Error naming its path and how to get it.
std::unique_ptr<BpeTokenizer> load_gpt2_tokenizer(const std::string& dir);

struct BpeTrainResult {
  int64_t vocab_size = 0;  // tokens written: 256 bytes + learned tokens + "<|endoftext|>"
  int64_t merges = 0;      // lines of vocab.bpe after the version line
};

// Learns a byte-level BPE vocabulary of at most `vocab_size` tokens (256 bytes, merges, and
// "<|endoftext|>" as the last id) from `text`, and writes out_dir/encoder.json and
// out_dir/vocab.bpe atomically (creating out_dir). Fewer tokens result when no pair of symbols
// occurs at least twice any more. Deterministic: the same text and size give the same files.
BpeTrainResult train_bpe(std::string_view text, int64_t vocab_size, const std::string& out_dir);

}  // namespace loom
