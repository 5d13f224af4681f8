// Reading tokenizer.json (hf_tokenizer.h): one function per key of Hugging Face tokenizers'
// serialized Tokenizer (normalizer, pre_tokenizer, model, added_tokens, post_processor,
// decoder), and tokenizer_config.json. Every refusal names the file and the key.
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "loom/core/error.h"
#include "loom/data/bpe.h"
#include "loom/data/hf_tokenizer.h"
#include "loom/data/unicode.h"

namespace loom {
namespace {

using nlohmann::json;

// Ids above this are refused rather than allocated for (real vocabularies stay far below it).
constexpr int64_t kMaxTokenId = int64_t{1} << 21;

std::string type_of(const JsonFile& file, const json& obj, const std::string& where) {
  return file.string_at(obj, where, "type");
}

// A Split pattern {"String": s} matches s literally: every ASCII punctuation byte escaped.
std::string literal_pattern(const std::string& text) {
  std::string pattern;
  for (const char c : text) {
    if (static_cast<unsigned char>(c) < 0x80 && !std::isalnum(static_cast<unsigned char>(c))) pattern.push_back('\\');
    pattern.push_back(c);
  }
  return pattern;
}

}  // namespace

HfTokenizer::HfTokenizer(const std::string& path) : name_(path) {
  const JsonFile file{path};
  const json root = read_json_file(path);
  try {
    if (!root.is_object()) file.fail("", "expected a JSON object");
    characters_ = !pre_tokenizer_is_byte_level(file, root);
    load_model(file, root);
    load_added_tokens(file, root);
    check_outside_alphabet(file);
    load_normalizer(file, root);
    load_pre_tokenizer(file, root);
    // Added tokens: those marked normalized (with a normalizer) are found in the normalized text
    // by their normalized content, the others in the raw text (tokenizers' AddedVocabulary).
    std::vector<AddedToken> raw, normalized;
    for (size_t i = 0; i < added_tokens_.size(); ++i) {
      if (!added_normalized_[i] || normalizers_.empty()) {
        raw.push_back(added_tokens_[i]);
        continue;
      }
      AddedToken token = added_tokens_[i];
      token.content = normalize(token.content);
      normalized.push_back(std::move(token));
    }
    if (!raw.empty()) splitter_ = std::make_unique<AddedTokenSplitter>(std::move(raw));
    if (!normalized.empty()) normalized_splitter_ = std::make_unique<AddedTokenSplitter>(std::move(normalized));
    if (const json* processor = file.find(root, "", "post_processor")) load_post_processor(file, *processor, "post_processor");
    load_decoder(file, root);
    if (!characters_) {
      lossless_ = normalizers_.empty() && std::none_of(steps_.begin(), steps_.end(), [](const Step& s) { return s.add_prefix_space; });
    } else {
      lossless_ = sentencepiece_round_trip(file.at(root, "", "model"));
    }
    // A token matched in plain text (not special) that strips whitespace loses it.
    if (std::any_of(added_tokens_.begin(), added_tokens_.end(),
                    [](const AddedToken& t) { return !t.special && (t.lstrip || t.rstrip); }))
      lossless_ = false;
    load_config((std::filesystem::path(path).parent_path() / "tokenizer_config.json").string());
  } catch (const json::exception& e) {  // a value of an unexpected type that no check caught
    throw Error(str_cat(path, ": ", e.what()));
  }
}

void HfTokenizer::set_token(const JsonFile& file, const std::string& key, int64_t id, std::string bytes, std::string text) {
  if (id < 0 || id >= kMaxTokenId) file.fail(key, str_cat("id ", id, " is outside [0, ", kMaxTokenId, ")"));
  const auto i = static_cast<size_t>(id);
  if (i >= token_bytes_.size()) {
    token_bytes_.resize(i + 1);
    token_texts_.resize(i + 1);
    defined_.resize(i + 1, false);
  }
  token_bytes_[i] = std::move(bytes);
  token_texts_[i] = std::move(text);
  defined_[i] = true;
}

void HfTokenizer::load_model(const JsonFile& file, const json& root) {
  const json& model = file.at(root, "", "model");
  const std::string type = type_of(file, model, "model");
  if (type != "BPE") file.fail("model.type", "\"" + type + "\" is not supported (only a \"BPE\" model)");
  if (const json* dropout = file.find(model, "model", "dropout"); dropout && !(dropout->is_number() && *dropout == 0))
    file.fail("model.dropout", "BPE dropout is not supported (null expected)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = file.find(model, "model", key); v && !(v->is_string() && v->get<std::string>().empty()))
      file.fail(key_path("model", key), "is not supported (null expected)");
  ignore_merges_ = file.flag(model, "model", "ignore_merges", false);

  const json& vocab = file.at(model, "model", "vocab");
  if (!vocab.is_object() || vocab.empty()) file.fail("model.vocab", "expected a non-empty object {\"token\": id}");
  std::unordered_map<std::string, int32_t> ids;  // [token text] -> id
  for (const auto& [text, value] : vocab.items()) {
    if (!value.is_number_integer()) file.fail("model.vocab", "id of \"" + text + "\" is not an integer");
    // Byte-level: the token's bytes in GPT-2's alphabet; SentencePiece-style: its text as it is.
    std::optional<std::string> bytes = characters_ ? std::optional<std::string>(text) : gpt2_token_to_bytes(text);
    const int64_t id = value.get<int64_t>();
    if ((id >= 0 && id < static_cast<int64_t>(defined_.size()) && defined_[static_cast<size_t>(id)]) ||
        outside_alphabet_.count(id) != 0)
      file.fail("model.vocab", str_cat("id ", id, " is given to two tokens"));
    if (!bytes) {  // unreachable by BPE: an added token's entry, or refused after the added tokens
      outside_alphabet_.emplace(id, text);
      continue;
    }
    set_token(file, "model.vocab", id, *bytes, text);
    model_ids_.emplace(std::move(*bytes), static_cast<int32_t>(id));
    ids.emplace(text, static_cast<int32_t>(id));
  }
  if (characters_) {
    BpeCharacters characters;
    load_characters(file, model, characters);
    model_ = std::make_unique<BpeModel>(std::move(characters), load_merges(file, model, ids));
    return;
  }
  // Byte-level: every byte has its token, so byte_fallback and unk_token never apply.
  for (int b = 0; b < 256; ++b) {
    const auto it = model_ids_.find(std::string(1, static_cast<char>(b)));
    if (it == model_ids_.end()) file.fail("model.vocab", str_cat("the one-byte token of byte ", b, " is missing"));
    byte_token_[static_cast<size_t>(b)] = it->second;
  }
  model_ = std::make_unique<BpeModel>(byte_token_, load_merges(file, model, ids));
}

// SentencePiece-style symbols: the one-character tokens, the <0xNN> tokens of byte_fallback (all
// 256, as tokenizers writes "<0x{:02X}>"), the unknown token and fuse_unk.
void HfTokenizer::load_characters(const JsonFile& file, const json& model, BpeCharacters& characters) const {
  for (const auto& [text, id] : model_ids_)
    if (!text.empty() && scan_code_point(text, 0).bytes == text.size()) characters.ids.emplace(text, id);
  characters.byte_fallback = file.flag(model, "model", "byte_fallback", false);
  characters.fuse_unk = file.flag(model, "model", "fuse_unk", false);
  if (characters.byte_fallback) {
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      const auto it = model_ids_.find(name);
      if (it == model_ids_.end())
        file.fail("model.byte_fallback", str_cat("true, but the byte token \"", name, "\" is not in model.vocab"));
      characters.byte_tokens[static_cast<size_t>(b)] = it->second;
    }
  }
  if (const json* unk = file.find(model, "model", "unk_token")) {
    if (!unk->is_string()) file.fail("model.unk_token", "expected a string or null");
    const auto it = model_ids_.find(unk->get<std::string>());
    if (it == model_ids_.end()) file.fail("model.unk_token", "\"" + unk->get<std::string>() + "\" is not in model.vocab");
    characters.unk = it->second;
  } else if (!characters.byte_fallback) {
    // tokenizers drops such a character without a trace: refused rather than lost.
    file.fail("model.unk_token", "null with byte_fallback false: a character outside the vocabulary would be dropped");
  }
}

std::vector<BpeMerge> HfTokenizer::load_merges(const JsonFile& file, const json& model,
                                               const std::unordered_map<std::string, int32_t>& vocab) const {
  const json& merges = file.at(model, "model", "merges");
  if (!merges.is_array()) file.fail("model.merges", "expected an array");
  std::vector<BpeMerge> result;
  result.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string key = str_cat("model.merges[", i, "]");
    const json& merge = merges[i];
    std::string left, right;
    if (merge.is_string()) {  // "left right"
      const std::string line = merge.get<std::string>();
      const size_t space = line.find(' ');
      // A line of the older form for a token holding a space (Llama 2's vocabulary has " " and
      // "  "): the JavaScript port reads the fields before the second space, which here include
      // an empty one ("   " is "" + ""): no symbol is empty, so the merge never applies; skipped.
      const size_t second = space == std::string::npos ? space : line.find(' ', space + 1);
      if (characters_ && second != std::string::npos &&
          (space == 0 || second == space + 1))
        continue;
      if (space == std::string::npos || second != std::string::npos)
        file.fail(key, "expected \"left right\", got \"" + line + "\"");
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      left = merge[0].get<std::string>();
      right = merge[1].get<std::string>();
    } else {
      file.fail(key, "expected \"left right\" or [\"left\", \"right\"]");
    }
    const auto id_of = [&](const std::string& token) {
      const auto it = vocab.find(token);
      if (it == vocab.end()) file.fail(key, "token \"" + token + "\" is not in model.vocab");
      return it->second;
    };
    result.push_back({id_of(left), id_of(right), id_of(left + right)});
  }
  return result;
}

