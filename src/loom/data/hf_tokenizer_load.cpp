// Reading tokenizer.json (hf_tokenizer.h): one function per key of Hugging Face tokenizers'
// serialized Tokenizer (normalizer, pre_tokenizer, model, added_tokens, post_processor,
// decoder), and tokenizer_config.json. Every refusal names the file and the key.
#include <filesystem>

#include "loom/core/error.h"
#include "loom/data/bpe.h"
#include "loom/data/hf_tokenizer.h"

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
    load_model(file, root);
    load_added_tokens(file, root);
    check_outside_alphabet(file);
    load_normalizer(file, root);
    load_pre_tokenizer(file, root);
    if (const json* processor = file.find(root, "", "post_processor")) load_post_processor(file, *processor, "post_processor");
    load_decoder(file, root);
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
  if (type != "BPE") file.fail("model.type", "\"" + type + "\" is not supported (only a byte-level \"BPE\" model)");
  if (file.flag(model, "model", "byte_fallback", false))
    file.fail("model.byte_fallback", "true is not supported (a byte-level BPE has every byte; SentencePiece-style "
                                     "BPE: use the tokenizer.model file)");
  if (const json* dropout = file.find(model, "model", "dropout"); dropout && !(dropout->is_number() && *dropout == 0))
    file.fail("model.dropout", "BPE dropout is not supported (null expected)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = file.find(model, "model", key); v && !(v->is_string() && v->get<std::string>().empty()))
      file.fail(key_path("model", key), "not supported by a byte-level BPE (null expected)");
  ignore_merges_ = file.flag(model, "model", "ignore_merges", false);

  const json& vocab = file.at(model, "model", "vocab");
  if (!vocab.is_object() || vocab.empty()) file.fail("model.vocab", "expected a non-empty object {\"token\": id}");
  std::unordered_map<std::string, int32_t> ids;  // [token text] -> id
  for (const auto& [text, value] : vocab.items()) {
    if (!value.is_number_integer()) file.fail("model.vocab", "id of \"" + text + "\" is not an integer");
    std::optional<std::string> bytes = gpt2_token_to_bytes(text);
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
  for (int b = 0; b < 256; ++b) {
    const auto it = model_ids_.find(std::string(1, static_cast<char>(b)));
    if (it == model_ids_.end()) file.fail("model.vocab", str_cat("the one-byte token of byte ", b, " is missing"));
    byte_token_[static_cast<size_t>(b)] = it->second;
  }
  model_ = std::make_unique<BpeModel>(byte_token_, load_merges(file, model, ids));
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
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos)
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
    for (const char* key : {"lstrip", "rstrip", "single_word"})
      if (file.flag(token, where, key, false)) file.fail(key_path(where, key), "true is not supported");
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
    added_tokens_.push_back({content, static_cast<int32_t>(id.get<int64_t>()), file.flag(token, where, "special", false)});
  }
  splitter_ = std::make_unique<AddedTokenSplitter>(added_tokens_);
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
  const std::string type = type_of(file, *normalizer, "normalizer");
  if (type == "NFC") {
    nfc_ = true;
  } else if (type == "Sequence") {  // each step in turn: none (DeepSeek-V3's) is no normalizer
    const json& steps = file.at(*normalizer, "normalizer", "normalizers");
    if (!steps.is_array()) file.fail("normalizer.normalizers", "expected an array");
    for (size_t i = 0; i < steps.size(); ++i) {
      const std::string where = str_cat("normalizer.normalizers[", i, "]");
      const std::string step = type_of(file, steps[i], where);
      if (step != "NFC") file.fail(where + ".type", "\"" + step + "\" is not supported (NFC)");
      nfc_ = true;
    }
  } else {
    file.fail("normalizer.type", "\"" + type + "\" is not supported (null, NFC or a Sequence of them)");
  }
}

void HfTokenizer::load_byte_level(const JsonFile& file, const json& step, const std::string& where) {
  Step byte_level;
  byte_level.byte_level = true;
  byte_level.key = where;
  byte_level.add_prefix_space = file.flag(step, where, "add_prefix_space", false);
  if (file.flag(step, where, "use_regex", true))
    byte_level.split = std::make_unique<Regex>(kGpt2PreTokenizerPattern, file.path + ": " + where + " (GPT-2's regex)");
  steps_.push_back(std::move(byte_level));
}

void HfTokenizer::load_pre_tokenizer(const JsonFile& file, const json& root) {
  const json& pre = file.at(root, "", "pre_tokenizer");
  const std::string type = type_of(file, pre, "pre_tokenizer");
  if (type == "ByteLevel") return load_byte_level(file, pre, "pre_tokenizer");
  if (type != "Sequence") file.fail("pre_tokenizer.type", "\"" + type + "\" is not supported (ByteLevel or Sequence)");
  const json& steps = file.at(pre, "pre_tokenizer", "pretokenizers");
  if (!steps.is_array() || steps.empty()) file.fail("pre_tokenizer.pretokenizers", "expected a non-empty array");
  for (size_t i = 0; i < steps.size(); ++i) {
    const std::string where = str_cat("pre_tokenizer.pretokenizers[", i, "]");
    const std::string step_type = type_of(file, steps[i], where);
    if (step_type == "ByteLevel") {
      if (i + 1 != steps.size()) file.fail(where, "ByteLevel must be the last step (it maps bytes for the model)");
      load_byte_level(file, steps[i], where);
      return;
    }
    if (step_type != "Split") file.fail(where + ".type", "\"" + step_type + "\" is not supported (Split or ByteLevel)");
    const std::string behavior = file.string_at(steps[i], where, "behavior");
    if (behavior != "Isolated") file.fail(where + ".behavior", "\"" + behavior + "\" is not supported (Isolated)");
    if (file.flag(steps[i], where, "invert", false)) file.fail(where + ".invert", "true is not supported");
    const json& pattern = file.at(steps[i], where, "pattern");
    std::string regex;
    if (file.find(pattern, where + ".pattern", "Regex")) regex = file.string_at(pattern, where + ".pattern", "Regex");
    else regex = literal_pattern(file.string_at(pattern, where + ".pattern", "String"));
    steps_.push_back({std::make_unique<Regex>(regex, file.path + ": key " + where + ".pattern"), false, false, where});
  }
  file.fail("pre_tokenizer.pretokenizers", "the last step must be ByteLevel (it maps bytes for the model)");
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
  if (type != "ByteLevel") file.fail("decoder.type", "\"" + type + "\" is not supported (ByteLevel)");
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
