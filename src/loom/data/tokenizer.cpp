// ByteTokenizer and the factory that picks a tokenizer by name (tokenizer.h).
#include "loom/data/tokenizer.h"

#include <cstdio>
#include <filesystem>

#include "loom/core/error.h"
#include "loom/data/bpe.h"
#include "loom/data/hf_tokenizer.h"
#include "loom/data/sentencepiece_tokenizer.h"

namespace loom {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text, const EncodeOptions& /*options*/) const {
  std::vector<int32_t> tokens(text.size());  // (bytes)
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string ByteTokenizer::decode(std::span<const int32_t> tokens) const {
  std::string text;
  text.reserve(tokens.size());
  for (const int32_t id : tokens) {
    LOOM_CHECK(id >= 0 && id <= kEotToken, "tokenizer byte: token id ", id, " is outside [0, 257)");
    if (id == kEotToken) text += "<|endoftext|>";
    else text.push_back(static_cast<char>(id));
  }
  return text;
}

std::string ByteTokenizer::token_text(int32_t id) const {
  LOOM_CHECK(id >= 0 && id <= kEotToken, "tokenizer byte: token id ", id, " is outside [0, 257)");
  if (id == kEotToken) return "<|endoftext|>";
  char hex[8];
  std::snprintf(hex, sizeof(hex), "<0x%02X>", static_cast<unsigned>(id));
  return id > ' ' && id < 0x7F ? std::string(1, static_cast<char>(id)) : std::string(hex);
}

namespace {

namespace fs = std::filesystem;

// The tokenizer in a file: tokenizer.json (or any *.json) or tokenizer.model (or any *.model).
std::unique_ptr<Tokenizer> load_tokenizer_file(const fs::path& path) {
  if (path.extension() == ".json") return std::make_unique<HfTokenizer>(path.string());
  if (path.extension() == ".model") return std::make_unique<SentencePieceTokenizer>(path.string());
  throw Error(str_cat("tokenizer \"", path.string(), "\": expected a tokenizer.json or tokenizer.model file, or a directory"));
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& kind_or_dir) {
  if (kind_or_dir == "byte") return std::make_unique<ByteTokenizer>();
  if (kind_or_dir == "gpt2") return std::make_unique<BpeTokenizer>(kGpt2DefaultDir, "gpt2");
  const fs::path path(kind_or_dir);
  if (fs::is_regular_file(path)) return load_tokenizer_file(path);
  LOOM_CHECK(fs::is_directory(path), "tokenizer \"", kind_or_dir,
             "\": expected \"byte\", \"gpt2\", a tokenizer.json or tokenizer.model file, or a directory holding "
             "tokenizer.json, tokenizer.model, vocab.json + merges.txt or encoder.json + vocab.bpe");
  // Both files: the SentencePiece model (SentencePiece's own definition), which Llama 2 / Mistral /
  // Gemma directories carry beside a SentencePiece-style tokenizer.json (byte_fallback, Metaspace).
  for (const char* file : {"tokenizer.model", "tokenizer.json"})
    if (fs::is_regular_file(path / file)) return load_tokenizer_file(path / file);
  if (fs::is_regular_file(path / "vocab.json") || fs::is_regular_file(path / "merges.txt"))
    return std::make_unique<BpeTokenizer>((path / "vocab.json").string(), (path / "merges.txt").string(), kind_or_dir);
  // A folder with none of the files (a Hugging Face model folder saved without its tokenizer):
  // name every form, not only GPT-2's.
  LOOM_CHECK(fs::is_regular_file(path / "encoder.json") || fs::is_regular_file(path / "vocab.bpe"), kind_or_dir,
             ": no tokenizer in this folder: expected tokenizer.json, tokenizer.model, vocab.json + merges.txt or "
             "encoder.json + vocab.bpe (a Hugging Face folder saved without its tokenizer needs one copied in)");
  return load_gpt2_tokenizer(kind_or_dir);
}

}  // namespace loom
