// Hugging Face tokenizer.json with a byte-level BPE model: GPT-2, Llama 3 and Qwen2 styles.
// The format is that of the Hugging Face tokenizers library (its "Tokenizer" JSON: the
// pipeline normalizer -> pre_tokenizer -> model -> post_processor, and decoder). Supported:
//   normalizer     null, or {"type": "NFC"} (Qwen2; ICU's NFC)
//   pre_tokenizer  ByteLevel (use_regex: GPT-2's regex, add_prefix_space), or a Sequence of
//                  Split {pattern: {"Regex": ...} or {"String": ...}, behavior "Isolated",
//                  invert false} steps and ByteLevel; regexes run as written by PCRE2 (regex.h)
//   model          BPE: vocab {token: id}, merges ["a b", ...] or [["a", "b"], ...],
//                  ignore_merges (Llama 3: a pre-token that is itself in the vocab is one
//                  token), no byte_fallback, no dropout, no subword prefix/suffix
//   added_tokens   [{id, content, special}]: found in the text before pre-tokenization,
//                  leftmost then longest first; lstrip/rstrip/single_word are refused
//   post_processor null, ByteLevel, TemplateProcessing (Llama 3's BOS) or a Sequence of them
//   decoder        ByteLevel (or null)
// tokenizer_config.json beside the file, when present: bos_token / eos_token name BOS and EOS,
// add_bos_token / add_eos_token (when given) replace what the post_processor adds.
// Anything else is refused with a loom::Error naming the file and the key.
//
// Lossless for every byte string when the normalizer is null and no ByteLevel step adds a prefix
// space: the pieces of invalid UTF-8 are byte tokens like any other (the reference libraries take
// only valid Unicode text). fuzz/fuzz_tokenizer_json.cpp checks it on every file it loads.
#pragma once
#include <map>
#include <memory>
#include <optional>
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
    std::vector<PreTokenizerRegex> regexes;  // in the order they split
    std::string add_prefix_space;            // the key of a ByteLevel step's add_prefix_space = true, else ""
    bool nfc = false;
    bool ignore_merges = false;
    std::vector<int32_t> prefix, suffix;  // what add_special_tokens puts around a text
  };
  Pipeline pipeline() const;
  const std::vector<AddedToken>& added_tokens() const { return added_tokens_; }
  // False for an id below vocab_size() that the file does not give.
  bool has_id(int32_t id) const { return id >= 0 && id < vocab_size() && defined_[static_cast<size_t>(id)]; }
  // The merges by rank, "left right" in GPT-2's byte alphabet.
  std::vector<std::string> merge_lines() const;

 private:
  // One pre-tokenizer step: a Split by `split`, or (split null) ByteLevel.
  struct Step {
    std::unique_ptr<Regex> split;
    bool byte_level = false;
    bool add_prefix_space = false;  // ByteLevel only
    std::string key;                // where the file gives the step ("pre_tokenizer.pretokenizers[1]")
  };

  // Loading (hf_tokenizer_load.cpp), each reading one key of the file.
  void load_normalizer(const JsonFile& file, const nlohmann::json& root);
  void load_pre_tokenizer(const JsonFile& file, const nlohmann::json& root);
  void load_byte_level(const JsonFile& file, const nlohmann::json& step, const std::string& where);
  void load_model(const JsonFile& file, const nlohmann::json& root);
  std::vector<BpeMerge> load_merges(const JsonFile& file, const nlohmann::json& model,
                                    const std::unordered_map<std::string, int32_t>& vocab) const;
  void load_added_tokens(const JsonFile& file, const nlohmann::json& root);
  void check_outside_alphabet(const JsonFile& file) const;  // after load_added_tokens
  void load_post_processor(const JsonFile& file, const nlohmann::json& processor, const std::string& where);
  void load_decoder(const JsonFile& file, const nlohmann::json& root);
  void load_config(const std::string& config_path);
  void set_token(const JsonFile& file, const std::string& key, int64_t id, std::string bytes, std::string text);
  std::optional<int32_t> added_token_id(const std::string& content) const;

  // Encoding (hf_tokenizer.cpp): a stretch of text without added tokens.
  void encode_plain(std::string_view text, std::vector<int32_t>& scratch, std::vector<int32_t>& out) const;
  std::vector<std::string> pre_tokenize(std::string text) const;

  std::string name_;
  bool nfc_ = false;
  std::vector<Step> steps_;
  bool ignore_merges_ = false;
  std::vector<std::string> token_bytes_;  // [id] -> raw bytes (an added token: its content); "" = no such id
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
  std::unique_ptr<AddedTokenSplitter> splitter_;
  std::vector<int32_t> prefix_;  // add_special_tokens: before the text (BOS)
  std::vector<int32_t> suffix_;  // and after it (EOS)
};

}  // namespace loom
