// Token datasets from text: the default corpus, a user's text file, the tokenizer `loom prepare`
// uses (a byte-level BPE learned from the documents for bpe:N) and the shards it writes.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loom/data/tokenizer.h"

namespace loom {

// The default corpus: every fortune of Debian's `fortunes` package, one document each, in a
// fixed shuffled order (so the validation tail covers every topic).
std::vector<std::string> default_corpus_documents();
// A user's text file: one document, the whole file; more than max_bytes is an error naming the
// file (reading /dev/zero stops there).
std::vector<std::string> text_file_documents(const std::string& path, uint64_t max_bytes);

// The tokenizer for `loom prepare`: "gpt2", "byte", a directory, or "bpe:N" — a byte-level
// BPE of N tokens learned from the documents themselves and saved in <out_dir>/tokenizer.
std::unique_ptr<Tokenizer> prepare_tokenizer(const std::string& spec, const std::vector<std::string>& documents,
                                             const std::string& out_dir);

// Prepares a dataset: tokenizes documents (end-of-text between them), writes shards and
// stats.json (token counts, unigram entropy). Prints a summary line.
void prepare_dataset(const std::vector<std::string>& documents, const Tokenizer& tokenizer, const std::string& out_dir,
                     double val_fraction);

}  // namespace loom
