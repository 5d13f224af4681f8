// libFuzzer target: a GPT-2 tokenizer (data/bpe.h): the input's bytes before its first NUL are
// encoder.json (vocab.json), the bytes after it vocab.bpe (merges.txt). Loading with BpeTokenizer,
// encoding a fixed short text and decoding it back must succeed or throw loom::Error; anything else
// is a finding, and so is a broken promise of byte-level BPE: an id outside [0, vocab_size()),
// decode(encode(text)) != text (every byte has its token, so no text is lossy), an end-of-text id
// whose token is not "<|endoftext|>", or a tokenizer that, written back as encoder.json (token_text
// of each id) and vocab.bpe (merge_lines), loads to one with other merges or another encoding.
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_input.h"
#include "json_mutator.h"
#include "loom/core/error.h"
#include "loom/data/bpe.h"

namespace {

// Words, spaces, newlines, digits, contractions, an accent, invalid UTF-8 and the end-of-text text.
constexpr std::string_view kText = "Hello world  it's 12345\r\n caf\xc3\xa9 \xff\xfe <|endoftext|> hehe";

void check_ids(const loom::BpeTokenizer& tok, const std::vector<int32_t>& ids) {
  for (const int32_t id : ids)
    loom_fuzz::require(id >= 0 && id < tok.vocab_size(), "encode gives ids in [0, vocab_size())");
}

// The tokenizer written back as its two files (vocab.bpe with the "#version" line the BPE
// trainer writes, so a first merge starting with '#' is not taken for a comment).
std::pair<std::string, std::string> write_back(const loom::BpeTokenizer& tok) {
  nlohmann::json encoder = nlohmann::json::object();
  for (int32_t id = 0; id < tok.vocab_size(); ++id) encoder[tok.token_text(id)] = id;
  std::string merges = "#version: 0.2\n";
  for (const std::string& line : tok.merge_lines()) merges += line + "\n";
  return {encoder.dump(), merges};
}

}  // namespace

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

// Half of the mutations are structural: encoder.json changed as JSON (json_mutator.h), or a merge
// of two tokens encoder.json has appended to vocab.bpe, mostly with its result added to encoder.json
// under the next id.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  static const loom_fuzz::JsonWords words{{"<|endoftext|>", "\u0120", "\u0120t", "he", "a", "!"},
                                          {"<|endoftext|>", "\u0120", "h", "e", "he", "\u0100", "\u0143", " "}};
  if (seed % 2 == 0) {
    std::mt19937_64 rng(seed / 2);
    const std::string_view input(reinterpret_cast<const char*>(data), size);
    const size_t nul = input.find('\0');
    std::string encoder(input.substr(0, nul));
    std::string merges(nul == std::string_view::npos ? std::string_view() : input.substr(nul + 1));
    bool changed = false;
    if (rng() % 2 == 0) {
      if (std::optional<std::string> json = loom_fuzz::mutate_json(encoder, rng(), words)) {
        encoder = std::move(*json);
        changed = true;
      }
    } else {
      nlohmann::json vocab = nlohmann::json::parse(encoder, nullptr, false);
      if (vocab.is_object() && !vocab.empty()) {
        std::vector<std::string> tokens;
        for (const auto& [token, id] : vocab.items()) tokens.push_back(token);
        const std::string& left = tokens[rng() % tokens.size()];
        const std::string& right = tokens[rng() % tokens.size()];
        if (!merges.empty() && merges.back() != '\n') merges += '\n';
        merges += left + " " + right + "\n";
        if (rng() % 4 != 0 && !vocab.contains(left + right)) vocab[left + right] = vocab.size();
        try {
          encoder = vocab.dump();
          changed = true;
        } catch (const nlohmann::json::exception&) {
        }
      }
    }
    if (changed) {
      if (const size_t n = loom_fuzz::emit(encoder + std::string(1, '\0') + merges, data, max_size)) return n;
    }
  }
  return LLVMFuzzerMutate(data, size, max_size);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const loom_fuzz::ScratchDir scratch;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string vocab = scratch.write("encoder.json", input.substr(0, nul));
  const std::string merges =
      scratch.write("vocab.bpe", nul == std::string_view::npos ? std::string_view() : input.substr(nul + 1));
  std::optional<loom::BpeTokenizer> tok;
  try {
    tok.emplace(vocab, merges, "fuzz");
  } catch (const loom::Error&) {
    return 0;
  }
  const std::vector<int32_t> ids = tok->encode(kText);
  check_ids(*tok, ids);
  loom_fuzz::require(tok->decode(ids) == kText, "decode(encode(text)) == text");
  loom_fuzz::require(tok->eot_token() >= 0 && tok->eot_token() < tok->vocab_size() &&
                         tok->token_text(tok->eot_token()) == "<|endoftext|>",
                     "the end-of-text id is in range and is \"<|endoftext|>\"");

  const auto [vocab_back, merges_back] = write_back(*tok);
  const std::string vocab_path = scratch.write("encoder.back.json", vocab_back);
  const std::string merges_path = scratch.write("vocab.back.bpe", merges_back);
  try {
    const loom::BpeTokenizer back(vocab_path, merges_path, "fuzz");
    loom_fuzz::require(back.vocab_size() == tok->vocab_size() && back.merge_lines() == tok->merge_lines(),
                       "written back, the tokenizer has the same vocabulary and merges");
    loom_fuzz::require(back.encode(kText) == ids, "written back, the tokenizer encodes the same");
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    loom_fuzz::require(false, "the tokenizer written back loads");
  }
  return 0;
}
