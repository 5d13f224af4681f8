// Hugging Face tokenizer.json with a BPE model, in the two forms its files take:
//   byte-level BPE (GPT-2, Llama 3, Qwen2, DeepSeek-V3): a ByteLevel pre-tokenizer maps each byte
//     to a character of GPT-2's alphabet and the vocabulary is written in that alphabet;
//   SentencePiece-style BPE (Llama 2, Mistral, TinyLlama, Phi-3, Gemma): no ByteLevel step, the
//     vocabulary is text with "▁" for a space, a piece starts as its characters and a character
//     outside the vocabulary becomes its UTF-8 bytes' <0xNN> tokens (byte_fallback) or the
//     unknown token (fuse_unk: one for a run).
// The format is that of the Hugging Face tokenizers library (its "Tokenizer" JSON: the
// pipeline normalizer -> pre_tokenizer -> model -> post_processor, and decoder). Supported:
//   normalizer     null, NFC (ICU's), Prepend {prepend} (only a non-empty text), Replace
//                  {pattern: {"String": s}, content}, or a Sequence of them
//   pre_tokenizer  ByteLevel (use_regex: GPT-2's regex, add_prefix_space), or a Sequence of
//                  Split steps ending with ByteLevel; or, SentencePiece-style: null, Metaspace
//                  {replacement, prepend_scheme always/first/never (or the older add_prefix_space),
//                  split}, Split, or a Sequence of Split and Metaspace steps. Split: pattern
//                  {"Regex": ...} or {"String": ...}, behavior Isolated or MergedWithPrevious,
//                  invert false; regexes run as written by PCRE2 (regex.h)
//   model          BPE: vocab {token: id}, merges ["a b", ...] or [["a", "b"], ...],
//                  ignore_merges (a pre-token that is itself in the vocab is one token),
//                  byte_fallback, unk_token, fuse_unk; no dropout, no subword prefix/suffix
//   added_tokens   [{id, content, special, normalized, lstrip, rstrip, single_word}]: found in
//                  the text before the normalizer (normalized false, or no normalizer), or in each
//                  normalized stretch, matched by their normalized content (normalized true),
//                  leftmost then longest first; lstrip / rstrip: the match takes in the whitespace
//                  on its left / right (Phi-3's chat tokens), single_word: only where no word
//                  character touches it (AddedTokenSplitter, special_tokens.h)
//   post_processor null, ByteLevel, TemplateProcessing (BOS/EOS around $A) or a Sequence of them
//   decoder        ByteLevel (or null) for byte-level BPE; SentencePiece-style: Replace, ByteFallback,
//                  Fuse, Strip, Metaspace, or a Sequence of them
// tokenizer_config.json beside the file, when present: bos_token / eos_token name BOS and EOS,
// add_bos_token / add_eos_token (when given) replace what the post_processor adds.
// Anything else is refused with a loom::Error naming the file and the key.
//
// Lossless for every byte string when the normalizer is null, no ByteLevel step adds a prefix
// space and no added token that is not special strips whitespace (lstrip / rstrip): the pieces
// of invalid UTF-8 are byte tokens like any other (the reference libraries take only valid
// Unicode text). SentencePiece-style files whose decoder undoes the normalizer (Llama
// 2's Prepend + Replace with Replace + ByteFallback + Fuse + Strip; Gemma's Replace) round-trip
// every text without "▁" and without added tokens written in it (parse_special_tokens off); an
// ill-formed byte is a <0xNN> token and decodes to that byte (the references: U+FFFD).
// fuzz/fuzz_tokenizer_json.cpp checks this on every file it loads.
#pragma once
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/data/bpe_model.h"
#include "loom/data/regex.h"
#include "loom/data/special_tokens.h"
#include "loom/data/tokenizer.h"

