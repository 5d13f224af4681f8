// ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
// Models", SC'20): the model state is partitioned over the N data-parallel ranks.
//
// The flat buffers of P elements are cut into N shards of S = ceil(P / N) elements (the last
// one short; any P works): rank r owns elements [rS, min((r+1)S, P)).
//   stage 1: the optimizer state holds this rank's shard only; gradients are all-reduced as in
//            DDP, each rank updates its shard, then the shards are all-gathered.
//   stage 2: + gradients: after each layer's backward its gradient is reduce-scattered (every
//            micro-batch), each rank keeps its shard and returns the rest of the layer's
//            gradient memory to the OS.
//   stage 3: + parameters: each rank keeps its parameter shard; a layer's parameters are
//            all-gathered just before its forward and again before its backward, then freed,
//            and the next layer's gather is started (prefetch) before this one computes.
// Model-state bytes per rank (ZeRO, Rajbhandari et al. 2020; fp32 weights and AdamW, K = 8):
//   stage 0: 4P + 4P + 8P, stage 1: 4P + 4P + 8P/N, stage 2: 4P + (4 + 8)P/N, stage 3: 16P/N.
// Communication per rank and step: stages 0-2 move 2(N-1)/N x 4P bytes (all-reduce, or
// reduce-scatter + all-gather); stage 3 3(N-1)/N x 4P (two gathers and a reduce-scatter): 1.5x.
//
// Sharded memory is real: the flat buffers keep their address range (views stay valid) and the
// elements a rank does not own are released to the OS (core/pages.h), so their pages are not
// resident; resident_bytes() measures it. On a backend whose memory the host cannot page (a
// GPU) they are zeroed through the backend instead: the same values, the memory kept.
//
// Under pipeline parallelism a rank updates only its stages' parameters: stage 1 then shards that
// domain (the stages' flat ranges, concatenated) over the data-parallel group, so each rank holds
// 1/N of its stages' optimizer state, and gathers the domain only. Stages 2 and 3 shard the whole
// buffer (DeepSpeed likewise refuses ZeRO-2/3 with a pipeline: gradients accumulate over the
// schedule's micro-batches while stages are still computing).
//
// Only element-wise optimizers can be cut at arbitrary element boundaries (their update of an
// element depends on that element alone); the others are refused with a one-line error.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/core/range_set.h"
#include "loom/optim/optimizer.h"

namespace loom {

struct ShardRange {
  int64_t begin = 0, end = 0;  // this rank's elements, [begin, end) within [0, P)
  int64_t shard = 0;           // S = ceil(P / N): the padded shard size
};
ShardRange shard_range(int64_t total, int rank, int world);

// How many elements of [begin, end) fall in each rank's shard (they lie back to back, in rank
// order: the segment layout of Communicator's v-collectives).
std::vector<int64_t> shard_counts(int64_t begin, int64_t end, int64_t total, int world);
void shard_counts(int64_t begin, int64_t end, int64_t total, int world, std::vector<int64_t>& counts);  // into counts

// The parameter list restricted to [begin, end): parameters cut at the edges, one flat
// segment each (element-wise rules ignore the matrix structure).
std::vector<OptimParam> shard_optim_params(const std::vector<OptimParam>& list, int64_t begin, int64_t end);

class ZeroSharding {
 public:
  // units[u]: the flat ranges of parameter unit u, as the model's use hooks name them (stage 3).
  // domain: the flat ranges sharded (empty: the whole buffer; stage 1 only otherwise).
  // frozen_end (stages 2 and 3): elements [0, frozen_end) are frozen (LoRA's base): they have no
  // gradient, so none is zeroed, reduced, scaled or kept resident there, and stage 2 gathers only
  // [frozen_end, P) after the update; stage 3 still shards and gathers the frozen parameters.
  // The trainer then reports one ready offset per micro-batch, reduce_from(frozen_end), after the
  // whole backward (the adapters sit after the base in the flat layout but finish last).
  // The shard's element work (zeroing, the 1/N scaling, zeroing released device memory) runs on `backend`.
  ZeroSharding(Communicator& comm, Backend& backend, int stage, const Tensor& params, const Tensor& grads,
               std::vector<RangeSet> units, RangeSet domain = {}, int64_t frozen_end = 0);
  int stage() const { return stage_; }
  // This rank's shard as positions in the domain (with the whole buffer as domain: flat elements).
  const ShardRange& range() const { return range_; }
  int64_t domain_size() const { return domain_total_; }
  // The shard's flat pieces, in domain order (the optimizer state's element order).
  RangeSet pieces() const { return domain_.pieces(range_.begin, range_.end); }
  // The optimizer state as a checkpoint holds it (one process's: the trained elements in flat
  // order, the domain, or with a frozen base [frozen_end, P)): its length, this rank's offset in
  // it, and every rank's count (back to back in rank order: an all-gather's segments).
  int64_t state_size() const { return frozen_end_ > 0 ? total_ - frozen_end_ : domain_total_; }
  int64_t state_offset() const { return frozen_end_ > 0 ? grad_shard().begin - frozen_end_ : range_.begin; }
  std::vector<int64_t> state_counts() const;

