#include "loom/data/prepare.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/philox.h"
#include "loom/data/bpe.h"
#include "loom/data/shard.h"
#include "loom/data/tokenizer_files.h"

namespace loom {

namespace fs = std::filesystem;

std::vector<std::string> default_corpus_documents() {
  const fs::path dir = "/usr/share/games/fortunes";
  LOOM_CHECK(fs::is_directory(dir), dir.string(), ": the default corpus is missing; run scripts/setup (Debian package 'fortunes')");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file() && !entry.path().has_extension()) files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> documents;
  for (const fs::path& file : files) {
    std::ifstream in(file);
    std::string line, current;
    while (std::getline(in, line)) {
      if (line == "%") {
        if (!current.empty()) documents.push_back(std::move(current));
        current.clear();
      } else {
        current += line + "\n";
      }
    }
    if (!current.empty()) documents.push_back(std::move(current));
  }
  LOOM_CHECK(!documents.empty(), dir.string(), ": no fortune files found");
  // The files are sorted by topic; shuffle the fortunes (a fixed Philox-keyed Fisher-Yates) so
  // the validation split, the tail of the stream, samples every topic like the training split.
  for (size_t i = documents.size() - 1; i > 0; --i) {
    const PhiloxCounter r = philox4x32_10({static_cast<uint32_t>(i), 0, 0, 0}, {0x464f5254u, 0x554e4553u});
    std::swap(documents[i], documents[static_cast<size_t>(r[0] % (i + 1))]);
  }
  return documents;
}

std::vector<std::string> text_file_documents(const std::string& path, uint64_t max_bytes) {
  std::string text = read_text_file(path, max_bytes, "--max-input-mb");
  LOOM_CHECK(!text.empty(), path, ": input text is empty");
  return {std::move(text)};
}

std::unique_ptr<Tokenizer> prepare_tokenizer(const std::string& spec, const std::vector<std::string>& documents,
                                             const std::string& out_dir) {
  if (spec.rfind("bpe:", 0) != 0) return load_tokenizer(spec);
  int64_t vocab = 0;
  try {
    vocab = std::stoll(spec.substr(4));
  } catch (const std::exception&) {
  }
  LOOM_CHECK(vocab > 257, "data.tokenizer '", spec, "': expected bpe:N with N > 257 tokens");
  std::string text;
  for (const std::string& doc : documents) text += doc;
  const std::string dir = (fs::path(out_dir) / "tokenizer").string();
  const BpeTrainResult result = train_bpe(text, vocab, dir);
  std::printf("trained a byte-level BPE of %lld tokens on the corpus: %s\n", static_cast<long long>(result.vocab_size),
              dir.c_str());
  return load_tokenizer(dir);
}

void prepare_dataset(const std::vector<std::string>& documents, const Tokenizer& tokenizer, const std::string& out_dir,
                     double val_fraction) {
  std::vector<int32_t> tokens;
  int64_t bytes = 0;
  for (const std::string& doc : documents) {
    const std::vector<int32_t> ids = tokenizer.encode(doc);
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    tokens.push_back(tokenizer.eot_token());
    bytes += static_cast<int64_t>(doc.size());
  }
  write_dataset(out_dir, tokens, static_cast<uint64_t>(tokenizer.vocab_size()), tokenizer.name(), val_fraction,
                uint64_t{1} << 22);
  // Unigram entropy of the training split: the loss of the best context-free predictor, the bar
  // a model must get well under to show it learned anything beyond token frequencies.
  const size_t n_train = tokens.size() - static_cast<size_t>(std::floor(static_cast<double>(tokens.size()) * val_fraction));
  std::vector<int64_t> counts(static_cast<size_t>(tokenizer.vocab_size()), 0);
  for (size_t i = 0; i < n_train; ++i) ++counts[static_cast<size_t>(tokens[i])];
  double entropy = 0.0;
  for (int64_t c : counts) {
    if (c > 0) entropy -= static_cast<double>(c) / n_train * std::log(static_cast<double>(c) / n_train);
  }
  nlohmann::json stats = {{"documents", documents.size()},
                          {"bytes", bytes},
                          {"tokens", tokens.size()},
                          {"train_tokens", n_train},
                          {"val_tokens", tokens.size() - n_train},
                          {"unigram_entropy_nats", entropy},
                          {"tokenizer", tokenizer.name()}};
  write_file_atomic((fs::path(out_dir) / "stats.json").string(), stats.dump(2) + "\n");
  std::printf("prepared %s: %zu documents, %lld bytes -> %zu tokens (%zu train, %zu val), tokenizer %s, unigram entropy %.3f nats/token\n",
              out_dir.c_str(), documents.size(), static_cast<long long>(bytes), tokens.size(), n_train, tokens.size() - n_train,
              tokenizer.name().c_str(), entropy);
}

}  // namespace loom