void HfTokenizer::load_added_tokens(const JsonFile& file, const json& root) {
  const json* tokens = file.find(root, "", "added_tokens");
  if (tokens == nullptr) return;
  if (!tokens->is_array()) file.fail("added_tokens", "expected an array");
  for (size_t i = 0; i < tokens->size(); ++i) {
    const std::string where = str_cat("added_tokens[", i, "]");
    const json& token = (*tokens)[i];
    const json& id = file.at(token, where, "id");
    if (!id.is_number_integer()) file.fail(where + ".id", "expected an integer");
    const std::string content = file.string_at(token, where, "content");
    // An added token may repeat a vocabulary entry (GPT-2's <|endoftext|>), not take another's id.
    if (const int64_t n = id.get<int64_t>(); n >= 0 && static_cast<size_t>(n) < defined_.size() &&
                                             defined_[static_cast<size_t>(n)] && token_bytes_[static_cast<size_t>(n)] != content) {
      file.fail(where + ".id", str_cat("id ", n, " is the vocabulary's \"", token_texts_[static_cast<size_t>(n)],
                                       "\", not \"", content, "\""));
    }
    if (const auto it = outside_alphabet_.find(id.get<int64_t>()); it != outside_alphabet_.end()) {
      if (it->second != content) {
        file.fail(where + ".id", str_cat("id ", it->first, " is the vocabulary's \"", it->second, "\", not \"", content, "\""));
      }
      outside_alphabet_.erase(it);  // the vocabulary's entry is this added token
    }
    set_token(file, where + ".id", id.get<int64_t>(), content, content);
    const bool special = file.flag(token, where, "special", false);
    added_tokens_.push_back({content, static_cast<int32_t>(id.get<int64_t>()), special, file.flag(token, where, "lstrip", false),
                             file.flag(token, where, "rstrip", false), file.flag(token, where, "single_word", false)});
    added_normalized_.push_back(file.flag(token, where, "normalized", !special));  // both references' default
  }
}

