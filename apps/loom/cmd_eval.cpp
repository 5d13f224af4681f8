// loom eval: loss and perplexity of a checkpoint on a dataset split, or on a text file.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli.h"
#include "train_output.h"
#include "commands.h"
#include "loom/core/error.h"
#include "loom/infer/score.h"
#include "loom/data/loader.h"
#include "loom/data/shard.h"
#include "loom/data/text_tokens.h"
#include "loom/train/lm_objective.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom eval --checkpoint PATH [--data DIR] [--split val|train] [--batches N]\n"
    "       loom eval --checkpoint PATH --text FILE [--seq-len T] [--batch B] [--chunk N] [--windows N]\n"
    "                 [--max-input-mb N] [--json]\n"
    "\n"
    "PATH is a step folder, a run folder or a checkpoints folder (the newest valid checkpoint is\n"
    "used), or a Hugging Face model folder. Without --text: evaluates N batches (default: all of\n"
    "the split, at most 200) of the run's batch size and sequence length, in order, and prints the\n"
    "mean loss and perplexity. With --text, as llama.cpp's perplexity tool: FILE is tokenized with\n"
    "the model's tokenizer, cut into consecutive windows of T tokens (default: the run's\n"
    "train.seq_len, at most model.max_seq_len; the last partial window dropped), and the loss is\n"
    "the mean next-token loss over every predicted position (T - 1 per window), run B windows at a\n"
    "time. A window longer than --chunk + 1 tokens (default 512) is fed --chunk positions a forward\n"
    "through a KV cache, with logits for those positions only (infer/score.h): memory bounded by\n"
    "the cache and one chunk, whatever T (llama.cpp's n_batch). --json prints one JSON object with\n"
    "loss, perplexity, tokens, windows and whether they were chunked. --windows N\n"
    "evaluates only the first N windows, reading the text only as far as they need; a text larger\n"
    "than --max-input-mb (default 256 MiB) is refused, before it is read where its size is known.\n";

int eval_text_main(const Args& args, const ModelSource& source, const Tokenizer& tokenizer, Transformer& model) {
  const LoomConfig& config = source.config;
  const std::string path = args.get("text");
  const int64_t T = args.get_int("seq-len", std::min(config.train.seq_len, config.model.max_seq_len));
  LOOM_CHECK(T >= 2 && T - 1 <= config.model.max_seq_len, "--seq-len must be in [2, model.max_seq_len + 1 = ",
             config.model.max_seq_len + 1, "], got ", T);
  const int64_t B = args.get_int("batch", 1);
  LOOM_CHECK(B >= 1, "--batch must be >= 1, got ", B);
  const int64_t max_mb = args.get_int("max-input-mb", 256);
  LOOM_CHECK(max_mb >= 1 && max_mb <= (int64_t{1} << 20), "--max-input-mb must be in [1, 1048576], got ", max_mb);
  const int64_t windows = args.get_int("windows", -1);
  LOOM_CHECK(!args.has("windows") || (windows >= 1 && windows <= INT64_MAX / T), "--windows must be >= 1, got ",
             args.get("windows"));
  // The text is read and tokenized piece by piece (data/text_tokens.h): with --windows only as
  // far as those windows need; BOS (and EOS) where the tokenizer's files say every text gets
  // them; special tokens in the text stay text.
  TextTokensOptions options;
  options.max_tokens = windows > 0 ? windows * T : -1;
  options.max_bytes = static_cast<uint64_t>(max_mb) << 20;
  options.what = "eval --text";
  options.limit = "--max-input-mb";
  options.encode.add_special_tokens = true;
  const TextTokens text = read_text_tokens(path, tokenizer, options);
  const int64_t chunk = args.get_int("chunk", 512);
  LOOM_CHECK(chunk >= 1, "--chunk must be >= 1, got ", chunk);
  const WindowsLoss r = score_windows(model, text.ids, T, B, chunk, "eval --text " + path);
  if (args.has("json")) {
    const nlohmann::json j = {{"loss", r.loss}, {"perplexity", std::exp(r.loss)}, {"tokens", r.tokens},
                              {"windows", r.windows}, {"seq_len", r.window}, {"chunked", r.chunked},
                              {"text", path}, {"checkpoint", source.path}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%s on %s: loss %.9f, perplexity %.6f (%lld tokens, %lld windows of %lld%s)\n", source.path.c_str(),
                path.c_str(), r.loss, std::exp(r.loss), static_cast<long long>(r.tokens),
                static_cast<long long>(r.windows), static_cast<long long>(r.window),
                r.chunked ? str_cat(", fed ", chunk, " positions a forward").c_str() : "");
    if (r.chunked) {  // what a window held beside the weights (infer/score.h)
      const ScoreBytes b = score_bytes(model.config(), T, chunk);
      std::printf("memory: KV cache %s (fp32), a chunk's activations %s (measured peak), its logits on the host %s, "
                  "attention scores %s\n", format_bytes(static_cast<size_t>(b.kv)).c_str(),
                  format_bytes(model.backend().allocator().tracker().peak(MEM_ACTIVATIONS)).c_str(),
                  format_bytes(static_cast<size_t>(b.logits)).c_str(), format_bytes(static_cast<size_t>(b.scores)).c_str());
    }
  }
  return 0;
}
}  // namespace

