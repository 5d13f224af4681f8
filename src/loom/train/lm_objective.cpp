#include "loom/train/lm_objective.h"

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "loom/core/error.h"
#include "loom/data/prepare.h"
#include "loom/train/parallelize.h"
#include "loom/core/str_printf.h"
#include "loom/train/config.h"

namespace loom {

namespace fs = std::filesystem;

void set_document_end(const LoomConfig& config, TokenDataset& data) {
  if (!config.data.document_mask) return;
  // Documents end at the end-of-text token the dataset's tokenizer appends (loom prepare).
  const int32_t end = load_tokenizer(config.data.tokenizer)->eot_token();
  LOOM_CHECK(end >= 0 && end < static_cast<int64_t>(data.vocab_size), "data.document_mask: the tokenizer ",
             config.data.tokenizer, " has no end-of-text token in the dataset's vocabulary (", data.vocab_size, ")");
  data.train.document_end = data.val.document_end = end;
}

TokenDataset open_training_data(LoomConfig& config) {
  const bool default_data = config.data.input.empty() && config.data.dir == DataConfig{}.dir;
  if (!fs::exists(config.data.dir) && default_data) {
    std::printf("preparing the default corpus into %s (first run)\n", config.data.dir.c_str());
    const std::vector<std::string> documents = default_corpus_documents();
    prepare_dataset(documents, *prepare_tokenizer(config.data.tokenizer, documents, config.data.dir), config.data.dir,
                    config.data.val_fraction);
  }
  TokenDataset data = open_dataset(config.data.dir);
  config.data.tokenizer = data.tokenizer;  // the tokenizer the shards were made with (e.g. DIR/tokenizer for bpe:N)
  if (config.model.vocab_size == 0) config.model.vocab_size = static_cast<int64_t>(data.vocab_size);
  LOOM_CHECK(config.model.vocab_size == static_cast<int64_t>(data.vocab_size), "model.vocab_size (", config.model.vocab_size,
             ") differs from the dataset's vocabulary (", data.vocab_size, ", ", config.data.dir,
             "/meta.json); set model.vocab_size = 0 to follow the data");
  set_document_end(config, data);
  // Each split needs one window of seq_len + 1 tokens; a dataset prepared without a held-out
  // split (or a tiny one) is named here rather than by the loader deep inside the run.
  for (const TokenSplit* split : {&data.train, &data.val}) {
    LOOM_CHECK(split->tokens.size() >= static_cast<size_t>(config.train.seq_len) + 1, config.data.dir, ": the ",
               split->name, " split has ", split->tokens.size(), " tokens, fewer than train.seq_len + 1 = ",
               config.train.seq_len + 1, split->name == "val" ? "; prepare it again with a larger --val-fraction" : "");
  }
  return data;
}

// ---- The base's defaults: language modelling's validation -----------------------------------

Validation Objective::validate(ObjectiveContext& ctx) {
  return {ctx.data.validation_loss(*ctx.parts.trainer, ctx.config.loop.eval_batches, ctx.backend.allocator())};
}

void Objective::after_validation(ObjectiveContext& ctx, int64_t step, const Validation& v) {
  ctx.sink.line(str_printf("step %lld: validation loss %.4f (perplexity %.1f)", static_cast<long long>(step), v.value,
                           std::exp(v.value)));
}

std::shared_ptr<Tokenizer> objective_tokenizer(LoomConfig& config) {
  std::shared_ptr<Tokenizer> tokenizer = load_tokenizer(config.data.tokenizer);
  if (config.model.vocab_size == 0) config.model.vocab_size = tokenizer->vocab_size();
  LOOM_CHECK(tokenizer->vocab_size() <= config.model.vocab_size, "data.tokenizer ", config.data.tokenizer, " has ",
             tokenizer->vocab_size(), " tokens, more than model.vocab_size = ", config.model.vocab_size);
  return tokenizer;
}

// ---- train.objective = lm ------------------------------------------------------------------

void LmObjective::read_data(LoomConfig& config) { data_ = open_training_data(config); }

TrainingSplits LmObjective::make_splits(const LoomConfig& config, Transformer&) {
  const int64_t T = config.train.seq_len;
  TrainingSplits s;
  s.train = std::make_unique<TokenLoader>(std::move(data_.train), T, config.loop.seed);
  s.val = std::make_unique<TokenLoader>(std::move(data_.val), T, config.loop.seed, LOADER_ORDER_SEQUENTIAL);
  return s;
}

std::unique_ptr<Objective> make_lm_objective(const LoomConfig&) { return std::make_unique<LmObjective>(); }

}  // namespace loom