void HfTokenizer::check_outside_alphabet(const JsonFile& file) const {
  if (outside_alphabet_.empty()) return;
  const auto& [id, text] = *outside_alphabet_.begin();
  file.fail("model.vocab", str_cat("token \"", text, "\" (id ", id, ") has a character outside the byte-level alphabet "
                                   "and is not an added token"));
}

void HfTokenizer::load_normalizer(const JsonFile& file, const json& root) {
  const json* normalizer = file.find(root, "", "normalizer");
  if (normalizer == nullptr) return;
  if (type_of(file, *normalizer, "normalizer") != "Sequence") return load_normalizer_step(file, *normalizer, "normalizer");
  // Each step in turn; none (DeepSeek-V3's) is no normalizer.
  const json& steps = file.at(*normalizer, "normalizer", "normalizers");
  if (!steps.is_array()) file.fail("normalizer.normalizers", "expected an array");
  for (size_t i = 0; i < steps.size(); ++i) load_normalizer_step(file, steps[i], str_cat("normalizer.normalizers[", i, "]"));
}

// NFC; Prepend (tokenizers' normalizers/prepend.rs: to a non-empty text); Replace of a String
// pattern (normalizers/replace.rs: every occurrence, left to right).
void HfTokenizer::load_normalizer_step(const JsonFile& file, const json& step, const std::string& where) {
  const std::string type = type_of(file, step, where);
  if (type == "NFC") {
    nfc_ = true;
    normalizers_.push_back({Normalize::Kind::nfc, "", ""});
  } else if (type == "Prepend") {
    normalizers_.push_back({Normalize::Kind::prepend, "", file.string_at(step, where, "prepend")});
  } else if (type == "Replace") {
    const json& pattern = file.at(step, where, "pattern");
    if (!file.find(pattern, where + ".pattern", "String"))
      file.fail(where + ".pattern", "only {\"String\": ...} is supported (a Regex pattern is not)");
    std::string from = file.string_at(pattern, where + ".pattern", "String");
    if (from.empty()) file.fail(where + ".pattern.String", "an empty pattern is not supported");
    normalizers_.push_back({Normalize::Kind::replace, std::move(from), file.string_at(step, where, "content")});
  } else {
    file.fail(where + ".type", "\"" + type + "\" is not supported (NFC, Prepend, Replace or a Sequence of them)");
  }
}

