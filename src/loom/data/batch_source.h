// Sources of training micro-batches. The trainer only sees BatchSource; loaders over token
// shards (and their resumable positions) implement it.
#pragma once
#include <cstdint>
#include <vector>

#include "loom/core/tensor.h"

namespace loom {

// A row of a batch of preference pairs (a sequence-level objective's, train/objective.h): its pair,
// its side, the reference model's log-probability of its completion, and the completion's token count.
struct RowInfo {
  int64_t pair = 0;
  bool chosen = true;
  double reference = 0.0;
  int64_t length = 0;
};

// Fills a micro-batch: tokens (B,T) and next-token targets (B,T), both i32.
// Host tensors: a backend whose memory host code cannot read gets the batch staged on the host
// and written with Backend::write (Trainer::load_batch, the pipeline's micro-batches).
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  virtual void fill(const Tensor& tokens, const Tensor& targets) = 0;
  // Packed documents (core/documents.h, data.document_mask): the token that ends each document
  // of the batches, whose consumer keeps attention and positions within documents; -1: none.
  virtual int32_t document_end() const { return -1; }
  // What the rows of the last fill are, for a sequence-level objective (preference pairs);
  // empty for plain windows.
  virtual std::vector<RowInfo> rows() const { return {}; }
};

// Windows of T+1 tokens from a token array, each start drawn from Philox(seed, stream 0,
// draw index): the sequence of batches is a pure function of (seed, draws so far).
class RandomWindowSource final : public BatchSource {
 public:
  RandomWindowSource(std::vector<int32_t> tokens, uint64_t seed);
  void fill(const Tensor& tokens, const Tensor& targets) override;
  int64_t draws() const { return draws_; }

 private:
  std::vector<int32_t> tokens_;
  uint64_t seed_;
  int64_t draws_ = 0;
};

}  // namespace loom
