#include "loom/nn/sequence_parallel.h"

#include <cstring>

#include "loom/core/error.h"

namespace loom {

namespace {
// (t, B, Tl, C) staging <-> (B, T, C) full, T = t Tl.
void restage(const Tensor& full, const Tensor& staging, int t, bool to_full) {
  const int64_t B = full.dim(0), T = full.dim(1), C = full.dim(2), Tl = T / t;
  float* f = full.data<float>();
  float* s = staging.data<float>();
  const size_t row = static_cast<size_t>(Tl * C) * sizeof(float);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t b = 0; b < B; ++b) {
      float* fp = f + (b * T + r * Tl) * C;
      float* sp = s + ((r * B + b) * Tl) * C;
      if (to_full) std::memcpy(fp, sp, row);
      else std::memcpy(sp, fp, row);
    }
  }
}

void check(const char* op, Communicator& tp, const Tensor& local, const Tensor& full, const Tensor& staging) {
  LOOM_CHECK(full.ndim() == 3 && local.ndim() == 3 && full.dim(1) == local.dim(1) * tp.size() &&
                 full.dim(0) == local.dim(0) && full.dim(2) == local.dim(2) && staging.numel() >= full.numel(),
             op, " on rank ", tp.rank(), ": local ", local.describe(), " is not a 1/", tp.size(), " sequence shard of ",
             full.describe());
}
}  // namespace

void sequence_all_gather(Communicator& tp, const Tensor& local, const Tensor& full, const Tensor& staging) {
  check("sequence all-gather", tp, local, full, staging);
  const Tensor stage = staging.view(0, {full.numel()});
  tp.all_gather(local.view(0, {local.numel()}), stage);
  restage(full, stage, tp.size(), true);
}

void sequence_reduce_scatter(Communicator& tp, const Tensor& full, const Tensor& local, const Tensor& staging) {
  check("sequence reduce-scatter", tp, local, full, staging);
  const Tensor stage = staging.view(0, {full.numel()});
  restage(full, stage, tp.size(), false);
  tp.reduce_scatter(stage, local.view(0, {local.numel()}));
}

}  // namespace loom
