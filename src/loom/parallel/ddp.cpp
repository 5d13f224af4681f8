#include "loom/parallel/ddp.h"

#include <algorithm>

#include "loom/core/error.h"

namespace loom {

DataParallel::DataParallel(Communicator& comm, Backend& backend, const Tensor& grads, const ParamLayout& layout,
                           DdpConfig config)
    : comm_(comm), backend_(backend), grads_(grads), config_(config) {
  LOOM_CHECK(config_.bucket_bytes > 0, "parallel.bucket_mb must be > 0");
  LOOM_CHECK(config_.compression_warmup >= 0, "parallel.compression_warmup must be >= 0, got ", config_.compression_warmup);
  LOOM_CHECK(grads.dtype() == DTYPE_F32 && grads.numel() == layout.total, "data parallel: gradient buffer ",
             grads.describe(), " does not match the layout's ", layout.total, " parameters");
  const int64_t cap = std::max<int64_t>(1, config_.bucket_bytes / static_cast<int64_t>(sizeof(float)));
  // Walk the parameters from the last one, closing a bucket when it reaches the cap.
  std::vector<const ParamSpec*> specs;
  for (const ParamSpec& p : layout.params) specs.push_back(&p);
  std::sort(specs.begin(), specs.end(), [](const ParamSpec* a, const ParamSpec* b) { return a->offset > b->offset; });
  int64_t end = layout.total, begin = layout.total;
  for (const ParamSpec* p : specs) {
    if (p->offset < config_.frozen_below) break;
    begin = p->offset;
    if (end - begin >= cap) {
      buckets_.push_back({begin, end});
      end = begin;
    }
  }
  if (end > config_.frozen_below) buckets_.push_back({config_.frozen_below, end});
  switch (config_.compression) {
    case Compression::none: break;
    case Compression::dgc: {
      DgcOptions dgc = config_.dgc;
      dgc.ratio = config_.topk_ratio;
      compressor_ = make_dgc_compressor(backend, layout.total, dgc);
      break;
    }
    case Compression::powersgd: compressor_ = make_powersgd_compressor(backend, layout, config_.powersgd_rank, 0x5D); break;
    case Compression::qsgd: compressor_ = make_qsgd_compressor(backend, layout.total, config_.qsgd_levels, 0x95D); break;
    case Compression::topk: compressor_ = make_topk_compressor(backend, layout.total, config_.topk_ratio); break;
    case Compression::onebit: compressor_ = make_onebit_compressor(backend, layout.total); break;
  }
  // Every bucket's buffers now: a training step allocates nothing.
  for (const Bucket& b : buckets_) {
    if (compressor_) compressor_->prepare(comm_.size(), b.begin, b.end - b.begin);
  }
}

void DataParallel::ready_from(int64_t offset) {
  if (!config_.overlap) return;
  while (launched_ < buckets_.size() && buckets_[launched_].begin >= offset) {
    const Bucket& b = buckets_[launched_++];
    if (compressor_ && steps_ >= config_.compression_warmup) {  // blocking: the hook's sparse exchange
      compressor_->reduce(comm_, grads_.view(b.begin, {b.end - b.begin}), b.begin);
      continue;
    }
    in_flight_.push_back(comm_.all_reduce_async(grads_.view(b.begin, {b.end - b.begin}), REDUCE_SUM));
  }
}

void DataParallel::finish() {
  const bool overlap = config_.overlap;
  config_.overlap = true;
  ready_from(0);
  config_.overlap = overlap;
  for (auto& w : in_flight_) w->wait();
  in_flight_.clear();
  launched_ = 0;
  ++steps_;
  if (comm_.size() > 1) {
    const float inv = 1.0f / static_cast<float>(comm_.size());
    // The float multiply g *= inv, over the gradients that exist (a frozen base's pages stay unwritten).
    const int64_t n = grads_.numel() - config_.frozen_below;
    if (n > 0) backend_.scale_inplace(grads_.view(config_.frozen_below, {n}), inv);
  }
}

}  // namespace loom