void HfTokenizer::load_byte_level(const JsonFile& file, const json& step, const std::string& where) {
  Step byte_level;
  byte_level.kind = Step::Kind::byte_level;
  byte_level.key = where;
  byte_level.add_prefix_space = file.flag(step, where, "add_prefix_space", false);
  if (file.flag(step, where, "use_regex", true))
    byte_level.split = std::make_unique<Regex>(kGpt2PreTokenizerPattern, file.path + ": " + where + " (GPT-2's regex)");
  steps_.push_back(std::move(byte_level));
}

// Split (pre_tokenizers/split.rs): Isolated (every match a piece of its own) or MergedWithPrevious
// (each match ends the piece before it).
void HfTokenizer::load_split(const JsonFile& file, const json& step, const std::string& where) {
  Step split;
  split.key = where;
  const std::string behavior = file.string_at(step, where, "behavior");
  if (behavior == "MergedWithPrevious") split.merged_with_previous = true;
  else if (behavior != "Isolated") file.fail(where + ".behavior", "\"" + behavior + "\" is not supported (Isolated or MergedWithPrevious)");
  if (file.flag(step, where, "invert", false)) file.fail(where + ".invert", "true is not supported");
  const json& pattern = file.at(step, where, "pattern");
  std::string regex;
  if (file.find(pattern, where + ".pattern", "Regex")) regex = file.string_at(pattern, where + ".pattern", "Regex");
  else regex = literal_pattern(file.string_at(pattern, where + ".pattern", "String"));
  split.split = std::make_unique<Regex>(regex, file.path + ": key " + where + ".pattern");
  steps_.push_back(std::move(split));
}

// Metaspace (pre_tokenizers/metaspace.rs): every space becomes `replacement`; prepend_scheme
// "always" puts one before each piece that does not start with it, "first" only before the
// piece at the start of the text, "never" nowhere (the older add_prefix_space: true is
// "always", false "never"; prepend_scheme wins where both are given and agree); split (default
// true) then cuts before each replacement.
void HfTokenizer::load_metaspace(const JsonFile& file, const json& step, const std::string& where) {
  Step meta;
  meta.kind = Step::Kind::metaspace;
  meta.key = where;
  meta.replacement = file.find(step, where, "replacement") ? file.string_at(step, where, "replacement") : "\u2581";
  if (meta.replacement.empty() || scan_code_point(meta.replacement, 0).bytes != meta.replacement.size())
    file.fail(where + ".replacement", "expected one character");
  if (file.find(step, where, "prepend_scheme") != nullptr) {
    const std::string name = file.string_at(step, where, "prepend_scheme");
    if (name == "always") meta.prepend = Step::Prepend::always;
    else if (name == "first") meta.prepend = Step::Prepend::first;
    else if (name == "never") meta.prepend = Step::Prepend::never;
    else file.fail(where + ".prepend_scheme", "\"" + name + "\" is not one of always, first, never");
    if (file.find(step, where, "add_prefix_space") && !file.flag(step, where, "add_prefix_space", true) &&
        meta.prepend != Step::Prepend::never)
      file.fail(where + ".add_prefix_space", "false contradicts prepend_scheme \"" + name + "\"");
  } else {
    meta.prepend = file.flag(step, where, "add_prefix_space", true) ? Step::Prepend::always : Step::Prepend::never;
  }
  meta.metaspace_split = file.flag(step, where, "split", true);
  steps_.push_back(std::move(meta));
}

