// The merge step of BPE, shared by GPT-2's files (bpe.h) and Hugging Face's tokenizer.json
// (hf_tokenizer.h): a pre-token starts as its symbols and the adjacent pair of lowest rank is
// merged, every occurrence left to right, until no adjacent pair has a rank (Sennrich et al.
// 2016; GPT-2's encoder.py bpe(); the BPE model of Hugging Face tokenizers, models/bpe).
// The symbols are either one token per byte (byte-level BPE: GPT-2, Llama 3, Qwen2) or, for
// SentencePiece-style BPE shipped as tokenizer.json (Llama 2, Mistral, Gemma), one token per
// character: a character outside the vocabulary becomes the tokens <0xNN> of its UTF-8 bytes
// when the model has byte_fallback, else the unknown token (runs of them one token with
// fuse_unk), as tokenizers' BPE::merge_word does before merging.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace loom {

struct BpeMerge {
  int32_t left;    // id of the left part
  int32_t right;   // id of the right part
  int32_t merged;  // id of the token they make
};

// How a SentencePiece-style BPE starts a piece: one symbol per UTF-8 character (an ill-formed
// byte is a character of its own).
struct BpeCharacters {
  std::unordered_map<std::string, int32_t> ids;  // [one character's UTF-8] -> id, for those in the vocab
  bool byte_fallback = false;                    // a character not in `ids`: its bytes' <0xNN> tokens
  std::array<int32_t, 256> byte_tokens{};        // [byte] -> id of "<0xNN>" (byte_fallback)
  int32_t unk = -1;                              // else this token (-1: none; the loader refuses that)
  bool fuse_unk = false;                         // adjacent unknown characters make one unk
};

class BpeModel {
 public:
  // byte_token[b]: the id of the one-byte token of byte b. merges: best (rank 0) first; a pair
  // listed twice keeps its last rank, as in encoder.py's dict and tokenizers' merge map.
  BpeModel(const std::array<int32_t, 256>& byte_token, const std::vector<BpeMerge>& merges);
  // SentencePiece-style: a piece starts as its characters (see BpeCharacters).
  BpeModel(BpeCharacters characters, const std::vector<BpeMerge>& merges);

  // Appends the tokens of one pre-token (raw bytes) to `out`, from the cache or by merging in
  // `scratch`. Thread-safe.
  void encode_piece(std::string_view piece, std::vector<int32_t>& scratch, std::vector<int32_t>& out) const;
  // The merges in rank order (best first), each pair once (GGUF's tokenizer.ggml.merges).
  std::vector<BpeMerge> merges() const;

 private:
  struct MergeRule {
    int32_t rank;    // index in the merge list, 0 = merged first
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

  const MergeRule* find_merge(int32_t left, int32_t right) const;
  void merge_piece(std::string_view piece, std::vector<int32_t>& tokens) const;
  void character_symbols(std::string_view piece, std::vector<int32_t>& tokens) const;
  void merge_by_queue(std::vector<int32_t>& tokens) const;

  std::array<int32_t, 256> byte_token_{};           // [byte] -> id of the one-byte token
  std::unique_ptr<BpeCharacters> characters_;       // SentencePiece-style symbols, else null (bytes)
  std::unordered_map<uint64_t, MergeRule> merges_;  // [(left id << 32) | right id]

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

}  // namespace loom
