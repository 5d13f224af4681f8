// The files a tokenizer is loaded from, so that checkpoints and exports carry their tokenizer
// (a run folder or a checkpoint moved elsewhere still encodes and decodes alone).
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace loom {

// Paths of the tokenizer files of a load_tokenizer argument: none for "byte"; GPT-2's
// encoder.json and vocab.bpe for "gpt2"; for a directory, the tokenizer files it holds of the
// formats Loom reads (encoder.json, vocab.bpe, vocab.json, merges.txt, tokenizer.json,
// tokenizer_config.json, tokenizer.model, special_tokens_map.json, added_tokens.json), sorted;
// for a tokenizer.json or tokenizer.model file (what a dataset records for a directory holding
// one), that file and the tokenizer_config.json beside it, if any.
std::vector<std::string> tokenizer_files(const std::string& kind_or_dir);

// The same files as a checkpoint attaches them: ("tokenizer/<file name>", path) each.
std::vector<std::pair<std::string, std::string>> tokenizer_attachments(const std::string& kind_or_dir);

}  // namespace loom
