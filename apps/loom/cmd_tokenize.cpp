// loom tokenize: the token ids or pieces of the text on standard input, with any tokenizer
// load_tokenizer reads (docs/tokenizers.md).
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cli.h"
#include "commands.h"
#include "loom/core/error.h"
#include "loom/data/text_tokens.h"
#include "loom/data/tokenizer.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom tokenize --tokenizer PATH | --checkpoint PATH [--ids] [--raw] [--max-input-mb N] < text\n"
    "\n"
    "Encodes standard input (bytes, any encoding) and prints each token as its vocabulary writes\n"
    "it, one per line, or with --ids the token ids on one line, separated by spaces. By default the\n"
    "tokenizer's files decide, as Hugging Face's encode does: special tokens written in the text\n"
    "(\"<|eot_id|>\") are their ids and BOS/EOS are added where tokenizer_config.json or\n"
    "tokenizer.json's post_processor say so. --checkpoint takes a Loom checkpoint or run folder or a\n"
    "Hugging Face model folder and uses the model's tokenizer. Standard input is read whole, at most\n"
    "--max-input-mb MiB (default 256; /dev/zero stops there with an error naming the limit).\n";

const std::vector<Option> kOptions = {
    {"tokenizer", "PATH", "byte, gpt2, a tokenizer.json or tokenizer.model file, or a directory holding one (or "
                          "vocab.json + merges.txt, encoder.json + vocab.bpe) (required)"},
    {"checkpoint", "PATH", "use the tokenizer of a Loom checkpoint or run folder, or of a Hugging Face model folder"},
    {"ids", "", "print the token ids on one line instead of one piece per line"},
    {"raw", "", "add no BOS/EOS and read special tokens in the text as plain text"},
    {"max-input-mb", "N", "refuse more than N MiB of standard input (default 256)"}};

// The tokenizer the options name: --tokenizer's, or the model's of --checkpoint.
std::unique_ptr<Tokenizer> tokenizer_from(const Args& args) {
  LOOM_CHECK(args.has("tokenizer") != args.has("checkpoint"),
             "loom tokenize needs --tokenizer PATH or --checkpoint PATH, one of them (see `loom tokenize --help`)");
  if (args.has("checkpoint")) return load_tokenizer(model_source(args.get("checkpoint")).config.data.tokenizer);
  return load_tokenizer(args.get("tokenizer"));
}

// Standard input, whole: more than max_bytes is an error naming the limit (an endless input
// such as /dev/zero stops there).
std::string read_standard_input(uint64_t max_bytes) {
  std::string text;
  std::vector<char> chunk(size_t{64} << 10);
  for (;;) {
    const ssize_t got = ::read(STDIN_FILENO, chunk.data(), chunk.size());
    if (got < 0 && errno == EINTR) continue;
    LOOM_CHECK(got >= 0, "cannot read standard input (", std::strerror(errno), ")");
    if (got == 0) return text;
    LOOM_CHECK(text.size() + static_cast<uint64_t>(got) <= max_bytes, "standard input: more than ",
               byte_limit_text(max_bytes), " without reaching its end (the limit is --max-input-mb)");
    text.append(chunk.data(), static_cast<size_t>(got));
  }
}
}  // namespace

int tokenize_main(int argc, char** argv) {
  const Args args(argc, argv, "tokenize", kHelp, kOptions);
  const std::unique_ptr<Tokenizer> tokenizer = tokenizer_from(args);
  const int64_t max_mb = args.get_int("max-input-mb", 256);
  LOOM_CHECK(max_mb >= 1 && max_mb <= (int64_t{1} << 20), "--max-input-mb must be in [1, 1048576], got ", max_mb);
  const std::string text = read_standard_input(static_cast<uint64_t>(max_mb) << 20);
  const bool raw = args.has("raw");
  const std::vector<int32_t> ids = tokenizer->encode(text, {.add_special_tokens = !raw, .parse_special_tokens = !raw});
  std::string out;  // written a MiB at a time
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!args.has("ids")) {
      out.append(tokenizer->token_text(ids[i])).push_back('\n');
    } else {
      if (i > 0) out.push_back(' ');
      out.append(std::to_string(ids[i]));
    }
    if (out.size() >= (size_t{1} << 20)) std::fwrite(out.data(), 1, out.size(), stdout), out.clear();
  }
  if (args.has("ids")) out += "\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

}  // namespace loom::cli
