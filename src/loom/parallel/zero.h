// ZeRO stage 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
// Parameter Models", SC'20): the optimizer state is partitioned over the data-parallel ranks.
// The flat parameter buffer of P elements is cut into N equal shards of S = ceil(P / N)
// elements (the last padded; any P works); rank r keeps the optimizer state of elements
// [rS, min((r+1)S, P)) and updates only those, after the gradients were all-reduced as in DDP;
// then the updated shards are all-gathered so every rank again holds all parameters.
// Optimizer-state bytes per rank: K Psi / N (K = 8 for fp32 AdamW's two moments) plus padding.
// Only element-wise optimizers can be cut at arbitrary element boundaries (their update of an
// element depends on that element alone); the others are refused with a one-line error.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/optim/optimizer.h"

namespace loom {

struct ShardRange {
  int64_t begin = 0, end = 0;  // this rank's elements, [begin, end) within [0, P)
  int64_t shard = 0;           // S = ceil(P / N): the padded shard size
};
ShardRange shard_range(int64_t total, int rank, int world);

// True for the optimizers whose update is element-wise (sgd, momentum, nesterov, adagrad,
// rmsprop, adam, adamw, lion).
bool elementwise_optimizer(const std::string& name);

// The parameter list restricted to [begin, end): parameters cut at the edges, one flat
// segment each (element-wise rules ignore the matrix structure).
std::vector<OptimParam> shard_optim_params(const std::vector<OptimParam>& list, int64_t begin, int64_t end);

// All-gathers each rank's [begin, end) slice of a flat buffer into every rank's copy, through
// padded staging buffers of S and N S elements.
class ShardGather {
 public:
  ShardGather(Communicator& comm, Allocator& allocator, int64_t total);
  const ShardRange& range() const { return range_; }
  // full (total) f32: every rank's slice of `full` becomes everyone's.
  void gather_slices(const Tensor& full);
  // shard (end - begin) f32 to full (total): a sharded optimizer state tensor, whole.
  void gather_shard(const Tensor& shard, const Tensor& full);

 private:
  Communicator& comm_;
  int64_t total_;
  ShardRange range_;
  Tensor shard_, padded_;
};

}  // namespace loom
