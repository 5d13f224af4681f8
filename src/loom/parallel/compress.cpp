#include "loom/parallel/compress.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/philox.h"

namespace loom {

namespace {

Tensor buffer(Backend& backend, Shape shape, DType dtype, MemCategory category = MEM_WORKSPACE) {
  return Tensor::zeros(backend.allocator(), std::move(shape), dtype, category);
}

// k of a sparse exchange: ratio x n rounded down, at least 1.
int64_t sparse_count(double ratio, int64_t n) {
  return std::max<int64_t>(1, static_cast<int64_t>(std::floor(ratio * static_cast<double>(n))));
}

// One bucket's buffers for an all-gather exchange: what this rank sends (i32 codes and f32
// values, or one f32 scalar) and what it receives from every rank, rank by rank.
struct Exchange {
  int64_t n = 0;
  int world = 0;
  Tensor codes, values, all_codes, all_values;
  int64_t calls = 0;  // reduce() calls so far on this bucket
};

// A compressor whose buckets exchange by all-gather: keeps one Exchange per bucket offset.
class GatherCompressor : public GradCompressor {
 public:
  explicit GatherCompressor(Backend& backend) : backend_(backend) {}

  void prepare(int world, int64_t offset, int64_t n) override {
    const auto [codes, values] = sizes(n);
    Exchange x{n, world, buffer(backend_, {codes}, DTYPE_I32), buffer(backend_, {values}, DTYPE_F32),
               buffer(backend_, {codes * world}, DTYPE_I32), buffer(backend_, {values * world}, DTYPE_F32), 0};
    buckets_[offset] = std::move(x);
    if (sparse() && scratch_.numel() < n) scratch_ = buffer(backend_, {n}, DTYPE_I32);
  }

 protected:
  // The i32 codes and the f32 values (or scalars) this rank sends at most for a bucket of n.
  virtual std::pair<int64_t, int64_t> sizes(int64_t n) const = 0;
  virtual bool sparse() const { return false; }

  Exchange& bucket(const Communicator& comm, int64_t offset, int64_t n) {
    auto it = buckets_.find(offset);
    if (it == buckets_.end() || it->second.n != n || it->second.world != comm.size()) {
      prepare(comm.size(), offset, n);
      it = buckets_.find(offset);
    }
    return it->second;
  }

  // Sends `codes` and `values` words of x by all-gather and sets g to the sum over ranks, in
  // rank order, of what `decode` makes of each rank's part.
  template <typename Decode>
  void gather_and_decode(Communicator& comm, Exchange& x, int64_t codes, int64_t values, const Tensor& g,
                         Decode decode) {
    const int64_t world = comm.size();
    const Tensor all_codes = x.all_codes.view(0, {codes * world}), all_values = x.all_values.view(0, {values * world});
    comm.all_gather(x.codes.view(0, {codes}), all_codes);
    comm.all_gather(x.values.view(0, {values}), all_values);
    backend_.fill(g, 0.0);
    decode(all_codes, all_values);
  }

  // Top-K's exchange: the k entries of acc of largest magnitude leave acc and travel as (index,
  // value) pairs; g = the sum of the N sparse vectors. The sent indices stay in x.codes[0, k).
  void exchange_top_k(Communicator& comm, Exchange& x, const Tensor& acc, const Tensor& g, int64_t k) {
    backend_.topk_extract(acc, x.codes.view(0, {k}), x.values.view(0, {k}), scratch_);
    gather_and_decode(comm, x, k, k, g, [&](const Tensor& idx, const Tensor& val) { backend_.scatter_add(idx, val, g); });
  }

  Backend& backend_;

 private:
  std::map<int64_t, Exchange> buckets_;  // by bucket offset
  Tensor scratch_;                       // Top-K's selection scratch, as long as the largest bucket
};

class TopK final : public GatherCompressor {
 public:
  TopK(Backend& backend, int64_t total, double ratio) : GatherCompressor(backend), ratio_(ratio) {
    LOOM_CHECK(ratio > 0.0 && ratio <= 1.0, "parallel.topk_ratio must be in (0, 1], got ", ratio);
    residual_ = buffer(backend, {total}, DTYPE_F32, MEM_OPTIMIZER_STATE);  // error feedback
  }

  void reduce(Communicator& comm, const Tensor& bucket_grad, int64_t offset) override {
    const int64_t n = bucket_grad.numel();
    Exchange& x = bucket(comm, offset, n);
    const Tensor e = residual_.view(offset, {n});
    backend_.add_inplace(e, bucket_grad);  // accumulated = gradient + residual
    exchange_top_k(comm, x, e, bucket_grad, sparse_count(ratio_, n));
  }

  const Tensor& residual() const override { return residual_; }

