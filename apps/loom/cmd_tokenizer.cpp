// loom tokenizer train: a byte-level BPE vocabulary for a user's corpus, in GPT-2's format.
#include <cstdio>
#include <cstring>

#include "cli.h"
#include "commands.h"
#include "loom/core/error.h"
#include "loom/data/bpe.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom tokenizer train --input FILE --vocab-size N --out DIR\n"
    "\n"
    "Learns a byte-level BPE (Sennrich et al. 2016, GPT-2's pre-tokenizer) with N tokens from FILE\n"
    "and writes DIR/encoder.json and DIR/vocab.bpe. Use it with `loom prepare --tokenizer DIR`.\n";

const std::vector<Option> kOptions = {{"input", "FILE", "the corpus: a text file (required)"},
                                      {"vocab-size", "N", "tokens in the vocabulary, > 257 (default 4096)"},
                                      {"out", "DIR", "the folder to write encoder.json and vocab.bpe to (required)"}};
}  // namespace

int tokenizer_main(int argc, char** argv) {
  if (argc < 1) return std::fputs(options_help(kHelp, kOptions).c_str(), stderr), 2;
  if (std::strcmp(argv[0], "--help") == 0 || std::strcmp(argv[0], "-h") == 0) throw HelpRequest{options_help(kHelp, kOptions)};
  LOOM_CHECK(std::strcmp(argv[0], "train") == 0, "unknown tokenizer command '", argv[0], "' (expected: train; see `loom tokenizer --help`)");
  const Args args(argc - 1, argv + 1, "tokenizer train", kHelp, kOptions);
  LOOM_CHECK(args.has("input") && args.has("out"), "loom tokenizer train needs --input FILE and --out DIR");
  const std::string text = text_file_documents(args.get("input"), uint64_t{1} << 30)[0];  // 1 GiB
  const BpeTrainResult result = train_bpe(text, args.get_int("vocab-size", 4096), args.get("out"));
  (void)result;
  const auto tokenizer = load_tokenizer(args.get("out"));
  const size_t n = tokenizer->encode(text).size();
  std::printf("tokenizer %s: %lld tokens; %zu bytes encode to %zu tokens (%.2f bytes/token)\n", args.get("out").c_str(),
              static_cast<long long>(tokenizer->vocab_size()), text.size(), n, static_cast<double>(text.size()) / static_cast<double>(n));
  return 0;
}

}  // namespace loom::cli
