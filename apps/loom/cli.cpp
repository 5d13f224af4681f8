#include "cli.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/philox.h"
#include "loom/data/bpe.h"
#include "loom/data/shard.h"

namespace loom::cli {

namespace fs = std::filesystem;

#ifndef LOOM_SOURCE_DIR
#define LOOM_SOURCE_DIR "."
#endif

Args::Args(int argc, char** argv, const std::vector<std::string>& value_options, const std::vector<std::string>& flags,
           const std::string& command)
    : command_(command) {
  auto accepted = [&] {
    std::string list;
    for (const auto& o : value_options) list += " --" + o + " VALUE";
    for (const auto& f : flags) list += " --" + f;
    return list;
  };
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    LOOM_CHECK(arg.rfind("--", 0) == 0, "loom ", command, ": unexpected argument '", arg, "'; accepted:", accepted());
    const std::string name = arg.substr(2);
    if (std::find(flags.begin(), flags.end(), name) != flags.end()) {
      values_[name].push_back("true");
    } else if (std::find(value_options.begin(), value_options.end(), name) != value_options.end()) {
      LOOM_CHECK(i + 1 < argc, "loom ", command, ": option --", name, " needs a value");
      values_[name].push_back(argv[++i]);
    } else {
      throw Error(str_cat("loom ", command, ": unknown option '", arg, "'; accepted:", accepted()));
    }
  }
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  const auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second.back();
}

const std::vector<std::string>& Args::all(const std::string& name) const {
  static const std::vector<std::string> kNone;
  const auto it = values_.find(name);
  return it == values_.end() ? kNone : it->second;
}

int64_t Args::get_int(const std::string& name, int64_t fallback) const {
  if (!has(name)) return fallback;
  const std::string v = get(name);
  try {
    size_t used = 0;
    const int64_t out = std::stoll(v, &used);
    if (used == v.size()) return out;
  } catch (const std::exception&) {
  }
  throw Error(str_cat("loom ", command_, ": --", name, " expects an integer, got '", v, "'"));
}

double Args::get_double(const std::string& name, double fallback) const {
  if (!has(name)) return fallback;
  const std::string v = get(name);
  try {
    size_t used = 0;
    const double out = std::stod(v, &used);
    if (used == v.size()) return out;
  } catch (const std::exception&) {
  }
  throw Error(str_cat("loom ", command_, ": --", name, " expects a number, got '", v, "'"));
}

LoomConfig load_config(const Args& args) {
  LoomConfig config;
  std::string base = "configs/default.toml";
  if (!fs::exists(base)) base = std::string(LOOM_SOURCE_DIR) + "/configs/default.toml";
  if (fs::exists(base)) apply_config_file(config, base);
  if (args.has("config")) {
    const std::string path = args.get("config");
    LOOM_CHECK(fs::exists(path), path, ": config file not found");
    apply_config_file(config, path);
  }
  for (const std::string& set : args.all("set")) apply_overrides(config, set);
  return config;
}

void vocab_from_data(LoomConfig& config) {
  if (config.model.vocab_size != 0) return;
  const std::string meta = config.data.dir + "/meta.json";
  std::ifstream in(meta);
  LOOM_CHECK(in.good(), "model.vocab_size = 0 follows the dataset, but ", meta, " cannot be read: set model.vocab_size");
  config.model.vocab_size = nlohmann::json::parse(in).at("vocab_size").get<int64_t>();
}

std::string run_dir(const LoomConfig& config) { return (fs::path(config.run.dir) / config.run.name).string(); }

std::string resolve_checkpoint(const std::string& path) {
  LOOM_CHECK(fs::exists(path), path, ": no such checkpoint, run or checkpoints folder");
  if (fs::exists(fs::path(path) / "manifest.json")) return path;
  const std::string dir = fs::exists(fs::path(path) / "checkpoints") ? (fs::path(path) / "checkpoints").string() : path;
  CheckpointManager manager(dir);
  for (const std::string& step_dir : manager.list()) {
    const std::string problem = checkpoint_problem(step_dir);
    if (problem.empty()) return step_dir;
    std::cerr << "loom: checkpoint " << step_dir << " is corrupt (" << problem << "); trying an older one\n";
  }
  throw Error(str_cat(path, ": no valid checkpoint found"));
}

LoomConfig checkpoint_config(const std::string& step_dir) {
  const std::string trainer_json = (fs::path(step_dir) / "trainer.json").string();
  std::ifstream in(trainer_json);
  LOOM_CHECK(in, trainer_json, ": cannot open");
  nlohmann::json json;
  try {
    in >> json;
  } catch (const nlohmann::json::exception& e) {
    throw Error(str_cat(trainer_json, ": not valid JSON (", e.what(), ")"));
  }
  LoomConfig config;
  if (json.contains("config_text") && json["config_text"].is_string()) {
    apply_config_text(config, json["config_text"].get<std::string>(), trainer_json + " (config_text)");
  }
  config.model = checkpoint_model_config(step_dir);
  return config;
}

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

std::vector<std::string> text_file_documents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK(in, path, ": cannot open input text");
  std::stringstream buffer;
  buffer << in.rdbuf();
  LOOM_CHECK(!buffer.str().empty(), path, ": input text is empty");
  return {buffer.str()};
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

std::string printable_utf8(const std::string& bytes) {
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    const size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool ok = len > 0 && i + len <= bytes.size();
    for (size_t k = 1; ok && k < len; ++k) ok = (static_cast<unsigned char>(bytes[i + k]) >> 6) == 0x2;
    if (ok && len > 1) {  // reject overlong forms, surrogates and code points above U+10FFFF
      uint32_t cp = c & (0x7F >> len);
      for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(bytes[i + k]) & 0x3F);
      ok = cp >= (len == 2 ? 0x80u : len == 3 ? 0x800u : 0x10000u) && cp <= 0x10FFFF && (cp < 0xD800 || cp > 0xDFFF);
    }
    if (ok) {
      out.append(bytes, i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

bool stdout_is_terminal() { return ::isatty(STDOUT_FILENO) == 1; }

std::string format_duration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  char buffer[32];
  if (s >= 3600) std::snprintf(buffer, sizeof buffer, "%lldh%02lldm", static_cast<long long>(s / 3600), static_cast<long long>(s / 60 % 60));
  else std::snprintf(buffer, sizeof buffer, "%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  return buffer;
}

}  // namespace loom::cli