  // Stages 1 and 2, after the optimizer step: every rank's updated shard of the parameters to
  // every rank (in-place all-gather). Stage 3: the same, once, to make the parameters whole
  // again (e.g. to sample after training); further use hooks then do nothing.
  void gather_params();

  // Stages 2 and 3: gradients. zero_grads() zeroes this rank's shard and releases the rest;
  // reduce_from(offset) is backward's ready signal: the gradients in [offset, previous offset)
  // are final and their reduce-scatter starts; finish_micro() waits for all of them (before the
  // next micro-batch's backward adds into the buffer); finish() also divides the shard by N.
  void zero_grads();
  void reduce_from(int64_t offset);
  void finish_micro();
  void finish();

  // Stage 3: the model's parameter use hooks.
  void use(int unit, bool backward);
  void done(int unit, bool backward);
  // Stage 3: releases every parameter element outside this rank's shard (after the parameters
  // were written whole: at the start, or by a checkpoint load).
  void release_params();


 private:
  struct Pending {
    std::unique_ptr<CommWork> work;
    Range range;
  };
  // A FIFO of operations in flight over a vector that keeps its capacity (emptied, it starts
  // again at the front): after the first step, queueing allocates nothing.
  class PendingQueue {
   public:
    size_t size() const { return items_.size() - head_; }
    bool empty() const { return size() == 0; }
    Pending& front() { return items_[head_]; }
    void push_back(Pending p) { items_.push_back(std::move(p)); }
    void pop_front() {
      items_[head_++] = Pending{};
      if (head_ == items_.size()) items_.clear(), head_ = 0;
    }

   private:
    std::vector<Pending> items_;
    size_t head_ = 0;
  };
  // Elements [begin, end) of t released (host memory) or zeroed (device memory).
  void release(const Tensor& t, int64_t begin, int64_t end);
  void release_outside_shard(const Tensor& t, Range r);
  void gather(int unit, PendingQueue& into);
  // Waits until at most `keep` operations of q are in flight; gradient reductions then release
  // what this rank does not own.
  void complete(PendingQueue& q, size_t keep, bool release_grads);

  Communicator& comm_;
  Backend& backend_;
  int stage_;
  Tensor params_, grads_;
  std::vector<RangeSet> units_;
  RangeSet domain_;
  int64_t domain_total_ = 0;
  ShardRange range_;
  int64_t total_;
  int64_t frozen_end_ = 0;    // stages 2 and 3: [0, frozen_end_) has no gradients
  // This rank's shard of the gradients that exist: range_ less the frozen elements.
  Range grad_shard() const { return {std::max(range_.begin, frozen_end_), std::max(range_.end, frozen_end_)}; }
  int64_t reduced_from_ = 0;  // backward's previous ready offset
  PendingQueue reducing_;
  std::vector<PendingQueue> gathering_;  // [unit]: gathers in flight
  std::vector<std::unique_ptr<CommWork>> gathers_;  // gather_params()'s, one per domain range
  std::vector<int64_t> counts_;                     // a v-collective's shard_counts
  std::vector<bool> resident_;                  // [unit]: gathered and not yet released
  bool whole_ = false;                          // gather_params() made stage 3's parameters whole
};

}  // namespace loom
