#include "loom/nn/sequence_parallel.h"

#include "loom/core/error.h"

namespace loom {

namespace {
// (t, B, Tl, C) staging <-> (B, T, C) full, T = t Tl: shard r is a B x (Tl C) block of each.
void restage(Backend& backend, const Tensor& full, const Tensor& staging, int t, bool to_full) {
  const int64_t B = full.dim(0), T = full.dim(1), C = full.dim(2), Tl = T / t;
  for (int64_t r = 0; r < t; ++r) {
    if (to_full) backend.copy_block(staging, full, BlockCopy{B, Tl * C, r * B, 0, Tl * C, 0, r * Tl * C, T * C});
    else backend.copy_block(full, staging, BlockCopy{B, Tl * C, 0, r * Tl * C, T * C, r * B, 0, Tl * C});
  }
}

void check(const char* op, Communicator& tp, const Tensor& local, const Tensor& full, const Tensor& staging) {
  LOOM_CHECK(full.ndim() == 3 && local.ndim() == 3 && full.dim(1) == local.dim(1) * tp.size() &&
                 full.dim(0) == local.dim(0) && full.dim(2) == local.dim(2) && staging.numel() >= full.numel(),
             op, " on rank ", tp.rank(), ": local ", local.describe(), " is not a 1/", tp.size(), " sequence shard of ",
             full.describe());
}
}  // namespace

void sequence_all_gather(Backend& backend, Communicator& tp, const Tensor& local, const Tensor& full, const Tensor& staging) {
  check("sequence all-gather", tp, local, full, staging);
  const Tensor stage = staging.view(0, {full.numel()});
  tp.all_gather(local.view(0, {local.numel()}), stage);
  restage(backend, full, stage, tp.size(), true);
}

void sequence_reduce_scatter(Backend& backend, Communicator& tp, const Tensor& full, const Tensor& local, const Tensor& staging) {
  check("sequence reduce-scatter", tp, local, full, staging);
  const Tensor stage = staging.view(0, {full.numel()});
  restage(backend, full, stage, tp.size(), false);
  tp.reduce_scatter(stage, local.view(0, {local.numel()}));
}

}  // namespace loom