// Byte-level BPE has a ByteLevel pre-tokenizer step or decoder; a file with neither is
// SentencePiece-style (its vocabulary is text, not GPT-2's byte alphabet).
bool HfTokenizer::pre_tokenizer_is_byte_level(const JsonFile& file, const json& root) const {
  if (const json* decoder = file.find(root, "", "decoder");
      decoder != nullptr && decoder->is_object() && decoder->contains("type") && (*decoder)["type"] == "ByteLevel")
    return true;
  const json* pre = file.find(root, "", "pre_tokenizer");
  if (pre == nullptr || !pre->is_object() || !pre->contains("type")) return false;
  if ((*pre)["type"] == "ByteLevel") return true;
  const json* steps = pre->contains("pretokenizers") ? &(*pre)["pretokenizers"] : nullptr;
  if ((*pre)["type"] != "Sequence" || steps == nullptr || !steps->is_array()) return false;
  for (const json& step : *steps)
    if (step.is_object() && step.contains("type") && step["type"] == "ByteLevel") return true;
  return false;
}

void HfTokenizer::load_pre_tokenizer(const JsonFile& file, const json& root) {
  const json* pre = file.find(root, "", "pre_tokenizer");
  if (pre == nullptr) {
    if (!characters_) file.fail("pre_tokenizer", "missing");
    return;  // SentencePiece-style with a normalizer that writes the spaces (Llama 2, Phi-3)
  }
  const std::string type = type_of(file, *pre, "pre_tokenizer");
  if (type == "ByteLevel") return load_byte_level(file, *pre, "pre_tokenizer");
  if (characters_ && type == "Metaspace") return load_metaspace(file, *pre, "pre_tokenizer");
  if (characters_ && type == "Split") return load_split(file, *pre, "pre_tokenizer");
  if (type != "Sequence")
    file.fail("pre_tokenizer.type", "\"" + type + "\" is not supported (ByteLevel, Metaspace, Split or Sequence)");
  const json& steps = file.at(*pre, "pre_tokenizer", "pretokenizers");
  if (!steps.is_array() || steps.empty()) file.fail("pre_tokenizer.pretokenizers", "expected a non-empty array");
  for (size_t i = 0; i < steps.size(); ++i) {
    const std::string where = str_cat("pre_tokenizer.pretokenizers[", i, "]");
    const std::string step_type = type_of(file, steps[i], where);
    if (step_type == "ByteLevel") {
      if (i + 1 != steps.size()) file.fail(where, "ByteLevel must be the last step (it maps bytes for the model)");
      load_byte_level(file, steps[i], where);
      return;
    }
    if (characters_ && step_type == "Metaspace") {
      load_metaspace(file, steps[i], where);
      continue;
    }
    if (step_type != "Split")
      file.fail(where + ".type", "\"" + step_type + "\" is not supported (Split, ByteLevel or Metaspace)");
    load_split(file, steps[i], where);
  }
  if (!characters_) file.fail("pre_tokenizer.pretokenizers", "the last step must be ByteLevel (it maps bytes for the model)");
}

void HfTokenizer::load_post_processor(const JsonFile& file, const json& processor, const std::string& where) {
  const std::string type = type_of(file, processor, where);
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    const json& list = file.at(processor, where, "processors");
    if (!list.is_array()) file.fail(where + ".processors", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) load_post_processor(file, list[i], str_cat(where, ".processors[", i, "]"));
    return;
  }
  if (type != "TemplateProcessing")
    file.fail(where + ".type", "\"" + type + "\" is not supported (ByteLevel, TemplateProcessing or Sequence)");
  const json& single = file.at(processor, where, "single");
  const json& specials = file.at(processor, where, "special_tokens");
  if (!single.is_array()) file.fail(where + ".single", "expected an array");
  bool after_text = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const std::string item = str_cat(where, ".single[", i, "]");
    if (file.find(single[i], item, "Sequence")) {
      after_text = true;
      continue;
    }
    const std::string name = file.string_at(file.at(single[i], item, "SpecialToken"), item + ".SpecialToken", "id");
    const json& ids = file.at(file.at(specials, where + ".special_tokens", name.c_str()),
                              where + ".special_tokens." + name, "ids");
    if (!ids.is_array()) file.fail(where + ".special_tokens." + name + ".ids", "expected an array");
    for (const json& id : ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab_size())
        file.fail(where + ".special_tokens." + name + ".ids", "expected ids of the vocabulary");
      (after_text ? suffix_ : prefix_).push_back(id.get<int32_t>());
    }
  }
}

