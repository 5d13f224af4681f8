// train.objective = lm: the mean next-token loss over the counted targets of token shards
// (data.dir, made by `loom prepare`): plain text, or supervised fine-tuning data (chat-jsonl,
// jsonl) whose prompt tokens the loss mask leaves out. Distillation trains on the same data.
#pragma once
#include "loom/data/shard.h"
#include "loom/train/objective.h"

namespace loom {

class LmObjective : public Objective {
 public:
  void read_data(LoomConfig& config) override;
  TrainingSplits make_splits(const LoomConfig& config, Transformer& model) override;

 private:
  TokenDataset data_;
};

std::unique_ptr<Objective> make_lm_objective(const LoomConfig& config);

// data.document_mask: the splits' documents end at the tokenizer's end-of-text token (else nothing).
void set_document_end(const LoomConfig& config, TokenDataset& data);
// The run's token shards (the default corpus is prepared on the first run); model.vocab_size
// follows the data when 0, and data.tokenizer becomes the one the shards were made with.
TokenDataset open_training_data(LoomConfig& config);

}  // namespace loom
