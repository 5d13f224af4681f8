#include "loom/data/tokenizer_files.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include "loom/data/tokenizer.h"

namespace loom {

namespace fs = std::filesystem;

std::vector<std::string> tokenizer_files(const std::string& kind_or_dir) {
  static const std::set<std::string> kNames = {"encoder.json",          "vocab.bpe",        "vocab.json",
                                               "merges.txt",            "tokenizer.json",   "tokenizer_config.json",
                                               "tokenizer.model",       "special_tokens_map.json",
                                               "added_tokens.json"};
  const std::string dir = kind_or_dir == "gpt2" ? std::string(kGpt2DefaultDir) : kind_or_dir;
  std::vector<std::string> files;
  std::error_code ec;
  if (kind_or_dir != "byte" && fs::is_regular_file(dir, ec)) {  // a tokenizer.json or tokenizer.model file
    files.push_back(dir);
    const fs::path config = fs::path(dir).parent_path() / "tokenizer_config.json";
    if (fs::is_regular_file(config, ec)) files.push_back(config.string());
    return files;
  }
  if (kind_or_dir == "byte" || !fs::is_directory(dir, ec)) return files;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.is_regular_file(ec) && kNames.count(entry.path().filename().string())) files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<std::pair<std::string, std::string>> tokenizer_attachments(const std::string& kind_or_dir) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& file : tokenizer_files(kind_or_dir)) {
    out.emplace_back("tokenizer/" + fs::path(file).filename().string(), file);
  }
  return out;
}

}  // namespace loom
