#include "loom/parallel/slice_source.h"

#include <algorithm>

#include "loom/core/error.h"
#include "loom/nn/context_parallel.h"

namespace loom {

RankSliceSource::RankSliceSource(BatchSource& global, Allocator& allocator, int rank, int world, int64_t batch,
                                 int64_t seq_len)
    : global_(global), rank_(rank), world_(world) {
  LOOM_CHECK(world >= 1 && rank >= 0 && rank < world, "rank ", rank, " outside a world of ", world);
  tokens_ = Tensor::empty(allocator, {batch * world, seq_len}, DTYPE_I32, MEM_WORKSPACE);
  targets_ = Tensor::empty(allocator, {batch * world, seq_len}, DTYPE_I32, MEM_WORKSPACE);
}

ContextSliceSource::ContextSliceSource(BatchSource& inner, Allocator& allocator, int rank, int world, int64_t batch,
                                       int64_t seq_len)
    : inner_(inner), rank_(rank), world_(world) {
  check_cp_seq_len(seq_len, world);
  tokens_ = Tensor::empty(allocator, {batch, seq_len, 1}, DTYPE_I32, MEM_WORKSPACE);
  targets_ = Tensor::empty(allocator, {batch, seq_len, 1}, DTYPE_I32, MEM_WORKSPACE);
}

void ContextSliceSource::fill(const Tensor& tokens, const Tensor& targets) {
  LOOM_CHECK(tokens.numel() * world_ == tokens_.numel(), "ContextSliceSource: local batch ", tokens.describe(),
             " is not 1/", world_, " of ", tokens_.describe());
  inner_.fill(tokens_.view(0, {tokens_.dim(0), tokens_.dim(1)}), targets_.view(0, {targets_.dim(0), targets_.dim(1)}));
  const Shape local{tokens_.dim(0), tokens_.dim(1) / world_, 1};
  cp_take_local(tokens_, tokens.view(0, local), rank_, world_);
  cp_take_local(targets_, targets.view(0, local), rank_, world_);
}

void RankSliceSource::fill(const Tensor& tokens, const Tensor& targets) {
  LOOM_CHECK(tokens.numel() * (tokens_.numel() / tokens.numel()) == tokens_.numel() &&
             tokens.dim(-1) == tokens_.dim(-1),
             "RankSliceSource: micro-batch ", tokens.describe(), " does not match ", tokens_.describe());
  global_.fill(tokens_, targets_);
  const int64_t n = tokens.numel();
  std::copy_n(tokens_.data<int32_t>() + rank_ * n, n, tokens.data<int32_t>());
  std::copy_n(targets_.data<int32_t>() + rank_ * n, n, targets.data<int32_t>());
}

std::vector<RowInfo> RankSliceSource::rows() const {
  const std::vector<RowInfo> all = global_.rows();
  if (all.empty()) return all;
  const int64_t local = tokens_.dim(0) / world_;
  return {all.begin() + rank_ * local, all.begin() + (rank_ + 1) * local};
}

}  // namespace loom