namespace loom {

// GPT-2's pre-tokenizer regex, which a ByteLevel pre-tokenizer with use_regex applies (the
// pattern of tokenizers' byte_level.rs and of GPT-2's encoder.py).
inline constexpr const char* kGpt2PreTokenizerPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class HfTokenizer final : public TokenizerWithSpecials {
 public:
  // `path`: a tokenizer.json file.
  explicit HfTokenizer(const std::string& path);

  using Tokenizer::encode;
  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& options) const override;
  std::string decode(std::span<const int32_t> tokens) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(token_bytes_.size()); }
  std::string token_text(int32_t id) const override;
  std::string name() const override { return name_; }

  // What the file says that encode() does not show, for writers of other formats
  // (checkpoint/gguf_vocab.h).
  struct PreTokenizerRegex {
    std::string key;      // where the file gives it: "pre_tokenizer.pretokenizers[0].pattern"
    std::string pattern;  // as run (a ByteLevel step with use_regex: GPT-2's pattern)
  };
  struct Pipeline {
    std::vector<PreTokenizerRegex> regexes;  // in the order they split (byte-level BPE only)
    std::string add_prefix_space;            // the key of a ByteLevel step's add_prefix_space = true, else ""
    bool nfc = false;
    bool ignore_merges = false;
    std::vector<int32_t> prefix, suffix;  // what add_special_tokens puts around a text
  };
  Pipeline pipeline() const;
  // SentencePiece-style BPE (no ByteLevel step: characters, <0xNN> byte fallback), not byte-level.
  bool sentencepiece_style() const { return characters_; }
  // decode() gives back every text encode() was given (see the header comment), for fuzzing.
  bool lossless() const { return lossless_; }
  const std::vector<AddedToken>& added_tokens() const { return added_tokens_; }
  // False for an id below vocab_size() that the file does not give.
  bool has_id(int32_t id) const { return id >= 0 && id < vocab_size() && defined_[static_cast<size_t>(id)]; }
  // The merges by rank, "left right" in GPT-2's byte alphabet.
  std::vector<std::string> merge_lines() const;

 private:
  // One pre-tokenizer step.
  struct Step {
    enum class Kind { split, byte_level, metaspace } kind = Kind::split;
    std::unique_ptr<Regex> split;       // split; byte_level with use_regex: GPT-2's regex
    bool merged_with_previous = false;  // split: behavior MergedWithPrevious (else Isolated)
    bool add_prefix_space = false;      // byte_level
    std::string replacement;            // metaspace: what a space becomes ("▁")
    enum class Prepend { always, first, never } prepend = Prepend::always;  // metaspace
    bool metaspace_split = true;        // metaspace: split before each replacement
    std::string key;                    // where the file gives the step ("pre_tokenizer.pretokenizers[1]")
  };
  // One normalizer step.
  struct Normalize {
    enum class Kind { nfc, prepend, replace } kind;
    std::string pattern, content;  // prepend: content; replace: pattern -> content
  };
  // One decoder step (SentencePiece-style; a ByteLevel decoder is the raw bytes of the tokens).
  struct Decode {
    enum class Kind { replace, byte_fallback, fuse, strip, metaspace } kind;
    std::string pattern, content;  // replace: pattern -> content; strip: the character; metaspace: replacement
    int64_t start = 0, stop = 0;   // strip: at most this many at the start / end of each token
    bool prepend = true;           // metaspace: the first token's leading space is removed
  };

  // Loading (hf_tokenizer_load.cpp), each reading one key of the file.
  void load_normalizer(const JsonFile& file, const nlohmann::json& root);
  void load_normalizer_step(const JsonFile& file, const nlohmann::json& step, const std::string& where);
  bool pre_tokenizer_is_byte_level(const JsonFile& file, const nlohmann::json& root) const;
  void load_pre_tokenizer(const JsonFile& file, const nlohmann::json& root);
  void load_byte_level(const JsonFile& file, const nlohmann::json& step, const std::string& where);
  void load_split(const JsonFile& file, const nlohmann::json& step, const std::string& where);
  void load_metaspace(const JsonFile& file, const nlohmann::json& step, const std::string& where);
  void load_model(const JsonFile& file, const nlohmann::json& root);
  void load_characters(const JsonFile& file, const nlohmann::json& model, BpeCharacters& characters) const;
  std::vector<BpeMerge> load_merges(const JsonFile& file, const nlohmann::json& model,
                                    const std::unordered_map<std::string, int32_t>& vocab) const;
  void load_added_tokens(const JsonFile& file, const nlohmann::json& root);
  void check_outside_alphabet(const JsonFile& file) const;  // after load_added_tokens
  void load_post_processor(const JsonFile& file, const nlohmann::json& processor, const std::string& where);
  void load_decoder(const JsonFile& file, const nlohmann::json& root);
  void load_decoder_step(const JsonFile& file, const nlohmann::json& step, const std::string& where);
  void load_config(const std::string& config_path);
  void set_token(const JsonFile& file, const std::string& key, int64_t id, std::string bytes, std::string text);
  std::optional<int32_t> added_token_id(const std::string& content) const;

  // Encoding (hf_tokenizer.cpp): a stretch of text without added tokens; `at_start`: it begins
  // the text (a Metaspace prepend_scheme "first" adds its space only there).
  void encode_plain(std::string_view text, bool at_start, bool with_special, std::vector<int32_t>& scratch,
                    std::vector<int32_t>& out) const;
  void encode_normalized(std::string text, bool at_start, std::vector<int32_t>& scratch, std::vector<int32_t>& out) const;
  std::string normalize(std::string_view text) const;
  std::vector<std::string> pre_tokenize(std::string text, bool at_start) const;
  std::string decode_characters(std::span<const int32_t> tokens) const;

  std::string name_;
  bool characters_ = false;  // SentencePiece-style BPE (no ByteLevel step)
  bool nfc_ = false;         // a normalizer step is NFC
  std::vector<Normalize> normalizers_;
  std::vector<Step> steps_;
  std::vector<Decode> decoders_;
  bool has_decoder_ = false;
  bool lossless_ = false;   // see lossless()
  bool sentencepiece_round_trip(const nlohmann::json& model) const;  // lossless_ of a SentencePiece-style file  // the file gives a decoder (SentencePiece-style: else tokens are joined as they are)
  bool ignore_merges_ = false;
  std::vector<std::string> token_bytes_;  // [id] -> raw bytes (SentencePiece-style and added tokens: the text); "" = no such id
  std::vector<std::string> token_texts_;  // [id] -> as the vocabulary writes it
  std::vector<bool> defined_;             // [id] -> the file gives this id
  // model.vocab entries with a character outside the byte-level alphabet ([id] -> text): no byte
  // sequence reaches them, so each must be an added token of the same id and content
  // (DeepSeek-V3's special tokens are in both), checked once the added tokens are read.
  std::map<int64_t, std::string> outside_alphabet_;
  std::unordered_map<std::string, int32_t> model_ids_;  // [raw bytes] -> id of model.vocab (ignore_merges)
  std::array<int32_t, 256> byte_token_{};
  std::unique_ptr<BpeModel> model_;
  std::vector<AddedToken> added_tokens_;
  std::vector<bool> added_normalized_;  // [i] -> added_tokens_[i] is matched in normalized text
  std::unique_ptr<AddedTokenSplitter> splitter_;             // added tokens found in the raw text
  std::unique_ptr<AddedTokenSplitter> normalized_splitter_;  // normalized: true ones, in normalized text
  std::vector<int32_t> prefix_;  // add_special_tokens: before the text (BOS)
  std::vector<int32_t> suffix_;  // and after it (EOS)
};

}  // namespace loom