void HfTokenizer::load_decoder(const JsonFile& file, const json& root) {
  const json* decoder = file.find(root, "", "decoder");
  if (decoder == nullptr) return;
  const std::string type = type_of(file, *decoder, "decoder");
  if (!characters_) {
    if (type != "ByteLevel") file.fail("decoder.type", "\"" + type + "\" is not supported (ByteLevel)");
    return;
  }
  has_decoder_ = true;
  if (type != "Sequence") return load_decoder_step(file, *decoder, "decoder");
  const json& steps = file.at(*decoder, "decoder", "decoders");
  if (!steps.is_array()) file.fail("decoder.decoders", "expected an array");
  for (size_t i = 0; i < steps.size(); ++i) load_decoder_step(file, steps[i], str_cat("decoder.decoders[", i, "]"));
}

// The decoders of tokenizers' decoders/ (each maps the list of token strings): Replace (a String
// pattern in each token), ByteFallback (runs of <0xNN> tokens become their bytes), Fuse (one
// string), Strip (up to start / stop copies of a character off each token's ends), Metaspace
// (the replacement becomes a space; the first token's leading one goes unless prepend_scheme is
// "never").
void HfTokenizer::load_decoder_step(const JsonFile& file, const json& step, const std::string& where) {
  const std::string type = type_of(file, step, where);
  Decode d{Decode::Kind::fuse, "", "", 0, 0, true};
  if (type == "Replace") {
    d.kind = Decode::Kind::replace;
    const json& pattern = file.at(step, where, "pattern");
    if (!file.find(pattern, where + ".pattern", "String"))
      file.fail(where + ".pattern", "only {\"String\": ...} is supported (a Regex pattern is not)");
    d.pattern = file.string_at(pattern, where + ".pattern", "String");
    if (d.pattern.empty()) file.fail(where + ".pattern.String", "an empty pattern is not supported");
    d.content = file.string_at(step, where, "content");
  } else if (type == "ByteFallback") {
    d.kind = Decode::Kind::byte_fallback;
  } else if (type == "Fuse") {
    d.kind = Decode::Kind::fuse;
  } else if (type == "Strip") {
    d.kind = Decode::Kind::strip;
    d.content = file.string_at(step, where, "content");
    if (d.content.empty() || scan_code_point(d.content, 0).bytes != d.content.size())
      file.fail(where + ".content", "expected one character");
    for (const char* key : {"start", "stop"}) {
      const json* n = file.find(step, where, key);
      if (n != nullptr && (!n->is_number_integer() || n->get<int64_t>() < 0 || n->get<int64_t>() > 1000000))
        file.fail(key_path(where, key), "expected a count");
      (std::string(key) == "start" ? d.start : d.stop) = n ? n->get<int64_t>() : 0;
    }
  } else if (type == "Metaspace") {
    d.kind = Decode::Kind::metaspace;
    d.pattern = file.find(step, where, "replacement") ? file.string_at(step, where, "replacement") : "\u2581";
    if (d.pattern.empty()) file.fail(where + ".replacement", "expected one character");
    if (file.find(step, where, "prepend_scheme")) d.prepend = file.string_at(step, where, "prepend_scheme") != "never";
    else d.prepend = file.flag(step, where, "add_prefix_space", true);
  } else {
    file.fail(where + ".type", "\"" + type + "\" is not supported (Replace, ByteFallback, Fuse, Strip, Metaspace or a "
                               "Sequence of them)");
  }
  decoders_.push_back(std::move(d));
}

