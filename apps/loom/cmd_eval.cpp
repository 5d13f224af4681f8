// loom eval: loss and perplexity of a checkpoint on a dataset split.
#include <cmath>
#include <cstdio>

#include "cli.h"
#include "commands.h"
#include "loom/core/error.h"
#include "loom/data/loader.h"
#include "loom/data/shard.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom eval --checkpoint PATH [--data DIR] [--split val|train] [--batches N]\n"
    "\n"
    "PATH is a step folder, a run folder or a checkpoints folder (the newest valid checkpoint is\n"
    "used). Evaluates N batches (default: all of the split, at most 200) of the run's batch size\n"
    "and sequence length, in order, and prints the mean loss and perplexity.\n";
}  // namespace

int eval_main(int argc, char** argv) {
  const Args args(argc, argv, "eval", kHelp,
                  {{"checkpoint", "PATH", "a step folder, a run folder or a checkpoints folder (required)"},
                   {"data", "DIR", "the dataset (default: the run's data.dir)"},
                   {"split", "val|train", "the split to evaluate (default: val)"},
                   {"batches", "N", "batches to evaluate (default: the whole split, at most 200)"}});
  LOOM_CHECK(args.has("checkpoint"), "loom eval needs --checkpoint PATH");
  const ModelSource source = model_source(args.get("checkpoint"));
  const LoomConfig& config = source.config;
  const std::string& step_dir = source.path;
  TokenDataset data = open_dataset(args.get("data", config.data.dir));
  const std::string split = args.get("split", "val");
  LOOM_CHECK(split == "val" || split == "train", "--split must be val or train, got '", split, "'");
  LOOM_CHECK(static_cast<int64_t>(data.vocab_size) == config.model.vocab_size, "dataset vocabulary ", data.vocab_size,
             " differs from the model's ", config.model.vocab_size);

  auto backend = make_cpu_backend();
  Transformer model(*backend, config.model);
  load_weights(source, model.params());
  ActivationStore store = model.allocate_store(config.train.batch_size, config.train.seq_len);
  TokenLoader loader(split == "val" ? std::move(data.val) : std::move(data.train), config.train.seq_len, 0,
                     LOADER_ORDER_SEQUENTIAL);
  const int64_t per_batch = config.train.batch_size;
  const int64_t available = static_cast<int64_t>(loader.windows_per_epoch()) / per_batch;
  const int64_t batches = args.get_int("batches", std::min<int64_t>(std::max<int64_t>(available, 1), 200));
  double sum = 0.0;
  for (int64_t i = 0; i < batches; ++i) {
    loader.fill(store.tokens, store.targets);
    sum += model.forward(store);
  }
  const double loss = sum / static_cast<double>(batches);
  std::printf("%s: %s loss %.4f, perplexity %.2f (%lld batches of %lldx%lld tokens)\n", step_dir.c_str(), split.c_str(), loss,
              std::exp(loss), static_cast<long long>(batches), static_cast<long long>(per_batch),
              static_cast<long long>(config.train.seq_len));
  return 0;
}

}  // namespace loom::cli
