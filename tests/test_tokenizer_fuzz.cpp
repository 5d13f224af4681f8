// tokenizer.json reading: each refusal is one line naming the file and the key, and a bounded
// deterministic fuzz (a fixed-seed mt19937 mutating a small valid file, as text and as JSON)
// never crashes: every mutant loads or gives a loom::Error. Also vocab.json + merges.txt.
#include <gtest/gtest.h>

#include <functional>

#include "loom/core/error.h"
#include "loom/data/bpe.h"
#include "loom/data/hf_tokenizer.h"
#include "loom/data/tokenizer.h"
#include "tokenizer_test_util.h"

namespace loom {
namespace {

using namespace tokenizer_test;  // NOLINT
using nlohmann::json;

constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// A small valid tokenizer.json touching every supported key: 256 byte tokens, 4 merges in both
// forms, ignore_merges, NFC, Split + ByteLevel, special and non-special added tokens, a BOS template.
json small_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[gpt2_bytes_to_token(std::string(1, static_cast<char>(b)))] = b;
  vocab["he"] = 256;
  vocab["ll"] = 257;
  vocab["hell"] = 258;
  vocab["Ġw"] = 259;
  const json added = json::array({{{"id", 260}, {"content", "<s>"}, {"special", true}},
                                  {{"id", 261}, {"content", "<tool>"}, {"special", false}, {"normalized", true}},
                                  {{"id", 262}, {"content", "</s>"}, {"special", true}}});
  const json template_bos = {{"type", "TemplateProcessing"},
                             {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                                     {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                             {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {260}}, {"tokens", {"<s>"}}}}}}};
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer", {{"type", "NFC"}}},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers", json::array({{{"type", "Split"}, {"pattern", {{"Regex", kLlama3Regex}}}, {"behavior", "Isolated"},
                                            {"invert", false}},
                                           {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}}},
          {"post_processor", {{"type", "Sequence"}, {"processors", json::array({{{"type", "ByteLevel"}}, template_bos})}}},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"ignore_merges", true}, {"byte_fallback", false}, {"vocab", vocab},
            {"merges", json::array({"h e", json::array({"l", "l"}), "he ll", json::array({"Ġ", "w"})})}}}};
}