// Whether decode undoes encode (hf_tokenizer.h) for a SentencePiece-style file: the two forms
// whose decoder inverts the normalizer, with byte_fallback (no character is lost to unk):
//   Llama 2 / Phi-3: normalizer Prepend(R) + Replace(" " -> R), no pre-tokenizer, decoder
//     Replace(R -> " "), ByteFallback, Fuse, Strip(" ", 1, 0); no non-special added tokens (each
//     stretch between added tokens gets its own R);
//   Gemma: normalizer Replace(" " -> R), no pre-tokenizer or a Split on " " (a no-op once the
//     spaces are gone), decoder Replace(R -> " "), ByteFallback, Fuse;
// and R one token of the vocabulary, no added token spelled as a byte token, and no merge making
// a byte token (which would decode to its byte). An added token holding R or a space (Gemma 3's
// "▁▁") decodes, through Replace, to the spaces it stands for.
bool HfTokenizer::sentencepiece_round_trip(const json& model) const {
  if (!model.value("byte_fallback", false) || normalizers_.empty()) return false;
  const bool prepend = normalizers_.size() == 2;
  if (normalizers_.size() > 2 || (prepend && normalizers_[0].kind != Normalize::Kind::prepend)) return false;
  const Normalize& replace = normalizers_.back();
  const std::string& r = replace.content;
  if (replace.kind != Normalize::Kind::replace || replace.pattern != " " || r.empty() || (prepend && normalizers_[0].content != r))
    return false;
  if (scan_code_point(r, 0).bytes != r.size() || model_ids_.count(r) == 0) return false;
  for (const Step& step : steps_)
    if (prepend || step.kind != Step::Kind::split || step.split->pattern() != literal_pattern(" ")) return false;
  const size_t n = prepend ? 4 : 3;
  if (decoders_.size() != n || decoders_[0].kind != Decode::Kind::replace || decoders_[0].pattern != r ||
      decoders_[0].content != " " || decoders_[1].kind != Decode::Kind::byte_fallback || decoders_[2].kind != Decode::Kind::fuse)
    return false;
  if (prepend && (decoders_[3].kind != Decode::Kind::strip || decoders_[3].content != " " || decoders_[3].start != 1 ||
                  decoders_[3].stop != 0))
    return false;
  const auto byte_token = [](const std::string& t) { return t.size() == 6 && t.starts_with("<0x") && t[5] == '>'; };
  for (const AddedToken& t : added_tokens_)
    if ((prepend && !t.special) || byte_token(t.content)) return false;
  for (const BpeMerge& m : model_->merges())
    if (byte_token(token_texts_[static_cast<size_t>(m.merged)])) return false;
  return true;
}

std::optional<int32_t> HfTokenizer::added_token_id(const std::string& content) const {
  for (const AddedToken& token : added_tokens_)
    if (token.content == content) return token.id;
  for (size_t id = 0; id < token_texts_.size(); ++id)
    if (defined_[id] && token_texts_[id] == content) return static_cast<int32_t>(id);
  return std::nullopt;
}

void HfTokenizer::load_config(const std::string& config_path) {
  const TokenizerConfig config = read_tokenizer_config(config_path);
  const JsonFile file{config_path};
  const auto id_of = [&](const std::optional<std::string>& text, const char* key) -> std::optional<int32_t> {
    if (!text) return std::nullopt;
    const std::optional<int32_t> id = added_token_id(*text);
    if (!id) file.fail(key, "\"" + *text + "\" is not a token of tokenizer.json");
    return id;
  };
  specials_.bos = id_of(config.bos_token, "bos_token");
  specials_.eos = id_of(config.eos_token, "eos_token");
  if (!specials_.bos && !prefix_.empty()) specials_.bos = prefix_.front();
  if (!specials_.eos && !suffix_.empty()) specials_.eos = suffix_.back();
  const auto require = [&](const std::optional<int32_t>& id, const char* key, const char* needed_by) {
    if (!id) file.fail(key, std::string("missing, and ") + needed_by + " is true");
    return std::vector<int32_t>{*id};
  };
  if (config.add_bos_token) prefix_ = *config.add_bos_token ? require(specials_.bos, "bos_token", "add_bos_token") : std::vector<int32_t>{};
  if (config.add_eos_token) suffix_ = *config.add_eos_token ? require(specials_.eos, "eos_token", "add_eos_token") : std::vector<int32_t>{};
  if (specials_.eos) specials_.eot = *specials_.eos;
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>"})
    if (specials_.eot < 0) specials_.eot = added_token_id(name).value_or(-1);
  if (specials_.eot < 0)
    throw Error(str_cat(name_, ": no end-of-text token: give eos_token in tokenizer_config.json, or an added token "
                               "<|endoftext|>, <|end_of_text|> or </s>"));
}

}  // namespace loom
