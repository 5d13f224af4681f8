// loom prepare: text -> token shards (+ meta.json, stats.json) for `loom train`.
#include <cstdio>

#include "cli.h"
#include "commands.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom prepare [--input FILE] [--tokenizer gpt2|byte|bpe:N|DIR] [--out DIR] [--val-fraction F]\n"
    "                    [--config FILE] [--set key=value,...]\n"
    "\n"
    "Tokenizes a text file into token shards with an end-of-text token after the text, splits off\n"
    "the last F of the tokens for validation, and writes DIR/meta.json and DIR/stats.json (token\n"
    "counts and the unigram entropy of the training split). bpe:N first learns a byte-level BPE\n"
    "of N tokens from the text itself and saves it in DIR/tokenizer.\n"
    "Without --input: the default corpus, every fortune of Debian's `fortunes` package (real\n"
    "English text), one document each, in a fixed shuffled order. Defaults come from the config: data.tokenizer, data.dir,\n"
    "data.val_fraction, data.input.\n";
}  // namespace

int prepare_main(int argc, char** argv) {
  const Args args(argc, argv, "prepare", kHelp,
                  {{"input", "FILE", "the text to tokenize (default: data.input; empty: the default corpus)"},
                   {"tokenizer", "NAME", "gpt2 | byte | bpe:N | a tokenizer folder (default: data.tokenizer)"},
                   {"out", "DIR", "the dataset folder to write (default: data.dir)"},
                   {"val-fraction", "F", "share of the tokens held out for validation (default: data.val_fraction)"},
                   {"config", "FILE", "a TOML config applied after configs/default.toml"},
                   {"set", "KEY=VALUE,...", "config overrides, applied last (comma-separated; repeatable)"}});
  const LoomConfig config = load_config(args);
  const std::string input = args.get("input", config.data.input);
  const std::string out = args.get("out", config.data.dir);
  const std::vector<std::string> documents = input.empty() ? default_corpus_documents() : text_file_documents(input);
  const auto tokenizer = prepare_tokenizer(args.get("tokenizer", config.data.tokenizer), documents, out);
  prepare_dataset(documents, *tokenizer, out, args.get_double("val-fraction", config.data.val_fraction));
  return 0;
}

}  // namespace loom::cli
