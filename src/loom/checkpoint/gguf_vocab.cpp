// Loom's tokenizers as GGUF's tokenizer.ggml.* keys (gguf_vocab.h). What llama.cpp does with
// them is its llama-vocab.cpp: a "gpt2" model splits text by the regex its `pre` names (and for
// "llama-bpe" takes a piece that is itself a token as that token: ignore_merges), then merges
// by rank; a "llama" model merges SentencePiece pieces by score, prepends a space when
// add_space_prefix, and writes characters outside the vocabulary as <0xNN> byte pieces.
#include "loom/checkpoint/gguf_vocab.h"

#include <array>
#include <unordered_map>

#include "loom/core/error.h"
#include "loom/data/bpe.h"
#include "loom/data/hf_tokenizer.h"
#include "loom/data/sentencepiece_tokenizer.h"

namespace loom {
namespace {

// The pre-tokenizer regexes llama.cpp knows by name (llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_GPT2,
// _LLAMA3, _QWEN2), as tokenizer.json writes them, and whether llama.cpp ignores merges for a
// piece that is a token (true for "llama-bpe" only).
struct KnownPreTokenizer {
  const char* name;
  const char* pattern;
  bool ignore_merges;
};
constexpr std::array<KnownPreTokenizer, 3> kKnownPreTokenizers{{
    {"gpt-2", kGpt2PreTokenizerPattern, false},
    {"llama-bpe",
     R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
     true},
    {"qwen2",
     R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
     false},
}};

[[noreturn]] void refuse(const std::string& file, const std::string& key, const std::string& what) {
  throw Error(str_cat(file, ": key ", key, ": ", what));
}

// Loom's GPT-2 BPE (encoder.json + vocab.bpe, vocab.json + merges.txt) and the byte tokenizer:
// GPT-2's regex, end of text the one control token and both BOS and EOS, nothing added.
GgufVocabulary gpt2_files_vocabulary(const Tokenizer& tokenizer) {
  GgufVocabulary v;
  v.model = "gpt2", v.pre = "gpt-2";
  const int32_t eot = tokenizer.eot_token();
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    const std::array<int32_t, 1> one{id};
    v.tokens.push_back(gpt2_bytes_to_token(tokenizer.decode(one)));  // end of text: "<|endoftext|>" as it is
    v.types.push_back(id == eot ? kGgufTokenControl : kGgufTokenNormal);
  }
  if (const auto* bpe = dynamic_cast<const BpeTokenizer*>(&tokenizer)) v.merges = bpe->merge_lines();
  v.bos = eot, v.eos = eot;
  return v;
}

// Which of kKnownPreTokenizers the file's pre-tokenizer is.
const KnownPreTokenizer& known_pre_tokenizer(const std::string& file, const HfTokenizer::Pipeline& p) {
  if (!p.add_prefix_space.empty())
    refuse(file, p.add_prefix_space, "true: llama.cpp's byte-level BPE adds no space before the text");
  if (p.regexes.empty())
    refuse(file, "pre_tokenizer", "no regex split (ByteLevel use_regex false and no Split): llama.cpp's byte-level BPE "
                                  "always splits by a regex");
  for (const KnownPreTokenizer& known : kKnownPreTokenizers) {
    if (p.regexes[0].pattern != known.pattern) continue;
    if (p.regexes.size() > 1)
      refuse(file, p.regexes[1].key, "a second regex split after " + p.regexes[0].key +
                                         ": llama.cpp's pre-tokenizers split by one regex");
    if (p.ignore_merges != known.ignore_merges)
      refuse(file, "model.ignore_merges",
             str_cat(p.ignore_merges ? "true" : "false", ", but llama.cpp's \"", known.name, "\" pre-tokenizer ",
                     known.ignore_merges ? "takes" : "does not take",
                     " a piece that is itself a token as that token; a GGUF file would tokenize differently"));
    return known;
  }
  refuse(file, p.regexes[0].key,
         "regex \"" + p.regexes[0].pattern +
             "\" is not a pre-tokenizer llama.cpp knows by name (GPT-2's, Llama 3's or Qwen2's); a GGUF file would "
             "tokenize differently");
}

// A Hugging Face tokenizer.json: tokens by id (a hole is "[PAD<id>]", unused, as llama.cpp's
// convert_hf_to_gguf.py fills them), added tokens control (special) or user-defined.
GgufVocabulary hf_vocabulary(const HfTokenizer& tokenizer) {
  const std::string& file = tokenizer.name();
  const HfTokenizer::Pipeline p = tokenizer.pipeline();
  GgufVocabulary v;
  v.model = "gpt2", v.pre = known_pre_tokenizer(file, p).name;
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    if (tokenizer.has_id(id)) {
      v.tokens.push_back(tokenizer.token_text(id));  // an added token: its content as it is
      v.types.push_back(kGgufTokenNormal);
    } else {
      v.tokens.push_back(str_cat("[PAD", id, "]"));
      v.types.push_back(kGgufTokenUnused);
      v.placeholders.push_back(id);
    }
  }
  for (const AddedToken& t : tokenizer.added_tokens())
    v.types[static_cast<size_t>(t.id)] = t.special ? kGgufTokenControl : kGgufTokenUserDefined;
  std::unordered_map<std::string, int32_t> seen;  // llama.cpp maps each text to one id
  for (int32_t id = 0; id < static_cast<int32_t>(v.tokens.size()); ++id) {
    const auto [it, fresh] = seen.emplace(v.tokens[static_cast<size_t>(id)], id);
    if (!fresh)
      refuse(file, "added_tokens", str_cat("ids ", it->second, " and ", id, " are both \"", it->first,
                                           "\"; a GGUF vocabulary holds each token text once"));
  }
  v.merges = tokenizer.merge_lines();
  v.bos = tokenizer.bos_token();
  v.eos = tokenizer.eos_token().value_or(tokenizer.eot_token());
  // The post-processor's tokens around a text: none, or BOS before and / or EOS after.
  const auto adds = [&](const std::vector<int32_t>& ids, const std::optional<int32_t>& token, const char* what) {
    if (ids.empty()) return false;
    if (ids.size() != 1 || ids[0] != token)
      refuse(file, "post_processor", str_cat("adds ", ids.size(), " token(s) ", what,
                                             "; GGUF can only say add_bos_token (BOS before) and add_eos_token (EOS after)"));
    return true;
  };
  v.add_bos = adds(p.prefix, v.bos, "before a text that are not BOS");
  v.add_eos = adds(p.suffix, v.eos, "after a text that are not EOS");
  return v;
}

