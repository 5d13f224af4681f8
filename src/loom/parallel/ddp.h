// Data parallelism (PyTorch DDP, Li et al., VLDB 2020): every rank holds the whole model, runs
// its own part of the global batch, and the gradients are averaged over ranks by all-reduce
// before the (identical) optimizer step. The flat gradient buffer is cut into buckets of about
// `bucket_bytes` along parameter boundaries, from the end of the buffer, because backward
// finishes the parameters in that order (head and last block first): as soon as backward has
// finished every gradient of a bucket, its all-reduce is started asynchronously and runs while
// backward computes the earlier layers. Micro-batches before the last of an accumulation are
// "no-sync": nothing is communicated until the last one.
//
// Reduction order: each element's sum over ranks is MPI's (OpenMPI's all-reduce algorithm for
// the bucket size), then one multiplication by 1/N in fp32; a single-process run of the whole
// global batch sums the same per-token terms in another order, so the two agree to fp32
// rounding (tests: 1e-5 relative per step over 20 steps).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/parallel/compress.h"
#include "loom/arch/param_layout.h"

namespace loom {

struct DdpConfig {
  int64_t bucket_bytes = 25 << 20;  // PyTorch DDP's default bucket_cap_mb = 25
  bool overlap = true;              // false: one all-reduce per bucket after backward (for comparison)
  int64_t zero_stage = 0;           // 0: plain DDP; 1-3: ZeRO (parallel/zero.h)
  Compression compression = Compression::none;  // parallel/compress.h; replaces each bucket's all-reduce
  double topk_ratio = 0.01;          // fraction of each bucket's entries Top-K (and DGC, finally) sends
  DgcOptions dgc;                    // DGC's momentum, clipping and warm-up (its ratio is topk_ratio)
  int qsgd_levels = 127;             // QSGD's s
  int powersgd_rank = 4;             // PowerSGD's r
  int64_t compression_warmup = 0;    // steps (finish() calls) of plain all-reduce before the compressor takes over
  // Frozen parameters (LoRA's base, [0, frozen_below)): no gradients, so no bucket covers them.
  int64_t frozen_below = 0;
};

class DataParallel {
 public:
  // backend: where the gradients live and the compressors' ops run.
  DataParallel(Communicator& comm, Backend& backend, const Tensor& grads, const ParamLayout& layout,
               DdpConfig config = {});

  // Bucket b covers flat elements [begin, end) of the gradient buffer; buckets are in launch
  // order (the last parameters first).
  struct Bucket {
    int64_t begin = 0, end = 0;
  };
  const std::vector<Bucket>& buckets() const { return buckets_; }

  // Called by backward: every gradient at flat offset >= `offset` is final. Launches the
  // all-reduce of each bucket now entirely ready (overlap on).
  void ready_from(int64_t offset);
  // After backward: launches what is left, waits for every bucket and divides by the world size
  // (Backend::scale_inplace).
  void finish();

 private:
  Communicator& comm_;
  Backend& backend_;
  Tensor grads_;
  DdpConfig config_;
  std::vector<Bucket> buckets_;
  size_t launched_ = 0;
  std::vector<std::unique_ptr<CommWork>> in_flight_;
  std::unique_ptr<GradCompressor> compressor_;
  int64_t steps_ = 0;  // finish() calls so far (the compression warm-up)
};

}  // namespace loom
