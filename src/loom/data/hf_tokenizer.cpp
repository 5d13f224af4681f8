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

// Every occurrence of `from` in `text` (non-empty, left to right, not overlapping) becomes `to`.
std::string replace_all(std::string_view text, const std::string& from, const std::string& to) {
  std::string out;
  size_t previous = 0;
  for (size_t at = text.find(from); at != std::string_view::npos; at = text.find(from, previous)) {
    out.append(text.substr(previous, at - previous)).append(to);
    previous = at + from.size();
  }
  return out.append(text.substr(previous));
}

}  // namespace

// The normalizer's steps in order (a normalizer sees a non-empty stretch of text: Prepend adds
// to every stretch between added tokens, as in tokenizers).
std::string HfTokenizer::normalize(std::string_view text) const {
  std::string out(text);
  for (const Normalize& n : normalizers_) {
    if (out.empty()) break;
    switch (n.kind) {
      case Normalize::Kind::nfc: out = nfc_normalize(out); break;
      case Normalize::Kind::prepend: out.insert(0, n.content); break;
      case Normalize::Kind::replace: out = replace_all(out, n.pattern, n.content); break;
    }
  }
  return out;
}

std::vector<std::string> HfTokenizer::pre_tokenize(std::string text, bool at_start) const {
  std::vector<std::string> pieces;
  if (!text.empty()) pieces.push_back(std::move(text));
  for (const Step& step : steps_) {
    std::vector<std::string> next;
    for (size_t p = 0; p < pieces.size(); ++p) {
      std::string& piece = pieces[p];
      if (step.kind == Step::Kind::metaspace) {
        // tokenizers' Metaspace: spaces become the replacement, the prefix as prepend_scheme
        // says ("first": the piece that begins the text), then a cut before each replacement.
        piece = replace_all(piece, " ", step.replacement);
        const bool first = at_start && p == 0;
        if (!piece.starts_with(step.replacement) &&
            (step.prepend == Step::Prepend::always || (step.prepend == Step::Prepend::first && first)))
          piece.insert(0, step.replacement);
        if (!step.metaspace_split) {
          next.push_back(std::move(piece));
          continue;
        }
        size_t begin = 0;
        for (size_t at = piece.find(step.replacement, 1); at != std::string::npos;
             at = piece.find(step.replacement, at + step.replacement.size())) {
          next.push_back(piece.substr(begin, at - begin));
          begin = at;
        }
        next.push_back(piece.substr(begin));
        continue;
      }
      if (step.add_prefix_space && piece[0] != ' ') piece.insert(0, 1, ' ');
      if (step.split == nullptr) {
        next.push_back(std::move(piece));
        continue;
      }
      if (!step.merged_with_previous) {
        for (const std::string_view part : split_isolated(*step.split, piece)) next.emplace_back(part);
        continue;
      }
      size_t begin = 0;  // MergedWithPrevious: each match closes the piece it ends
      for (const Regex::Match& m : step.split->find_all(piece)) {
        next.push_back(piece.substr(begin, m.end - begin));
        begin = m.end;
      }
      if (begin < piece.size()) next.push_back(piece.substr(begin));
    }
    pieces = std::move(next);
  }
  return pieces;
}

void HfTokenizer::encode_normalized(std::string text, bool at_start, std::vector<int32_t>& scratch,
                                    std::vector<int32_t>& out) const {
  for (const std::string& piece : pre_tokenize(std::move(text), at_start)) {
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

void HfTokenizer::encode_plain(std::string_view text, bool at_start, bool with_special, std::vector<int32_t>& scratch,
                               std::vector<int32_t>& out) const {
  std::string normalized = normalize(text);
  if (normalized_splitter_ == nullptr) return encode_normalized(std::move(normalized), at_start, scratch, out);
  // Added tokens marked normalized, found by their normalized content (tokenizers' AddedVocabulary).
  for (const TextSegment& segment : normalized_splitter_->split(normalized, with_special)) {
    if (segment.token >= 0) out.push_back(segment.token);
    else encode_normalized(std::string(segment.text), at_start && segment.text.data() == normalized.data(), scratch, out);
  }
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text, const EncodeOptions& options) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + prefix_.size() + suffix_.size());
  if (options.add_special_tokens) out.insert(out.end(), prefix_.begin(), prefix_.end());
  std::vector<int32_t> scratch;  // one piece's tokens, reused
  if (splitter_ == nullptr) {
    encode_plain(text, true, options.parse_special_tokens, scratch, out);
  } else {
    for (const TextSegment& segment : splitter_->split(text, options.parse_special_tokens)) {
      if (segment.token >= 0) out.push_back(segment.token);
      else encode_plain(segment.text, segment.text.data() == text.data(), options.parse_special_tokens, scratch, out);
    }
  }
  if (options.add_special_tokens) out.insert(out.end(), suffix_.begin(), suffix_.end());
  return out;
}