 private:
  std::pair<int64_t, int64_t> sizes(int64_t n) const override {
    const int64_t k = sparse_count(ratio_, n);
    return {k, k};
  }
  bool sparse() const override { return true; }

  double ratio_;
  Tensor residual_;
};

class Dgc final : public GatherCompressor {
 public:
  Dgc(Backend& backend, int64_t total, const DgcOptions& options)
      : GatherCompressor(backend), total_(total), options_(options) {
    LOOM_CHECK(options.ratio > 0.0 && options.ratio <= 1.0, "DGC ratio must be in (0, 1], got ", options.ratio);
    LOOM_CHECK(options.momentum >= 0.0 && options.momentum < 1.0, "DGC momentum must be in [0, 1), got ",
               options.momentum);
    LOOM_CHECK(options.warmup_steps >= 0, "DGC warmup_steps must be >= 0, got ", options.warmup_steps);
    while (std::pow(0.25, stages_ + 1) > options.ratio) ++stages_;  // warm-up densities 4^-1 .. 4^-S
    u_ = buffer(backend, {total}, DTYPE_F32, MEM_OPTIMIZER_STATE);
    v_ = buffer(backend, {total}, DTYPE_F32, MEM_OPTIMIZER_STATE);
  }

  void reduce(Communicator& comm, const Tensor& bucket_grad, int64_t offset) override {
    const int64_t n = bucket_grad.numel();
    Exchange& x = bucket(comm, offset, n);
    const int64_t t = x.calls++;
    const Tensor u = u_.view(offset, {n}), v = v_.view(offset, {n});
    double limit = 0.0;  // local clipping to this bucket's share of clip_norm N^-1/2
    if (options_.clip_norm > 0.0) {
      const double share = static_cast<double>(n) / (static_cast<double>(total_) * comm.size());
      limit = options_.clip_norm * std::sqrt(share);
    }
    backend_.dgc_accumulate(bucket_grad, u, v, static_cast<float>(options_.momentum), limit);
    const int64_t k = sparse_count(density(t), n);
    exchange_top_k(comm, x, v, bucket_grad, k);
    backend_.scatter_zero(x.codes.view(0, {k}), u);  // momentum factor masking (v was zeroed by the exchange)
  }

  const Tensor& residual() const override { return v_; }
  const Tensor* momentum() const override { return &u_; }

 private:
  double density(int64_t t) const {
    return t < options_.warmup_steps && stages_ > 0
               ? std::pow(0.25, static_cast<double>(1 + t * stages_ / options_.warmup_steps))
               : options_.ratio;
  }
  std::pair<int64_t, int64_t> sizes(int64_t n) const override {  // the densest step: the first
    const int64_t k = std::max(sparse_count(density(0), n), sparse_count(options_.ratio, n));
    return {k, k};
  }
  bool sparse() const override { return true; }

  int64_t total_;
  DgcOptions options_;
  int64_t stages_ = 0;  // S: warm-up stages
  Tensor u_, v_;
};

class OneBit final : public GatherCompressor {
 public:
  OneBit(Backend& backend, int64_t total) : GatherCompressor(backend) {
    residual_ = buffer(backend, {total}, DTYPE_F32, MEM_OPTIMIZER_STATE);
  }

  void reduce(Communicator& comm, const Tensor& bucket_grad, int64_t offset) override {
    const int64_t n = bucket_grad.numel(), words = (n + 31) / 32;
    Exchange& x = bucket(comm, offset, n);
    const Tensor e = residual_.view(offset, {n});
    backend_.add_inplace(e, bucket_grad);  // a = gradient + residual
    backend_.onebit_encode(e, x.codes, x.values);  // residual = a - p
    gather_and_decode(comm, x, words, 1, bucket_grad, [&](const Tensor& codes, const Tensor& scales) {
      backend_.onebit_decode_add(codes, scales, bucket_grad);
    });
  }
  const Tensor& residual() const override { return residual_; }

 private:
  std::pair<int64_t, int64_t> sizes(int64_t n) const override { return {(n + 31) / 32, 1}; }

  Tensor residual_;
};

class Qsgd final : public GatherCompressor {
 public:
  Qsgd(Backend& backend, int levels, uint64_t seed) : GatherCompressor(backend), levels_(levels), seed_(seed) {
    LOOM_CHECK(levels >= 1 && levels <= 127, "parallel.qsgd_levels must be in [1, 127], got ", levels);
    empty_ = buffer(backend, {1}, DTYPE_F32);
  }

