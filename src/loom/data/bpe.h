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
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loom/data/bpe_model.h"
#include "loom/data/tokenizer.h"

namespace loom {

// GPT-2's byte alphabet: [byte] -> the code point that stands for it in encoder.json/vocab.bpe.
std::array<char32_t, 256> gpt2_byte_alphabet();
// The token string of raw bytes in that alphabet (UTF-8): "\x20hi" -> "Ġhi".
std::string gpt2_bytes_to_token(std::string_view bytes);
// The raw bytes a token string in that alphabet stands for: "Ġhi" -> "\x20hi"; nullopt when a
// character is outside the alphabet.
std::optional<std::string> gpt2_token_to_bytes(std::string_view token);
// The merges of `model` by rank as "left right" lines in that alphabet (vocab.bpe's lines);
// token_bytes[id]: the raw bytes of token id.
std::vector<std::string> gpt2_merge_lines(const BpeModel& model, const std::vector<std::string>& token_bytes);

class BpeTokenizer final : public Tokenizer {
 public:
  // Reads dir/encoder.json and dir/vocab.bpe and checks them (dense ids, every merge's parts
  // and result in encoder.json, "<|endoftext|>" present); `name` is what name() returns.
  BpeTokenizer(const std::string& dir, std::string name);
  // The same from two named files: encoder.json + vocab.bpe, or Hugging Face's slow-tokenizer
  // vocab.json + merges.txt (the same two formats under other names).
  BpeTokenizer(const std::string& vocab_path, const std::string& merges_path, std::string name);

  using Tokenizer::encode;
  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& options) const override;
  std::string decode(std::span<const int32_t> tokens) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(token_bytes_.size()); }
  int32_t eot_token() const override { return eot_token_; }
  std::optional<int32_t> eos_token() const override { return eot_token_; }
  std::string token_text(int32_t id) const override;
  std::string name() const override { return name_; }
  // The merges in rank order as vocab.bpe lists them: "left right", in GPT-2's byte alphabet.
  std::vector<std::string> merge_lines() const;

 private:
  void load_encoder(const std::string& path, std::unordered_map<std::string, int32_t>& ids);
  void load_merges(const std::string& path, const std::unordered_map<std::string, int32_t>& ids);

  std::string name_;
  int32_t eot_token_ = -1;
  std::vector<std::string> token_bytes_;  // [id] -> the raw bytes it stands for
  std::array<int32_t, 256> byte_token_{};  // [byte] -> id of the one-byte token
  std::unique_ptr<BpeModel> model_;
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