std::string HfTokenizer::decode(std::span<const int32_t> tokens) const {
  for (const int32_t id : tokens)
    LOOM_CHECK(id >= 0 && id < vocab_size() && defined_[static_cast<size_t>(id)], "tokenizer ", name_, ": token id ",
               id, " is not in the vocabulary");
  if (characters_) return decode_characters(tokens);
  std::string text;
  for (const int32_t id : tokens) text += token_bytes_[static_cast<size_t>(id)];
  return text;
}

// The decoder chain over the tokens' texts (tokenizers' Decoder::decode_chain, then the strings
// joined). ByteFallback gives the bytes of a <0xNN> run as they are, well-formed or not (the
// references put U+FFFD for an ill-formed run), so that every byte string round-trips.
std::string HfTokenizer::decode_characters(std::span<const int32_t> tokens) const {
  std::vector<std::string> parts;
  parts.reserve(tokens.size());
  for (const int32_t id : tokens) parts.push_back(token_bytes_[static_cast<size_t>(id)]);
  const auto byte_of = [](const std::string& t) -> int {
    if (t.size() != 6 || !t.starts_with("<0x") || t[5] != '>') return -1;
    int value = 0;
    for (const char c : t.substr(3, 2)) {
      const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (digit < 0) return -1;
      value = value * 16 + digit;
    }
    return value;
  };
  for (const Decode& d : decoders_) {
    switch (d.kind) {
      case Decode::Kind::replace:
        for (std::string& p : parts) p = replace_all(p, d.pattern, d.content);
        break;
      case Decode::Kind::byte_fallback: {
        std::vector<std::string> next;
        bool in_run = false;
        for (std::string& p : parts) {
          const int b = byte_of(p);
          if (b < 0) {
            next.push_back(std::move(p));
            in_run = false;
            continue;
          }
          if (!in_run) next.emplace_back();
          next.back().push_back(static_cast<char>(b));
          in_run = true;
        }
        parts = std::move(next);
        break;
      }
      case Decode::Kind::fuse: {
        std::string all;
        for (const std::string& p : parts) all += p;
        parts.assign(1, std::move(all));
        break;
      }
      case Decode::Kind::strip:
        for (std::string& p : parts) {
          size_t begin = 0, end = p.size();
          for (int64_t i = 0; i < d.start && p.compare(begin, d.content.size(), d.content) == 0 &&
                              begin + d.content.size() <= end; ++i)
            begin += d.content.size();
          for (int64_t i = 0; i < d.stop && end >= begin + d.content.size() &&
                              p.compare(end - d.content.size(), d.content.size(), d.content) == 0; ++i)
            end -= d.content.size();
          p = p.substr(begin, end - begin);
        }
        break;
      case Decode::Kind::metaspace:
        for (size_t i = 0; i < parts.size(); ++i) {
          parts[i] = replace_all(parts[i], d.pattern, " ");
          if (i == 0 && d.prepend && parts[i].starts_with(' ')) parts[i].erase(0, 1);
        }
        break;
    }
  }
  std::string text;
  for (const std::string& p : parts) text += p;
  return text;
}

HfTokenizer::Pipeline HfTokenizer::pipeline() const {
  Pipeline p{{}, "", nfc_, ignore_merges_, prefix_, suffix_};
  if (characters_) return p;  // no regex split: checkpoint/gguf_vocab.h refuses it for a byte-level GGUF
  for (const Step& step : steps_) {
    if (step.split != nullptr)
      p.regexes.push_back({key_path(step.key, step.kind == Step::Kind::byte_level ? "use_regex" : "pattern"), step.split->pattern()});
    if (step.add_prefix_space) p.add_prefix_space = key_path(step.key, "add_prefix_space");
  }
  return p;
}

std::vector<std::string> HfTokenizer::merge_lines() const {
  LOOM_CHECK(!characters_, name_, ": a SentencePiece-style tokenizer.json has no merges in GPT-2's byte alphabet");
  return gpt2_merge_lines(*model_, token_bytes_);
}

std::string HfTokenizer::token_text(int32_t id) const {
  LOOM_CHECK(id >= 0 && id < vocab_size() && defined_[static_cast<size_t>(id)], "tokenizer ", name_, ": token id ", id,
             " is not in the vocabulary");
  return token_texts_[static_cast<size_t>(id)];
}

}  // namespace loom
