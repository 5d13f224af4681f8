// The batch sources of data and context parallelism: each rank's part of the global batch
// (train/parallelize.h's TrainingData stacks them over the loader). In parallel/, not data/:
// the context-parallel slice takes nn/context_parallel.h's zig-zag chunks.
#pragma once
#include <cstdint>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/data/batch_source.h"

namespace loom {

// This rank's rows of each global batch: fills the global (B * world, T) batch from `global`
// and keeps rows [rank * B, (rank + 1) * B), so the ranks together see exactly the batch a
// single process with batch B * world would, each a disjoint part.
class RankSliceSource final : public BatchSource {
 public:
  RankSliceSource(BatchSource& global, Allocator& allocator, int rank, int world, int64_t batch, int64_t seq_len);
  void fill(const Tensor& tokens, const Tensor& targets) override;
  int32_t document_end() const override { return global_.document_end(); }
  std::vector<RowInfo> rows() const override;  // the global fill's rows of this rank

 private:
  BatchSource& global_;
  int rank_, world_;
  Tensor tokens_, targets_;
};

// Context parallel: this rank's positions (two zig-zag chunks, nn/context_parallel.h) of every
// sequence `inner` gives: fills the whole (B, T) batch from `inner` and keeps the local rows.
class ContextSliceSource final : public BatchSource {
 public:
  ContextSliceSource(BatchSource& inner, Allocator& allocator, int rank, int world, int64_t batch, int64_t seq_len);
  void fill(const Tensor& tokens, const Tensor& targets) override;
  int32_t document_end() const override { return inner_.document_end(); }
  std::vector<RowInfo> rows() const override { return inner_.rows(); }

 private:
  BatchSource& inner_;
  int rank_, world_;
  Tensor tokens_, targets_;
};

}  // namespace loom
