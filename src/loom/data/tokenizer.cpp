// ByteTokenizer and the factory that picks a tokenizer by name (tokenizer.h).
#include "loom/data/tokenizer.h"

#include <filesystem>

#include "loom/core/error.h"
#include "loom/data/bpe.h"

namespace loom {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
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

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& kind_or_dir) {
  if (kind_or_dir == "byte") return std::make_unique<ByteTokenizer>();
  if (kind_or_dir == "gpt2") return std::make_unique<BpeTokenizer>(kGpt2DefaultDir, "gpt2");
  LOOM_CHECK(std::filesystem::is_directory(kind_or_dir), "tokenizer \"", kind_or_dir,
             "\": expected \"byte\", \"gpt2\" or a directory holding encoder.json and vocab.bpe");
  return load_gpt2_tokenizer(kind_or_dir);
}

}  // namespace loom
