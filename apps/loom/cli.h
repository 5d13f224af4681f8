// Shared pieces of the `loom` subcommands: argument parsing, configuration loading, the run
// folder, checkpoint lookup and one-line status output.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/data/tokenizer.h"
#include "loom/model/transformer.h"
#include "loom/train/config.h"

namespace loom::cli {

// --key value pairs and bare --flags. Every option must be declared by the subcommand; an
// unknown one is an error that lists the accepted ones.
class Args {
 public:
  Args(int argc, char** argv, const std::vector<std::string>& value_options, const std::vector<std::string>& flags,
       const std::string& command);
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  std::string get(const std::string& name, const std::string& fallback = "") const;
  const std::vector<std::string>& all(const std::string& name) const;  // repeatable options (--set)
  int64_t get_int(const std::string& name, int64_t fallback) const;
  double get_double(const std::string& name, double fallback) const;

 private:
  std::string command_;
  std::map<std::string, std::vector<std::string>> values_;
};

// configs/default.toml, then --config FILE, then every --set, then validation.
LoomConfig load_config(const Args& args);
// model.vocab_size = 0 follows the dataset: its data.dir/meta.json's vocab_size (an error naming
// the file and the key when it cannot be read).
void vocab_from_data(LoomConfig& config);

// runs/<name>
std::string run_dir(const LoomConfig& config);

// A step folder, a run folder (its checkpoints/ is searched) or a checkpoints folder -> the
// newest valid step folder, reporting skipped corrupt ones on stderr.
std::string resolve_checkpoint(const std::string& path);

// The config a checkpoint was trained with (its resolved TOML), with its model config.
LoomConfig checkpoint_config(const std::string& step_dir);

// The default corpus: every fortune of Debian's `fortunes` package, one document each, in a
// fixed shuffled order (so the validation tail covers every topic).
std::vector<std::string> default_corpus_documents();
// A user's text file: one document, the whole file.
std::vector<std::string> text_file_documents(const std::string& path);

// The tokenizer for `loom prepare`: "gpt2", "byte", a directory, or "bpe:N" — a byte-level
// BPE of N tokens learned from the documents themselves and saved in <out_dir>/tokenizer.
std::unique_ptr<Tokenizer> prepare_tokenizer(const std::string& spec, const std::vector<std::string>& documents,
                                             const std::string& out_dir);

// Prepares a dataset: tokenizes documents (end-of-text between them), writes shards and
// stats.json (token counts, unigram entropy). Prints a summary line.
void prepare_dataset(const std::vector<std::string>& documents, const Tokenizer& tokenizer, const std::string& out_dir,
                     double val_fraction);

// `bytes` with every invalid UTF-8 sequence replaced by U+FFFD, for display: a model may
// sample byte tokens that do not form characters.
std::string printable_utf8(const std::string& bytes);

bool stdout_is_terminal();
std::string format_duration(double seconds);  // "4m05s"

}  // namespace loom::cli