  void reduce(Communicator& comm, const Tensor& bucket_grad, int64_t offset) override {
    const int64_t n = bucket_grad.numel(), words = (n + 3) / 4;
    Exchange& x = bucket(comm, offset, n);
    const QsgdSpec spec{levels_, seed_, static_cast<uint32_t>(comm.rank()), static_cast<uint32_t>(calls_++), offset};
    backend_.qsgd_encode(bucket_grad, x.codes, x.values, spec);
    gather_and_decode(comm, x, words, 1, bucket_grad, [&](const Tensor& codes, const Tensor& norms) {
      backend_.qsgd_decode_add(codes, norms, levels_, bucket_grad);
    });
  }
  const Tensor& residual() const override { return empty_; }  // unbiased: no error feedback

 private:
  std::pair<int64_t, int64_t> sizes(int64_t n) const override { return {(n + 3) / 4, 1}; }

  int levels_;
  uint64_t seed_;
  int64_t calls_ = 0;  // over every bucket: the Philox draw
  Tensor empty_;
};

class PowerSgd final : public GradCompressor {
 public:
  PowerSgd(Backend& backend, const ParamLayout& layout, int rank, uint64_t seed) : backend_(backend), layout_(layout) {
    LOOM_CHECK(rank >= 1, "parallel.powersgd_rank must be >= 1, got ", rank);
    residual_ = buffer(backend, {layout.total}, DTYPE_F32, MEM_OPTIMIZER_STATE);
    for (size_t k = 0; k < layout.params.size(); ++k) {
      const ParamSpec& p = layout.params[k];
      if (p.shape.size() != 2) continue;
      const int64_t cols = p.numel / p.shape[0], r = std::min<int64_t>(rank, std::min(p.shape[0], cols));
      std::vector<float> q(static_cast<size_t>(cols * r));
      philox_fill_normal(q.data(), cols * r, seed, static_cast<uint32_t>(k), 0, 0.0f, 1.0f);
      Factors f{buffer(backend, {p.shape[0], r}, DTYPE_F32), buffer(backend, {cols, r}, DTYPE_F32, MEM_OPTIMIZER_STATE)};
      backend.write(f.q, q.data());
      factors_.emplace(p.offset, std::move(f));
    }
  }

  void prepare(int, int64_t, int64_t) override {}  // P and Q are per matrix, allocated above

  void reduce(Communicator& comm, const Tensor& bucket_grad, int64_t offset) override {
    const int64_t n = bucket_grad.numel();
    for (const ParamSpec& p : layout_.params) {
      if (p.offset < offset || p.offset + p.numel > offset + n) continue;
      auto it = factors_.find(p.offset);
      if (it == factors_.end()) {  // a vector: plain all-reduce
        comm.all_reduce(bucket_grad.view(p.offset - offset, {p.numel}));
        continue;
      }
      const Shape shape = {p.shape[0], p.numel / p.shape[0]};
      const Tensor m = bucket_grad.view(p.offset - offset, shape), e = residual_.view(p.offset, shape);
      const Tensor& P = it->second.p;
      const Tensor& Q = it->second.q;  // the previous step's, as the warm start
      backend_.add_inplace(e, m);             // M = gradient + residual
      backend_.lowrank_project(e, Q, P, false);  // P = M Q
      comm.all_reduce(P);
      backend_.orthonormalize_columns(P);
      backend_.lowrank_project(e, P, Q, true);  // Q = M^T P (own M)
      backend_.lowrank_expand(P, Q, e, -1.0f, 1.0f);  // residual = M - P P^T M
      comm.all_reduce(Q);                               // sum over ranks of M_i^T P
      backend_.lowrank_expand(P, Q, m, 1.0f, 0.0f);   // P P^T (sum of M)
    }
  }
  const Tensor& residual() const override { return residual_; }

 private:
  struct Factors {
    Tensor p, q;  // P (rows x r), Q (cols x r)
  };
  Backend& backend_;
  const ParamLayout& layout_;
  Tensor residual_;
  std::map<int64_t, Factors> factors_;  // by parameter offset
};

}  // namespace

std::unique_ptr<GradCompressor> make_powersgd_compressor(Backend& backend, const ParamLayout& layout, int rank,
                                                         uint64_t seed) {
  return std::make_unique<PowerSgd>(backend, layout, rank, seed);
}

std::unique_ptr<GradCompressor> make_qsgd_compressor(Backend& backend, int64_t total, int levels, uint64_t seed) {
  (void)total;
  return std::make_unique<Qsgd>(backend, levels, seed);
}

std::unique_ptr<GradCompressor> make_onebit_compressor(Backend& backend, int64_t total) {
  return std::make_unique<OneBit>(backend, total);
}

std::unique_ptr<GradCompressor> make_dgc_compressor(Backend& backend, int64_t total, const DgcOptions& options) {
  return std::make_unique<Dgc>(backend, total, options);
}

std::unique_ptr<GradCompressor> make_topk_compressor(Backend& backend, int64_t total, double ratio) {
  return std::make_unique<TopK>(backend, total, ratio);
}

}  // namespace loom
