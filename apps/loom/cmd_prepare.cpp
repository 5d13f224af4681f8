// loom prepare: text -> token shards (+ meta.json, stats.json) for `loom train`.
#include <cstdio>

#include <filesystem>

#include "cli.h"
#include "commands.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/data/chat_template.h"
#include "loom/data/shard.h"
#include "loom/data/sft.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom prepare [--input FILE] [--tokenizer gpt2|byte|bpe:N|DIR] [--out DIR] [--val-fraction F]\n"
    "                    [--format text|chat-jsonl|jsonl] [--chat-template FILE] [--config FILE] [--set key=value,...]\n"
    "\n"
    "Tokenizes a text file into token shards with an end-of-text token after the text, splits off\n"
    "the last F of the tokens for validation, and writes DIR/meta.json and DIR/stats.json (token\n"
    "counts and the unigram entropy of the training split). bpe:N first learns a byte-level BPE\n"
    "of N tokens from the text itself and saves it in DIR/tokenizer.\n"
    "Without --input: the default corpus, every fortune of Debian's `fortunes` package (real\n"
    "English text), one document each, in a fixed shuffled order. Defaults come from the config: data.tokenizer, data.dir,\n"
    "data.val_fraction, data.input, data.format.\n"
    "Supervised fine-tuning data (docs/finetune.md): --format chat-jsonl (one {\"messages\": [...]}\n"
    "conversation per line, rendered with the tokenizer folder's chat template or --chat-template FILE;\n"
    "only the assistant's tokens count) or jsonl ({\"prompt\", \"completion\"} per line; the completion\n"
    "counts). The loss mask is written beside the token shards; loom train then learns the counted\n"
    "tokens only.\n";
}  // namespace

int prepare_main(int argc, char** argv) {
  const Args args(argc, argv, "prepare", kHelp,
                  {{"input", "FILE", "the text to tokenize (default: data.input; empty: the default corpus)"},
                   {"tokenizer", "NAME", "gpt2 | byte | bpe:N | a tokenizer folder (default: data.tokenizer)"},
                   {"out", "DIR", "the dataset folder to write (default: data.dir)"},
                   {"val-fraction", "F", "share of the tokens held out for validation (default: data.val_fraction)"},
                   {"max-input-mb", "N", "refuse an --input text larger than N MiB (default 1024)"},
                   {"format", "FORMAT", "text | chat-jsonl | jsonl (default: data.format)"},
                   {"chat-template", "FILE", "chat-jsonl: a Jinja chat template (default: the tokenizer folder's)"},
                   {"config", "FILE", "a TOML config applied after configs/default.toml"},
                   {"set", "KEY=VALUE,...", "config overrides, applied last (comma-separated; repeatable)"}});
  const LoomConfig config = load_config(args);
  const std::string input = args.get("input", config.data.input);
  const std::string out = args.get("out", config.data.dir);
  const double val_fraction = args.get_double("val-fraction", config.data.val_fraction);
  // Every training run evaluates on the held-out split: a dataset without one cannot be trained.
  LOOM_CHECK(val_fraction > 0.0 && val_fraction < 1.0, "--val-fraction must be in (0, 1), got ", val_fraction,
             " (the held-out split every training run evaluates on)");
  const int64_t max_mb = args.get_int("max-input-mb", 1024);
  LOOM_CHECK(max_mb >= 1, "--max-input-mb must be >= 1, got ", max_mb);
  const SftFormat format = args.has("format") ? parse_enum<SftFormat>(args.get("format"), "--format") : config.data.format;
  if (format != SftFormat::text) {
    LOOM_CHECK(!input.empty(), "--format ", enum_name(format), " needs --input FILE (or data.input)");
    const std::string spec = args.get("tokenizer", config.data.tokenizer);
    LOOM_CHECK(spec.rfind("bpe:", 0) != 0, "--format ", enum_name(format), ": data.tokenizer = ", spec, " learns a "
               "tokenizer from text; supervised data uses the model's tokenizer (a folder, gpt2 or byte)");
    const auto tokenizer = load_tokenizer(spec);
    std::string tmpl, tmpl_file;
    if (args.has("chat-template")) {
      tmpl_file = args.get("chat-template");
      tmpl = read_text_file(tmpl_file);
    } else if (const std::filesystem::path config_file = std::filesystem::path(spec) / "tokenizer_config.json";
               format == SftFormat::chat_jsonl && std::filesystem::is_regular_file(config_file)) {
      tmpl_file = config_file.string();
      tmpl = load_chat_template(tmpl_file);
    }
    const SftStream sft = read_sft_file(input, format, *tokenizer, tmpl, tmpl_file);
    write_dataset(out, sft.tokens, static_cast<uint64_t>(tokenizer->vocab_size()), tokenizer->name(), val_fraction,
                  uint64_t{1} << 22, sft.mask);
    std::printf("prepared %s: %lld %s examples -> %zu tokens, %lld of them counted (%.1f%%), tokenizer %s\n",
                out.c_str(), static_cast<long long>(sft.examples), std::string(enum_name(format)).c_str(),
                sft.tokens.size(), static_cast<long long>(sft.counted),
                100.0 * static_cast<double>(sft.counted) / static_cast<double>(sft.tokens.size()), tokenizer->name().c_str());
    return 0;
  }
  const std::vector<std::string> documents = input.empty() ? default_corpus_documents() : text_file_documents(input, static_cast<uint64_t>(max_mb) << 20);
  const auto tokenizer = prepare_tokenizer(args.get("tokenizer", config.data.tokenizer), documents, out);
  prepare_dataset(documents, *tokenizer, out, val_fraction);
  return 0;
}

}  // namespace loom::cli
