// The tokenizer inside a GGUF file (docs/gguf.md): every tokenizer load_tokenizer reads, as the
// tokenizer.ggml.* keys of ggml's docs/gguf.md that llama.cpp's llama-vocab.cpp reads:
//   model       "gpt2" (byte-level BPE: tokens in GPT-2's byte alphabet, merges "a b" by rank)
//               for Loom's BPE, the byte tokenizer and tokenizer.json; "llama" (SentencePiece:
//               pieces and scores) for tokenizer.model
//   pre         gpt2 only: the pre-tokenizer regex by the name llama.cpp gives it: "gpt-2",
//               "llama-bpe" (Llama 3), "qwen2"; any other regex is refused
//   tokens      by id, token_type int32 (GgufTokenType), scores float32 (llama only)
//   bos/eos/unknown_token_id u32, add_bos_token / add_eos_token bool, add_space_prefix (llama)
// Anything llama.cpp would tokenize differently from Loom is refused with one line naming the
// tokenizer file and its key.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loom/checkpoint/gguf.h"
#include "loom/data/tokenizer.h"

namespace loom {

// tokenizer.ggml.token_type (ggml's docs/gguf.md; llama.h's llama_token_type).
enum GgufTokenType : int32_t {
  kGgufTokenNormal = 1,
  kGgufTokenUnknown = 2,
  kGgufTokenControl = 3,
  kGgufTokenUserDefined = 4,
  kGgufTokenUnused = 5,
  kGgufTokenByte = 6,
};

struct GgufVocabulary {
  std::string model;                // tokenizer.ggml.model: "gpt2" or "llama"
  std::string pre;                  // tokenizer.ggml.pre (gpt2 only)
  std::vector<std::string> tokens;  // by id
  std::vector<int32_t> types;       // by id, GgufTokenType
  std::vector<float> scores;        // by id (llama only)
  std::vector<std::string> merges;  // "left right" by rank (gpt2 only)
  std::optional<int32_t> bos, eos, unknown;
  bool add_bos = false, add_eos = false;
  std::optional<bool> add_space_prefix;  // llama: SentencePiece's add_dummy_prefix
  std::vector<int32_t> placeholders;     // ids the tokenizer file leaves out: "[PAD<id>]", type unused
};

// The vocabulary of any tokenizer Loom loads; throws loom::Error "<file>: key <key>: ..." for
// what a GGUF file cannot say so that llama.cpp tokenizes as Loom does.
GgufVocabulary gguf_vocabulary(const Tokenizer& tokenizer);

// Puts the tokenizer.ggml.* keys.
void put_gguf_tokenizer(GgufWriter& writer, const GgufVocabulary& vocab);

}  // namespace loom
