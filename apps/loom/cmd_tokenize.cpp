// loom tokenize: the token ids or pieces of the text on standard input, with any tokenizer
// load_tokenizer reads (docs/tokenizers.md).
#include <cstdio>
#include <iostream>
#include <iterator>

#include "cli.h"
#include "commands.h"
#include "loom/core/error.h"
#include "loom/data/tokenizer.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom tokenize --tokenizer PATH | --checkpoint PATH [--ids] [--raw] < text\n"
    "\n"
    "Encodes standard input (bytes, any encoding) and prints each token as its vocabulary writes\n"
    "it, one per line, or with --ids the token ids on one line, separated by spaces. By default the\n"
    "tokenizer's files decide, as Hugging Face's encode does: special tokens written in the text\n"
    "(\"<|eot_id|>\") are their ids and BOS/EOS are added where tokenizer_config.json or\n"
    "tokenizer.json's post_processor say so. --checkpoint takes a Loom checkpoint or run folder or a\n"
    "Hugging Face model folder and uses the model's tokenizer.\n";

const std::vector<Option> kOptions = {
    {"tokenizer", "PATH", "byte, gpt2, a tokenizer.json or tokenizer.model file, or a directory holding one (or "
                          "vocab.json + merges.txt, encoder.json + vocab.bpe) (required)"},
    {"checkpoint", "PATH", "use the tokenizer of a Loom checkpoint or run folder, or of a Hugging Face model folder"},
    {"ids", "", "print the token ids on one line instead of one piece per line"},
    {"raw", "", "add no BOS/EOS and read special tokens in the text as plain text"}};

// The tokenizer the options name: --tokenizer's, or the model's of --checkpoint.
std::unique_ptr<Tokenizer> tokenizer_from(const Args& args) {
  LOOM_CHECK(args.has("tokenizer") != args.has("checkpoint"),
             "loom tokenize needs --tokenizer PATH or --checkpoint PATH, one of them (see `loom tokenize --help`)");
  if (args.has("checkpoint")) return load_tokenizer(model_source(args.get("checkpoint")).config.data.tokenizer);
  return load_tokenizer(args.get("tokenizer"));
}
}  // namespace

int tokenize_main(int argc, char** argv) {
  const Args args(argc, argv, "tokenize", kHelp, kOptions);
  const std::unique_ptr<Tokenizer> tokenizer = tokenizer_from(args);
  std::ios::sync_with_stdio(false);
  const std::string text{std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>()};
  LOOM_CHECK(!std::cin.bad(), "cannot read standard input");
  const bool raw = args.has("raw");
  const std::vector<int32_t> ids = tokenizer->encode(text, {.add_special_tokens = !raw, .parse_special_tokens = !raw});
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!args.has("ids")) {
      out.append(tokenizer->token_text(ids[i])).push_back('\n');
      continue;
    }
    if (i > 0) out.push_back(' ');
    out.append(std::to_string(ids[i]));
  }
  if (args.has("ids")) out += "\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

}  // namespace loom::cli
