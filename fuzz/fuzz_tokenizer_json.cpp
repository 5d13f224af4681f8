// libFuzzer target: the bytes of a tokenizer.json (data/hf_tokenizer.h). An input holding a NUL
// byte (never part of JSON text) is split there: the bytes after the first NUL are written as
// the tokenizer_config.json beside it. Loading, then encoding a fixed short text with and
// without special tokens and decoding it back, must succeed or throw loom::Error; anything else
// is a finding, and so is a broken promise of the tokenizer: an id outside [0, vocab_size()),
// or (where HfTokenizer::lossless(), special tokens not added) a decode(encode(text)) that is
// not the text.
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_input.h"
#include "json_mutator.h"
#include "loom/core/error.h"
#include "loom/data/hf_tokenizer.h"

namespace {

// Plain words, a space run, newlines, digits, an accent, invalid UTF-8 and special-token look-alikes.
constexpr std::string_view kText = "Hello world  <|endoftext|><s> it's 12345\r\n caf\xc3\xa9 \xff\xfe <tool>";

void check_ids(const loom::HfTokenizer& tok, const std::vector<int32_t>& ids) {
  for (const int32_t id : ids) {
    loom_fuzz::require(id >= 0 && id < tok.vocab_size(), "encode gives ids in [0, vocab_size())");
    (void)tok.token_text(id);
  }
}

}  // namespace

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

// Half of the mutations change tokenizer.json as JSON (json_mutator.h), keeping the
// tokenizer_config.json after the NUL as it is.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  static const loom_fuzz::JsonWords words{
      {"type", "model", "vocab", "merges", "ignore_merges", "byte_fallback", "dropout", "continuing_subword_prefix",
       "end_of_word_suffix", "normalizer", "pre_tokenizer", "pretokenizers", "pattern", "Regex", "String", "behavior",
       "invert", "add_prefix_space", "use_regex", "added_tokens", "id", "content", "special", "normalized", "lstrip",
       "rstrip", "single_word", "post_processor", "processors", "single", "pair", "special_tokens", "SpecialToken",
       "Sequence", "type_id", "ids", "tokens", "decoder", "unk_token", "fuse_unk", "normalizers", "prepend",
       "replacement", "prepend_scheme", "split", "decoders", "start", "stop"},
      {"BPE", "ByteLevel", "Split", "Sequence", "NFC", "NFKC", "Isolated", "Removed", "TemplateProcessing", "A", "B",
       "Metaspace", "Prepend", "Replace", "ByteFallback", "Fuse", "Strip", "MergedWithPrevious", "first", "always",
       "never", "\u2581", "<0x0A>", "<0xE2>", "<unk>", "\u2581Hello",
       "<s>", "</s>", "<|endoftext|>", "<tool>", "\u0120", "\u0120w", "h e", "he ll", "", " ", "\\s+", "(", "\\p{L}+",
       "(?i:'s|'t)|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+", "caf\u00e9"}};
  if (seed % 2 == 0) {
    const std::string_view input(reinterpret_cast<const char*>(data), size);
    const size_t nul = input.find('\0');
    const std::string rest(nul == std::string_view::npos ? std::string_view() : input.substr(nul));
    if (const std::optional<std::string> changed =
            loom_fuzz::mutate_json(std::string(input.substr(0, nul)), seed / 2, words)) {
      if (changed->size() + rest.size() <= max_size) {
        std::memcpy(data, changed->data(), changed->size());
        std::memcpy(data + changed->size(), rest.data(), rest.size());
        return changed->size() + rest.size();
      }
    }
  }
  return LLVMFuzzerMutate(data, size, max_size);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const loom_fuzz::ScratchDir scratch;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string_view json_text = input.substr(0, nul);
  const std::string path = scratch.write("tokenizer.json", json_text);
  if (nul == std::string_view::npos) scratch.remove("tokenizer_config.json");
  else scratch.write("tokenizer_config.json", input.substr(nul + 1));
  try {
    const loom::HfTokenizer tok(path);
    const std::vector<int32_t> plain = tok.encode(kText);
    check_ids(tok, plain);
    const std::string decoded = tok.decode(plain);
    // The promise of hf_tokenizer.h: byte-level without a normalizer or a prefix space, and the
    // SentencePiece-style forms whose decoder undoes the normalizer (kText holds no "▁").
    if (tok.lossless()) loom_fuzz::require(decoded == kText, "decode(encode(text)) == text where lossless()");
    const std::vector<int32_t> special = tok.encode(kText, {.add_special_tokens = true, .parse_special_tokens = true});
    check_ids(tok, special);
    (void)tok.decode(special);
    for (const std::optional<int32_t> id : {std::optional<int32_t>(tok.eot_token()), tok.bos_token(), tok.eos_token()})
      loom_fuzz::require(!id || (*id >= 0 && *id < tok.vocab_size()), "BOS, EOS and end-of-text ids in [0, vocab_size())");
  } catch (const loom::Error&) {
  }
  return 0;
}
