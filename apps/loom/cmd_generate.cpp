// loom generate: text from a checkpoint with the KV cache and a sampler.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "cli.h"
#include "commands.h"
#include "loom/core/error.h"
#include "loom/infer/generate.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom generate --checkpoint PATH [--prompt TEXT | --prompt-file FILE] [--tokens N]\n"
    "                     [--temperature T] [--top-k K] [--top-p P] [--seed S] [--greedy]\n"
    "\n"
    "PATH is a step folder, a run folder or a checkpoints folder (newest valid checkpoint).\n"
    "Feeds the prompt through the model's KV cache, then samples N tokens (default: the run's\n"
    "sample.* settings): temperature 0 or --greedy takes the most likely token. Stops at the\n"
    "end-of-text token or the model's context length. Same seed, same text.\n";
}  // namespace

int generate_main(int argc, char** argv) {
  if (argc >= 1 && std::strcmp(argv[0], "--help") == 0) return std::fputs(kHelp, stdout), 0;
  const Args args(argc, argv, {"checkpoint", "prompt", "prompt-file", "tokens", "temperature", "top-k", "top-p", "seed"},
                  {"greedy"}, "generate");
  LOOM_CHECK(args.has("checkpoint"), "loom generate needs --checkpoint PATH");
  const std::string step_dir = resolve_checkpoint(args.get("checkpoint"));
  const LoomConfig config = checkpoint_config(step_dir);
  std::string prompt = args.get("prompt", config.sample.prompt);
  if (args.has("prompt-file")) {
    std::ifstream in(args.get("prompt-file"));
    LOOM_CHECK(in, args.get("prompt-file"), ": cannot open prompt file");
    std::stringstream buffer;
    buffer << in.rdbuf();
    prompt = buffer.str();
  }
  SamplingConfig sampling = config.sample.sampling;
  sampling.temperature = args.has("greedy") ? 0.0f : static_cast<float>(args.get_double("temperature", sampling.temperature));
  sampling.top_k = args.get_int("top-k", sampling.top_k);
  sampling.top_p = static_cast<float>(args.get_double("top-p", sampling.top_p));
  sampling.seed = static_cast<uint64_t>(args.get_int("seed", static_cast<int64_t>(sampling.seed)));

  const auto tokenizer = load_tokenizer(config.data.tokenizer);
  LOOM_CHECK(tokenizer->vocab_size() == config.model.vocab_size, "tokenizer ", tokenizer->name(), " has ",
             tokenizer->vocab_size(), " tokens but the model ", config.model.vocab_size);
  auto backend = make_cpu_backend();
  Transformer model(*backend, config.model);
  CheckpointManager(step_dir).load(step_dir, ModelState{config.model, model.params()}, OptimizerState{});
  std::vector<int32_t> ids = tokenizer->encode(prompt);
  if (ids.empty()) ids.push_back(tokenizer->eot_token());
  Sampler sampler(sampling);
  GenerateOptions options;
  options.max_new_tokens = args.get_int("tokens", config.sample.max_new_tokens);
  options.stop_token = tokenizer->eot_token();
  std::fputs(prompt.c_str(), stdout);
  std::fflush(stdout);
  std::vector<int32_t> pending;  // tokens not yet printed: a UTF-8 character may span several
  generate(model, ids, sampler, options, [&](int32_t token) {
    if (token == tokenizer->eot_token()) return;
    pending.push_back(token);
    const std::string text = tokenizer->decode(pending);
    const unsigned char last = text.empty() ? 0 : static_cast<unsigned char>(text.back());
    if (last < 0x80) {
      std::fputs(printable_utf8(text).c_str(), stdout);
      std::fflush(stdout);
      pending.clear();
    }
  });
  std::fputs(printable_utf8(tokenizer->decode(pending)).c_str(), stdout);
  std::fputs("\n", stdout);
  return 0;
}

}  // namespace loom::cli
