#include "loom/parallel/zero.h"

#include <algorithm>
#include <cstring>

#include "loom/core/error.h"

namespace loom {

ShardRange shard_range(int64_t total, int rank, int world) {
  LOOM_CHECK(world >= 1 && rank >= 0 && rank < world, "rank ", rank, " outside a world of ", world);
  ShardRange r;
  r.shard = (total + world - 1) / world;
  r.begin = std::min(total, rank * r.shard);
  r.end = std::min(total, r.begin + r.shard);
  return r;
}

bool elementwise_optimizer(const std::string& name) {
  for (const char* n : {"sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam", "adamw", "lion"}) {
    if (name == n) return true;
  }
  return false;
}

std::vector<OptimParam> shard_optim_params(const std::vector<OptimParam>& list, int64_t begin, int64_t end) {
  std::vector<OptimParam> out;
  for (const OptimParam& q : list) {
    const int64_t lo = std::max(begin, q.offset), hi = std::min(end, q.offset + q.numel);
    if (lo >= hi) continue;
    OptimParam p = q;
    p.offset = lo, p.numel = hi - lo;
    p.matrix = p.hidden = false;
    p.segments = {OptimSegment{lo, 1, hi - lo, 1}};
    out.push_back(std::move(p));
  }
  return out;
}

ShardGather::ShardGather(Communicator& comm, Allocator& allocator, int64_t total)
    : comm_(comm), total_(total), range_(shard_range(total, comm.rank(), comm.size())) {
  shard_ = Tensor::zeros(allocator, {range_.shard}, DTYPE_F32, MEM_WORKSPACE);
  padded_ = Tensor::zeros(allocator, {range_.shard * comm.size()}, DTYPE_F32, MEM_WORKSPACE);
}

void ShardGather::gather_slices(const Tensor& full) {
  LOOM_CHECK(full.numel() == total_, "ZeRO gather: buffer ", full.describe(), " is not ", total_, " elements");
  gather_shard(full.view(range_.begin, {range_.end - range_.begin}), full);
}

void ShardGather::gather_shard(const Tensor& shard, const Tensor& full) {
  const int64_t n = range_.end - range_.begin;
  LOOM_CHECK(shard.numel() == n && full.numel() == total_, "ZeRO gather on rank ", comm_.rank(), ": shard ",
             shard.describe(), " and full ", full.describe(), " should hold ", n, " and ", total_, " elements");
  std::memcpy(shard_.data<float>(), shard.data<float>(), static_cast<size_t>(n) * sizeof(float));
  comm_.all_gather(shard_, padded_);
  std::memcpy(full.data<float>(), padded_.data<float>(), static_cast<size_t>(total_) * sizeof(float));
}

}  // namespace loom
