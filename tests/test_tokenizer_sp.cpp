// SentencePiece tokenizer.model (SentencePieceTokenizer) id for id against Debian's
// python3-sentencepiece: tools/sentencepiece_reference.py trains a small Llama-2-style BPE
// model (byte fallback) on the fortunes and encodes the same strings. Both need scripts/setup
// (python3-sentencepiece, fortunes): when missing the tests fail, naming the command.
#include <gtest/gtest.h>

#include <algorithm>

#include "loom/core/error.h"
#include "loom/data/sentencepiece_tokenizer.h"
#include "loom/data/tokenizer.h"
#include "tokenizer_test_util.h"

namespace loom {
namespace {

using namespace tokenizer_test;  // NOLINT

constexpr size_t kStrings = 320;

class SpReference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>("sp_model");
    trained_ = train_sentencepiece(dir_->str());
  }
  static void TearDownTestSuite() { dir_.reset(); }
  void SetUp() override {
    ASSERT_TRUE(trained_) << "tools/sentencepiece_reference.py train failed: run scripts/setup (python3-sentencepiece)";
  }
  static std::string model() { return (*dir_ / "tokenizer.model").string(); }
  static const TempDir& dir() { return *dir_; }

 private:
  static inline std::unique_ptr<TempDir> dir_;
  static inline bool trained_ = false;
};

std::vector<std::vector<int32_t>> reference_ids(const std::string& model, const std::vector<std::string>& strings) {
  TempDir io("sp_io");
  write_file(io / "strings.json", nlohmann::json(strings).dump());
  if (!run_command(python() + " \"" + sentencepiece_script() + "\" encode \"" + model + "\" \"" +
                   (io / "strings.json").string() + "\" > \"" + (io / "ids.json").string() + "\""))
    return {};
  return nlohmann::json::parse(read_file(io / "ids.json")).get<std::vector<std::vector<int32_t>>>();
}

const std::vector<std::string> kControls = {"<s>", "</s>", "<unk>"};

TEST_F(SpReference, MatchesPythonSentencePieceIdForId) {
  const SentencePieceTokenizer sp(model());
  const std::vector<std::string> strings = reference_strings(kControls, kStrings);
  ASSERT_GE(strings.size(), kStrings);
  std::vector<std::vector<int32_t>> ids;
  for (const std::string& s : strings) ids.push_back(sp.encode(s));
  expect_same_ids("python3-sentencepiece", strings, reference_ids(model(), strings), ids);
  EXPECT_EQ(sp.vocab_size(), 2000);
  EXPECT_EQ(sp.bos_token(), 1);
  EXPECT_EQ(sp.eos_token(), 2);
  EXPECT_EQ(sp.eot_token(), 2);
  EXPECT_EQ(sp.token_text(1), "<s>");
}

TEST_F(SpReference, RoundTripsTextWithoutControlPieces) {
  const SentencePieceTokenizer sp(model());
  for (const std::string& s : reference_strings({}, kStrings)) EXPECT_EQ(sp.decode(sp.encode(s)), s) << shown(s);
}

TEST_F(SpReference, InvalidUtf8EncodesWithoutError) {
  const SentencePieceTokenizer sp(model());
  std::string bytes = "ok \xc3 \xe2\x82 \xed\xa0\x80 \xf4\x90\x80\x80 \xc0\xaf \xff end";
  const std::vector<int32_t> ids = sp.encode(bytes);
  EXPECT_FALSE(ids.empty());
  for (const int32_t id : ids) EXPECT_LT(id, sp.vocab_size());
  EXPECT_NO_THROW(sp.decode(ids));
}

TEST_F(SpReference, TokenizerConfigAddsBosAndControlPiecesParseOnRequest) {
  TempDir llama("sp_llama");
  fs::copy_file(model(), llama / "tokenizer.model");
  write_file(llama / "tokenizer_config.json", R"({"add_bos_token": true, "add_eos_token": false, "bos_token": "<s>"})");
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(llama.str());
  const std::vector<int32_t> plain = tok->encode("Hello world");
  std::vector<int32_t> with_bos = {1};
  with_bos.insert(with_bos.end(), plain.begin(), plain.end());
  EXPECT_EQ(tok->encode("Hello world", {.add_special_tokens = true}), with_bos);
  // Without the config file nothing is added, as SentencePiece's own encode.
  EXPECT_EQ(load_tokenizer(model())->encode("Hello world", {.add_special_tokens = true}), plain);
  // "</s>" in the text: plain characters by default, the EOS id when parsing special tokens.
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 2), 0);
  const std::vector<int32_t> parsed = tok->encode("a</s>", {.parse_special_tokens = true});
  ASSERT_FALSE(parsed.empty());
  EXPECT_EQ(parsed.back(), 2);
  const std::vector<int32_t> unparsed = tok->encode("a</s>");
  EXPECT_EQ(std::count(unparsed.begin(), unparsed.end(), 2), 0);
}

TEST_F(SpReference, DirectoryWithBothFilesLoadsTheModel) {
  TempDir both("sp_both");
  fs::copy_file(model(), both / "tokenizer.model");
  write_file(both / "tokenizer.json", R"({"model": {"type": "BPE", "byte_fallback": true}})");  // Llama 2's kind
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(both.str());
  EXPECT_EQ(tok->name(), (both / "tokenizer.model").string());
  EXPECT_EQ(tok->encode("Hello world"), SentencePieceTokenizer(model()).encode("Hello world"));
}

TEST(SpLoad, NotAModelIsAnErrorNamingTheFile) {
  TempDir dir("sp_bad");
  write_file(dir / "tokenizer.model", "this is not a protobuf");
  try {
    load_tokenizer(dir.str());
    FAIL() << "expected loom::Error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("tokenizer.model"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace loom