int eval_main(int argc, char** argv) {
  const Args args(argc, argv, "eval", kHelp,
                  {{"checkpoint", "PATH", "a step folder, a run folder or a checkpoints folder (required)"},
                   kDeviceOption,
                   kF32WeightsOption,
                   {"adapter", "DIR", "a PEFT LoRA adapter folder applied to the weights (docs/finetune.md)"},
                   {"data", "DIR", "the dataset (default: the run's data.dir)"},
                   {"split", "val|train", "the split to evaluate (default: val)"},
                   {"batches", "N", "batches to evaluate (default: the whole split, at most 200)"},
                   {"text", "FILE", "perplexity on a text file instead of a dataset split"},
                   {"seq-len", "T", "--text: tokens per window (default: the run's train.seq_len)"},
                   {"batch", "B", "--text: windows per forward (default 1)"},
                   {"chunk", "N", "--text: windows longer than N + 1 tokens are fed N positions a forward through a KV "
                                  "cache, logits per chunk (default 512)"},
                   {"windows", "N", "--text: evaluate only the first N windows (the text is read only that far)"},
                   {"max-input-mb", "N", "--text: refuse a text larger than N MiB (default 256)"},
                   {"json", "", "--text: print one JSON object"}});
  LOOM_CHECK(args.has("checkpoint"), "loom eval needs --checkpoint PATH");
  const ModelSource source = model_source(args.get("checkpoint"), args.get("adapter", ""));
  const LoomConfig& config = source.config;
  if (args.has("text")) {
    const auto tokenizer = model_tokenizer(config);  // refused before the weights are read
    auto backend = inference_backend(source, args.get("device", ""));
    const std::unique_ptr<Transformer> model = open_inference_model(source, *backend, args.has("f32-weights"));
    return eval_text_main(args, source, *tokenizer, *model);
  }
  const std::string& step_dir = source.path;
  TokenDataset data = open_dataset(args.get("data", config.data.dir));
  set_document_end(config, data);
  const std::string split = args.get("split", "val");
  LOOM_CHECK(split == "val" || split == "train", "--split must be val or train, got '", split, "'");
  LOOM_CHECK(static_cast<int64_t>(data.vocab_size) == config.model.vocab_size, "dataset vocabulary ", data.vocab_size,
             " differs from the model's ", config.model.vocab_size);

  auto backend = inference_backend(source, args.get("device", ""));
  const std::unique_ptr<Transformer> owned = open_inference_model(source, *backend, args.has("f32-weights"));
  Transformer& model = *owned;
  ActivationStore store = model.allocate_store(config.train.batch_size, config.train.seq_len);
  TokenLoader loader(split == "val" ? std::move(data.val) : std::move(data.train), config.train.seq_len, 0,
                     LOADER_ORDER_SEQUENTIAL);
  const int64_t per_batch = config.train.batch_size;
  const int64_t available = static_cast<int64_t>(loader.windows_per_epoch()) / per_batch;
  const int64_t batches = args.get_int("batches", std::min<int64_t>(std::max<int64_t>(available, 1), 200));
  LOOM_CHECK(batches >= 1, "--batches must be >= 1, got ", batches);
  double sum = 0.0;
  int64_t counted = 0;  // supervised data: the targets that count (the others are kIgnoreTarget)
  const int64_t positions = store.targets.numel();
  CpuAllocator host;  // each batch is filled on the host, then written to the model's backend
  const Tensor tokens = Tensor::empty(host, store.tokens.shape(), DTYPE_I32, MEM_WORKSPACE);
  const Tensor targets = Tensor::empty(host, store.targets.shape(), DTYPE_I32, MEM_WORKSPACE);
  for (int64_t i = 0; i < batches; ++i) {
    loader.fill(tokens, targets);
    if (loader.document_end() >= 0) {
      store.docs = document_spans(tokens.data<int32_t>(), tokens.dim(0), tokens.dim(1), loader.document_end());
    }
    counted += counted_targets(targets.data<int32_t>(), positions);
    backend->write(store.tokens, tokens.data<int32_t>());
    backend->write(store.targets, targets.data<int32_t>());
    sum += model.forward(store);
  }
  // forward's mean counts a masked position as 0: the mean over the counted ones.
  const bool masked = counted != batches * positions;
  LOOM_CHECK(counted > 0, step_dir, ": every target of the ", batches, " evaluated batches is masked");
  const double loss = masked ? sum * static_cast<double>(positions) / static_cast<double>(counted)
                             : sum / static_cast<double>(batches);
  std::printf("%s: %s loss %.9f, perplexity %.6f (%lld batches of %lldx%lld tokens%s)\n", step_dir.c_str(), split.c_str(),
              loss, std::exp(loss), static_cast<long long>(batches), static_cast<long long>(per_batch),
              static_cast<long long>(config.train.seq_len),
              masked ? str_cat(", ", counted, " of them counted (loss mask)").c_str() : "");
  return 0;
}

}  // namespace loom::cli
