// SentencePiece tokenizer.model through libsentencepiece (sentencepiece_tokenizer.h).
#include "loom/data/sentencepiece_tokenizer.h"

#include <sentencepiece_processor.h>

#include <filesystem>

#include "loom/core/error.h"

namespace loom {

SentencePieceTokenizer::SentencePieceTokenizer(const std::string& path)
    : name_(path), processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  LOOM_CHECK(std::filesystem::is_regular_file(path), path, ": not found");
  const auto status = processor_->Load(path);
  LOOM_CHECK(status.ok(), path, ": not a SentencePiece model: ", status.ToString());
  vocab_size_ = processor_->GetPieceSize();
  if (processor_->bos_id() >= 0) specials_.bos = processor_->bos_id();
  if (processor_->eos_id() >= 0) specials_.eos = processor_->eos_id();
  LOOM_CHECK(specials_.eos.has_value(), path, ": the model has no end-of-sequence piece (eos_id is -1)");
  specials_.eot = *specials_.eos;

  const std::string config_path = (std::filesystem::path(path).parent_path() / "tokenizer_config.json").string();
  const TokenizerConfig config = read_tokenizer_config(config_path);
  const JsonFile file{config_path};
  config_add_bos_ = config.add_bos_token;
  config_add_eos_ = config.add_eos_token;
  add_bos_ = config.add_bos_token.value_or(false);
  add_eos_ = config.add_eos_token.value_or(false);
  if (add_bos_ && !specials_.bos) file.fail("add_bos_token", "true, but " + path + " has no BOS piece");
  if (add_eos_ && !specials_.eos) file.fail("add_eos_token", "true, but " + path + " has no EOS piece");

  std::vector<AddedToken> controls;
  for (int32_t id = 0; id < vocab_size_; ++id)
    if (processor_->IsControl(id)) controls.push_back({processor_->IdToPiece(id), id, true});
  controls_ = std::make_unique<AddedTokenSplitter>(std::move(controls));
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

void SentencePieceTokenizer::encode_plain(std::string_view text, std::vector<int32_t>& out) const {
  std::vector<int> ids;
  const auto status = processor_->Encode(text, &ids);
  LOOM_CHECK(status.ok(), "tokenizer ", name_, ": SentencePiece encode failed: ", status.ToString());
  out.insert(out.end(), ids.begin(), ids.end());
}

std::vector<int32_t> SentencePieceTokenizer::encode(std::string_view text, const EncodeOptions& options) const {
  std::vector<int32_t> out;
  if (options.add_special_tokens && add_bos_) out.push_back(*specials_.bos);
  for (const TextSegment& segment : controls_->split(text, options.parse_special_tokens)) {
    if (segment.token >= 0) out.push_back(segment.token);
    else encode_plain(segment.text, out);
  }
  if (options.add_special_tokens && add_eos_) out.push_back(*specials_.eos);
  return out;
}

void SentencePieceTokenizer::check_id(int32_t id) const {
  LOOM_CHECK(id >= 0 && id < vocab_size_, "tokenizer ", name_, ": token id ", id, " is outside [0, ", vocab_size_, ")");
}

std::string SentencePieceTokenizer::decode(std::span<const int32_t> tokens) const {
  for (const int32_t id : tokens) check_id(id);
  std::string text;
  const auto status = processor_->Decode(std::vector<int>(tokens.begin(), tokens.end()), &text);
  LOOM_CHECK(status.ok(), "tokenizer ", name_, ": SentencePiece decode failed: ", status.ToString());
  return text;
}

SentencePieceModel SentencePieceTokenizer::model() const {
  return parse_sentencepiece_model(processor_->serialized_model_proto(), name_);
}

std::string SentencePieceTokenizer::token_text(int32_t id) const {
  check_id(id);
  return processor_->IdToPiece(id);
}

}  // namespace loom