// A SentencePiece tokenizer.model: pieces, scores and types as they are (the model's piece types
// are GGUF's token types), BOS added unless tokenizer_config.json says otherwise (llama.cpp's
// default for "llama").
GgufVocabulary sentencepiece_vocabulary(const SentencePieceTokenizer& tokenizer) {
  const std::string& file = tokenizer.name();
  const SentencePieceModel m = tokenizer.model();
  if (m.model_type != SentencePieceModel::kBpe)
    refuse(file, "trainer_spec.model_type",
           str_cat(m.model_type, " (", m.model_type == SentencePieceModel::kUnigram ? "UNIGRAM" : "not BPE",
                   "): llama.cpp's \"llama\" tokenizer merges pieces by score as SentencePiece's BPE does; this model "
                   "would tokenize differently"));
  if (!m.byte_fallback)
    refuse(file, "trainer_spec.byte_fallback",
           "false: llama.cpp's \"llama\" tokenizer writes a character outside the vocabulary as <0xNN> byte pieces");
  if (m.treat_whitespace_as_suffix)
    refuse(file, "trainer_spec.treat_whitespace_as_suffix", "true: llama.cpp puts the space before a piece");
  if (m.has_charsmap)
    refuse(file, "normalizer_spec.precompiled_charsmap",
           "the model normalizes text (normalizer_spec.name \"" + m.normalizer_name + "\"); llama.cpp does not");
  if (m.remove_extra_whitespaces)
    refuse(file, "normalizer_spec.remove_extra_whitespaces", "true: llama.cpp keeps every space");
  if (!m.escape_whitespaces) refuse(file, "normalizer_spec.escape_whitespaces", "false: llama.cpp writes a space as U+2581");
  if (static_cast<int64_t>(m.pieces.size()) != tokenizer.vocab_size())
    refuse(file, "pieces", str_cat(m.pieces.size(), " pieces, but the processor has ", tokenizer.vocab_size()));
  GgufVocabulary v;
  v.model = "llama";
  for (size_t id = 0; id < m.pieces.size(); ++id) {
    const SentencePieceModel::Piece& piece = m.pieces[id];
    if (piece.type < kGgufTokenNormal || piece.type > kGgufTokenByte)
      refuse(file, str_cat("pieces[", id, "].type"), str_cat(piece.type, " is not a SentencePiece piece type (1-6)"));
    v.tokens.push_back(piece.text);
    v.scores.push_back(piece.score);
    v.types.push_back(piece.type);
    if (piece.type == kGgufTokenUnknown && !v.unknown) v.unknown = static_cast<int32_t>(id);
  }
  v.bos = tokenizer.bos_token();
  v.eos = tokenizer.eos_token();
  v.add_bos = tokenizer.config_add_bos().value_or(true);
  v.add_eos = tokenizer.config_add_eos().value_or(false);
  v.add_space_prefix = m.add_dummy_prefix;
  return v;
}

}  // namespace

GgufVocabulary gguf_vocabulary(const Tokenizer& tokenizer) {
  if (const auto* hf = dynamic_cast<const HfTokenizer*>(&tokenizer)) return hf_vocabulary(*hf);
  if (const auto* sp = dynamic_cast<const SentencePieceTokenizer*>(&tokenizer)) return sentencepiece_vocabulary(*sp);
  return gpt2_files_vocabulary(tokenizer);
}

void put_gguf_tokenizer(GgufWriter& w, const GgufVocabulary& v) {
  w.put("tokenizer.ggml.model", GgufValue::string(v.model));
  if (!v.pre.empty()) w.put("tokenizer.ggml.pre", GgufValue::string(v.pre));
  w.put("tokenizer.ggml.tokens", GgufValue::strings(v.tokens));
  w.put("tokenizer.ggml.token_type", GgufValue::i32s(v.types));
  if (v.model == "llama") w.put("tokenizer.ggml.scores", GgufValue::f32s(v.scores));
  if (v.model == "gpt2") w.put("tokenizer.ggml.merges", GgufValue::strings(v.merges));
  const auto id = [&](const char* key, const std::optional<int32_t>& token) {
    if (token) w.put(key, GgufValue::u32(static_cast<uint32_t>(*token)));
  };
  id("tokenizer.ggml.bos_token_id", v.bos);
  id("tokenizer.ggml.eos_token_id", v.eos);
  id("tokenizer.ggml.unknown_token_id", v.unknown);
  w.put("tokenizer.ggml.add_bos_token", GgufValue::boolean(v.add_bos));
  w.put("tokenizer.ggml.add_eos_token", GgufValue::boolean(v.add_eos));
  if (v.add_space_prefix) w.put("tokenizer.ggml.add_space_prefix", GgufValue::boolean(*v.add_space_prefix));
}

}  // namespace loom
