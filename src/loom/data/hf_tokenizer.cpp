// tokenizer.json encoding and decoding (hf_tokenizer.h), in the order of Hugging Face
// tokenizers' pipeline: added tokens are split off the raw text, each stretch between them is
// normalized, pre-tokenized and merged by the BPE model, and the post-processor's template
// adds BOS/EOS. Loading is in hf_tokenizer_load.cpp.
#include "loom/data/hf_tokenizer.h"

#include <unicode/normalizer2.h>
#include <unicode/utf8.h>

#include "loom/core/error.h"
#include "loom/data/bpe.h"

namespace loom {
namespace {

// NFC of valid UTF-8 (ICU's Normalizer2); `text` must be well-formed.
void append_nfc(std::string_view text, std::string& out) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
  LOOM_CHECK(U_SUCCESS(status), "ICU: NFC normalizer unavailable: ", u_errorName(status));
  icu::StringByteSink<std::string> sink(&out);
  nfc->normalizeUTF8(0, icu::StringPiece(text.data(), static_cast<int32_t>(text.size())), sink, nullptr, status);
  LOOM_CHECK(U_SUCCESS(status), "ICU: NFC normalization failed: ", u_errorName(status));
}

// NFC of each well-formed stretch; ill-formed bytes are kept as they are.
std::string nfc_normalize(std::string_view text) {
  std::string out;
  size_t run = 0;  // start of the current well-formed stretch
  for (int32_t i = 0; i < static_cast<int32_t>(text.size());) {
    const int32_t start = i;
    UChar32 c = 0;
    U8_NEXT(text.data(), i, static_cast<int32_t>(text.size()), c);
    if (c >= 0) continue;
    append_nfc(text.substr(run, static_cast<size_t>(start) - run), out);
    out.append(text.substr(static_cast<size_t>(start), static_cast<size_t>(i - start)));
    run = static_cast<size_t>(i);
  }
  append_nfc(text.substr(run), out);
  return out;
}

}  // namespace

std::vector<std::string> HfTokenizer::pre_tokenize(std::string text) const {
  std::vector<std::string> pieces;
  if (!text.empty()) pieces.push_back(std::move(text));
  for (const Step& step : steps_) {
    std::vector<std::string> next;
    for (std::string& piece : pieces) {
      if (step.add_prefix_space && piece[0] != ' ') piece.insert(0, 1, ' ');
      if (step.split == nullptr) {
        next.push_back(std::move(piece));
        continue;
      }
      for (const std::string_view part : split_isolated(*step.split, piece)) next.emplace_back(part);
    }
    pieces = std::move(next);
  }
  return pieces;
}

void HfTokenizer::encode_plain(std::string_view text, std::vector<int32_t>& scratch, std::vector<int32_t>& out) const {
  for (const std::string& piece : pre_tokenize(nfc_ ? nfc_normalize(text) : std::string(text))) {
    if (ignore_merges_) {
      const auto it = model_ids_.find(piece);
      if (it != model_ids_.end()) {
        out.push_back(it->second);
        continue;
      }
    }
    model_->encode_piece(piece, scratch, out);
  }
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text, const EncodeOptions& options) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + prefix_.size() + suffix_.size());
  if (options.add_special_tokens) out.insert(out.end(), prefix_.begin(), prefix_.end());
  std::vector<int32_t> scratch;  // one piece's tokens, reused
  if (splitter_ == nullptr) {
    encode_plain(text, scratch, out);
  } else {
    for (const TextSegment& segment : splitter_->split(text, options.parse_special_tokens)) {
      if (segment.token >= 0) out.push_back(segment.token);
      else encode_plain(segment.text, scratch, out);
    }
  }
  if (options.add_special_tokens) out.insert(out.end(), suffix_.begin(), suffix_.end());
  return out;
}

std::string HfTokenizer::decode(std::span<const int32_t> tokens) const {
  std::string text;
  for (const int32_t id : tokens) {
    LOOM_CHECK(id >= 0 && id < vocab_size() && defined_[static_cast<size_t>(id)], "tokenizer ", name_, ": token id ",
               id, " is not in the vocabulary");
    text += token_bytes_[static_cast<size_t>(id)];
  }
  return text;
}

HfTokenizer::Pipeline HfTokenizer::pipeline() const {
  Pipeline p{{}, "", nfc_, ignore_merges_, prefix_, suffix_};
  for (const Step& step : steps_) {
    if (step.split != nullptr)
      p.regexes.push_back({key_path(step.key, step.byte_level ? "use_regex" : "pattern"), step.split->pattern()});
    if (step.add_prefix_space) p.add_prefix_space = key_path(step.key, "add_prefix_space");
  }
  return p;
}

std::vector<std::string> HfTokenizer::merge_lines() const { return gpt2_merge_lines(*model_, token_bytes_); }

std::string HfTokenizer::token_text(int32_t id) const {
  LOOM_CHECK(id >= 0 && id < vocab_size() && defined_[static_cast<size_t>(id)], "tokenizer ", name_, ": token id ", id,
             " is not in the vocabulary");
  return token_texts_[static_cast<size_t>(id)];
}

}  // namespace loom