// The loom::Error of loading `text` as dir/tokenizer.json ("" when it loads).
std::string load_error(const TempDir& dir, const std::string& text) {
  write_file(dir / "tokenizer.json", text);
  try {
    const std::unique_ptr<Tokenizer> tok = load_tokenizer(dir.str());
    const std::string sample = "hello <s> world <tool>\r\n  12345 caf\xc3\xa9 \xff";
    (void)tok->decode(tok->encode(sample, {.add_special_tokens = true, .parse_special_tokens = true}));
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(HfLoad, SmallFileEncodesThroughEveryStep) {
  TempDir dir("hf_small");
  ASSERT_EQ(load_error(dir, small_tokenizer().dump()), "");
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(dir.str());
  const EncodeOptions hf{.add_special_tokens = true, .parse_special_tokens = true};
  EXPECT_EQ(tok->encode("hello", hf), (std::vector<int32_t>{260, 258, 'o'}));
  EXPECT_EQ(tok->encode(" w<tool><s>"), (std::vector<int32_t>{259, 261, '<', 's', '>'}));
  EXPECT_EQ(tok->bos_token(), 260);
  EXPECT_EQ(tok->eot_token(), 262);
  EXPECT_EQ(tok->token_text(259), "Ġw");
}

// Forms real files use (issue: real Hub files as they are): DeepSeek-V3's special tokens are in
// model.vocab (outside the byte-level alphabet, so no byte sequence reaches them) and in
// added_tokens with the same id; its normalizer is an empty Sequence. Both load and encode as
// the added token and no normalizer; a Sequence of NFC composes as NFC does.
TEST(HfLoad, AddedTokensAlsoInTheVocabAndNormalizerSequencesLoad) {
  TempDir dir("hf_forms");
  const std::string bos = "<｜begin▁of▁sentence｜>";
  json file = small_tokenizer();
  file["model"]["vocab"][bos] = 263;
  file["added_tokens"].push_back({{"id", 263}, {"content", bos}, {"special", true}});
  file["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array()}};
  ASSERT_EQ(load_error(dir, file.dump()), "");
  const EncodeOptions special{.add_special_tokens = false, .parse_special_tokens = true};
  const std::string decomposed = "cafe\xcc\x81", composed = "caf\xc3\xa9";
  {
    const std::unique_ptr<Tokenizer> tok = load_tokenizer(dir.str());
    EXPECT_EQ(tok->encode(bos + "hello", special), (std::vector<int32_t>{263, 258, 'o'}));
    EXPECT_EQ(tok->decode(std::vector<int32_t>{263}), bos);
    EXPECT_NE(tok->encode(decomposed, special), tok->encode(composed, special));  // no normalizer
  }
  file["normalizer"]["normalizers"].push_back({{"type", "NFC"}});
  ASSERT_EQ(load_error(dir, file.dump()), "");
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(dir.str());
  EXPECT_EQ(tok->encode(decomposed, special), tok->encode(composed, special));
}

TEST(HfLoad, RefusalsNameTheFileAndTheKey) {
  TempDir dir("hf_refuse");
  const auto expect_refusal = [&](const std::function<void(json&)>& change, const std::string& key) {
    json file = small_tokenizer();
    change(file);
    const std::string message = load_error(dir, file.dump());
    EXPECT_NE(message.find((dir / "tokenizer.json").string()), std::string::npos) << message;
    EXPECT_NE(message.find(key), std::string::npos) << key << ": " << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  };
  expect_refusal([](json& f) { f["model"]["type"] = "WordPiece"; }, "model.type");
  expect_refusal([](json& f) { f["model"].erase("merges"); }, "model.merges");
  expect_refusal([](json& f) { f["model"]["merges"][0] = "h x"; }, "model.merges[0]");
  expect_refusal([](json& f) { f["model"]["merges"][1] = "l l l"; }, "model.merges[1]");
  expect_refusal([](json& f) {  // SentencePiece-style (no ByteLevel step): the <0xNN> tokens must be there
    f["pre_tokenizer"] = nullptr, f["decoder"] = nullptr, f["model"]["byte_fallback"] = true;
  }, "model.byte_fallback");
  expect_refusal([](json& f) { f["pre_tokenizer"] = nullptr, f["decoder"] = nullptr; }, "model.unk_token");
  expect_refusal([](json& f) { f["model"]["vocab"]["Ā"] = "x"; }, "model.vocab");
  expect_refusal([](json& f) { f["model"]["vocab"].erase("a"); }, "model.vocab");
  expect_refusal([](json& f) { f["pre_tokenizer"] = {{"type", "Whitespace"}}; }, "pre_tokenizer.type");
  expect_refusal([](json& f) { f["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
                 "pre_tokenizer.pretokenizers[0].behavior");
  expect_refusal([](json& f) { f["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; },
                 "pre_tokenizer.pretokenizers[0].pattern");
  expect_refusal([](json& f) { f["pre_tokenizer"]["pretokenizers"].erase(1); }, "pre_tokenizer.pretokenizers");
  expect_refusal([](json& f) { f["normalizer"] = {{"type", "NFKC"}}; }, "normalizer.type");
  expect_refusal([](json& f) { f["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array({{{"type", "NFKC"}}})}}; },
                 "normalizer.normalizers[0].type");
  // A vocabulary token no byte sequence reaches must be an added token of its id and content.
  expect_refusal([](json& f) { f["model"]["vocab"]["<｜x｜>"] = 263; }, "model.vocab");
  expect_refusal([](json& f) {
    f["model"]["vocab"]["<｜x｜>"] = 263;
    f["added_tokens"].push_back({{"id", 263}, {"content", "<y>"}, {"special", true}});
  }, "added_tokens[3].id");
  expect_refusal([](json& f) { f["added_tokens"][0]["lstrip"] = 1; }, "added_tokens[0].lstrip");
  expect_refusal([](json& f) { f["added_tokens"][1].erase("content"); }, "added_tokens[1].content");
  expect_refusal([](json& f) { f["post_processor"] = {{"type", "BertProcessing"}}; }, "post_processor.type");
  expect_refusal([](json& f) { f["decoder"] = {{"type", "WordPiece"}}; }, "decoder.type");
  expect_refusal([](json& f) { f.erase("model"); }, "model");
  expect_refusal([](json& f) { f["added_tokens"].erase(2); }, "no end-of-text token");
  const std::string message = load_error(dir, "{\"model\": ");
  EXPECT_NE(message.find("not valid JSON"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

// A random JSON value: mostly small, sometimes of another type than the key expects.
json random_value(std::mt19937& rng) {
  switch (rng() % 9) {
    case 0: return nullptr;
    case 1: return rng() % 2 == 0;
    case 2: return static_cast<int64_t>(rng() % 300) - 5;
    case 3: return int64_t{1} << (20 + rng() % 40);
    case 4: return json::array();
    case 5: return json::object();
    case 6: return "Split";
    case 7: return std::string(1 + rng() % 3, static_cast<char>('a' + rng() % 26));
    default: return json::array({"h e"});
  }
}

// Replaces, removes or retypes one random node of `value`.
void mutate_json(json& value, std::mt19937& rng) {
  json* node = &value;
  for (int depth = 0; depth < 6 && (node->is_object() || node->is_array()) && !node->empty() && rng() % 4 != 0; ++depth) {
    auto it = node->begin();
    std::advance(it, static_cast<std::ptrdiff_t>(rng() % std::min<size_t>(node->size(), 300)));
    node = &*it;
  }
  if (rng() % 3 == 0 && node->is_object() && !node->empty()) node->erase(node->begin());
  else *node = random_value(rng);
}

// Flips, deletes or duplicates a few bytes of the text.
void mutate_text(std::string& text, std::mt19937& rng) {
  for (int edits = 1 + static_cast<int>(rng() % 3); edits > 0 && !text.empty(); --edits) {
    const size_t pos = rng() % text.size();
    const size_t len = std::min<size_t>(1 + rng() % 16, text.size() - pos);
    switch (rng() % 3) {
      case 0: text[pos] = static_cast<char>(rng() % 256); break;
      case 1: text.erase(pos, len); break;
      default: text.insert(pos, text.substr(pos, len)); break;
    }
  }
}

TEST(HfFuzz, MutatedFilesLoadOrGiveOneLineErrors) {
  TempDir dir("hf_fuzz");
  const json base = small_tokenizer();
  std::mt19937 rng(21);
  // 1000 mutants (~1 s); LOOM_TOKENIZER_FUZZ_MUTANTS=N runs more, by hand.
  const char* env = std::getenv("LOOM_TOKENIZER_FUZZ_MUTANTS");
  const int mutants = env && *env ? std::atoi(env) : 1000;
  int loaded = 0, refused = 0;
  for (int i = 0; i < mutants; ++i) {
    std::string text;
    if (i % 2 == 0) {
      json file = base;
      for (int m = 0, n = 1 + static_cast<int>(rng() % 3); m < n; ++m) mutate_json(file, rng);
      text = file.dump();
    } else {
      text = base.dump();
      mutate_text(text, rng);
    }
    const std::string message = load_error(dir, text);
    (message.empty() ? loaded : refused) += 1;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "mutant " << i << ": " << message;
  }
  RecordProperty("loaded", loaded);
  RecordProperty("refused", refused);
  EXPECT_GT(loaded, mutants / 40);
  EXPECT_GT(refused, mutants / 4);
}

TEST(HfLoad, SlowTokenizerFilesLoadAsGpt2) {
  const fs::path gpt2 = source_dir() / kGpt2DefaultDir;
  ASSERT_TRUE(fs::exists(gpt2 / "encoder.json")) << gpt2 << ": run scripts/setup";
  TempDir dir("hf_slow");
  fs::copy_file(gpt2 / "encoder.json", dir / "vocab.json");
  fs::copy_file(gpt2 / "vocab.bpe", dir / "merges.txt");
  std::string text;
  for (const std::string& s : reference_strings({}, 300)) text += s;
  EXPECT_EQ(load_tokenizer(dir.str())->encode(text), BpeTokenizer(gpt2.string(), "gpt2").encode(text));
}

}  // namespace
}  // namespace loom
