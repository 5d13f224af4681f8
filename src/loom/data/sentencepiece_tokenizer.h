// A SentencePiece model (tokenizer.model: Llama 2, Mistral; Kudo & Richardson 2018), run by
// Debian's libsentencepiece, the library that trained and defines the format.
//
// encode: SentencePieceProcessor::Encode of the text. With parse_special_tokens, the control
// pieces written in the text ("<s>", "</s>") are split off first and become their ids, as
// Hugging Face's LlamaTokenizer does; otherwise they are plain text. add_special_tokens adds BOS
// and/or EOS as tokenizer_config.json beside the model says (add_bos_token, add_eos_token;
// Llama 2: BOS only); without that file nothing is added.
// decode: SentencePieceProcessor::Decode; control pieces (BOS, EOS) decode to nothing. The
// round trip decode(encode(x)) == x holds for a model whose normalizer is the identity and
// that keeps extra whitespace (Llama 2's settings) and valid UTF-8 text without control pieces.
#pragma once
#include <memory>
#include <optional>
#include <string>

#include "loom/data/sentencepiece_model.h"
#include "loom/data/special_tokens.h"
#include "loom/data/tokenizer.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace loom {

class SentencePieceTokenizer final : public TokenizerWithSpecials {
 public:
  // `path`: a tokenizer.model file.
  explicit SentencePieceTokenizer(const std::string& path);
  ~SentencePieceTokenizer() override;

  using Tokenizer::encode;
  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& options) const override;
  std::string decode(std::span<const int32_t> tokens) const override;
  int64_t vocab_size() const override { return vocab_size_; }
  std::string token_text(int32_t id) const override;
  std::string name() const override { return name_; }
  // The model's pieces, scores, types and settings, read from the file's bytes.
  SentencePieceModel model() const;
  // tokenizer_config.json's add_bos_token / add_eos_token beside the model; nullopt when not given.
  std::optional<bool> config_add_bos() const { return config_add_bos_; }
  std::optional<bool> config_add_eos() const { return config_add_eos_; }

 private:
  void encode_plain(std::string_view text, std::vector<int32_t>& out) const;
  void check_id(int32_t id) const;

  std::string name_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
  int64_t vocab_size_ = 0;
  std::optional<bool> config_add_bos_, config_add_eos_;
  bool add_bos_ = false, add_eos_ = false;
  std::unique_ptr<AddedTokenSplitter> controls_;  // the control pieces, as special tokens
};

}  // namespace loom
