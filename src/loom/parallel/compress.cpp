#include "loom/parallel/compress.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/philox.h"

namespace loom {

namespace {

// All-gathers every rank's packed codes (i32 words) and one f32 scalar, then sets
// g[i] = the sum over ranks, in rank order, of decode(rank's words, rank's scalar, i).
template <typename Decode>
void gather_and_sum(Communicator& comm, Allocator& allocator, const Tensor& words, float scalar, float* g, int64_t n,
                    Decode decode) {
  const int64_t world = comm.size(), w = words.numel();
  Tensor s = Tensor::empty(allocator, {1}, DTYPE_F32, MEM_WORKSPACE);
  s.data<float>()[0] = scalar;
  Tensor all_words = Tensor::empty(allocator, {w * world}, DTYPE_I32, MEM_WORKSPACE);
  Tensor all_s = Tensor::empty(allocator, {world}, DTYPE_F32, MEM_WORKSPACE);
  comm.all_gather(words, all_words);
  comm.all_gather(s, all_s);
  std::fill(g, g + n, 0.0f);
  for (int64_t r = 0; r < world; ++r) {
    const int32_t* rw = all_words.data<int32_t>() + r * w;
    const float sc = all_s.data<float>()[r];
    for (int64_t i = 0; i < n; ++i) g[i] += decode(rw, sc, i);
  }
}

// out (rows x cols) = P (rows x r) Q^T (Q: cols x r), accumulated in double.
std::vector<float> times_transpose(const float* P, const float* Q, int64_t rows, int64_t cols, int64_t r) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < cols; ++c) {
      double acc = 0.0;
      for (int64_t j = 0; j < r; ++j) acc += static_cast<double>(P[i * r + j]) * Q[c * r + j];
      out[static_cast<size_t>(i * cols + c)] = static_cast<float>(acc);
    }
  }
  return out;
}

// k of a sparse exchange: ratio x n rounded down, at least 1.
int64_t sparse_count(double ratio, int64_t n) {
  return std::max<int64_t>(1, static_cast<int64_t>(std::floor(ratio * static_cast<double>(n))));
}

// Sends the k entries of acc (n elements) of largest magnitude as (index, value) pairs by
// all-gather and zeroes them in acc (what is sent leaves the accumulator); g = the sum over
// ranks, in rank order, of the N sparse vectors. Returns the k indices this rank sent.
std::vector<int32_t> exchange_top_k(Communicator& comm, Allocator& allocator, float* acc, float* g, int64_t n,
                                    int64_t k) {
  const int64_t world = comm.size();
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), [&](int32_t a, int32_t b) {
    const float fa = std::fabs(acc[a]), fb = std::fabs(acc[b]);
    return fa > fb || (fa == fb && a < b);  // ties by index: deterministic
  });
  order.resize(static_cast<size_t>(k));
  Tensor idx = Tensor::empty(allocator, {k}, DTYPE_I32, MEM_WORKSPACE);
  Tensor val = Tensor::empty(allocator, {k}, DTYPE_F32, MEM_WORKSPACE);
  for (int64_t j = 0; j < k; ++j) {
    const int32_t i = order[static_cast<size_t>(j)];
    idx.data<int32_t>()[j] = i;
    val.data<float>()[j] = acc[i];
    acc[i] = 0.0f;  // sent: the accumulator keeps the rest
  }
  Tensor all_idx = Tensor::empty(allocator, {k * world}, DTYPE_I32, MEM_WORKSPACE);
  Tensor all_val = Tensor::empty(allocator, {k * world}, DTYPE_F32, MEM_WORKSPACE);
  comm.all_gather(idx, all_idx);
  comm.all_gather(val, all_val);
  std::fill(g, g + n, 0.0f);
  for (int64_t j = 0; j < k * world; ++j) g[all_idx.data<int32_t>()[j]] += all_val.data<float>()[j];  // rank order
  return order;
}

class TopK final : public GradCompressor {
 public:
  TopK(Allocator& allocator, int64_t total, double ratio) : allocator_(allocator), ratio_(ratio) {
    LOOM_CHECK(ratio > 0.0 && ratio <= 1.0, "parallel.topk_ratio must be in (0, 1], got ", ratio);
    residual_ = Tensor::zeros(allocator, {total}, DTYPE_F32, MEM_OPTIMIZER_STATE);  // error feedback
  }

  void reduce(Communicator& comm, const Tensor& bucket, int64_t offset) override {
    const int64_t n = bucket.numel();
    float* g = bucket.data<float>();
    float* e = residual_.data<float>() + offset;
    for (int64_t i = 0; i < n; ++i) e[i] += g[i];  // accumulated = gradient + residual
    exchange_top_k(comm, allocator_, e, g, n, sparse_count(ratio_, n));
  }

  const Tensor& residual() const override { return residual_; }

 private:
  Allocator& allocator_;
  double ratio_;
  Tensor residual_;
};

class Dgc final : public GradCompressor {
 public:
  Dgc(Allocator& allocator, int64_t total, const DgcOptions& options)
      : allocator_(allocator), total_(total), options_(options) {
    LOOM_CHECK(options.ratio > 0.0 && options.ratio <= 1.0, "DGC ratio must be in (0, 1], got ", options.ratio);
    LOOM_CHECK(options.momentum >= 0.0 && options.momentum < 1.0, "DGC momentum must be in [0, 1), got ",
               options.momentum);
    LOOM_CHECK(options.warmup_steps >= 0, "DGC warmup_steps must be >= 0, got ", options.warmup_steps);
    while (std::pow(0.25, stages_ + 1) > options.ratio) ++stages_;  // warm-up densities 4^-1 .. 4^-S
    u_ = Tensor::zeros(allocator, {total}, DTYPE_F32, MEM_OPTIMIZER_STATE);
    v_ = Tensor::zeros(allocator, {total}, DTYPE_F32, MEM_OPTIMIZER_STATE);
  }

  void reduce(Communicator& comm, const Tensor& bucket, int64_t offset) override {
    const int64_t n = bucket.numel(), t = steps_[offset]++;
    float* g = bucket.data<float>();
    float* u = u_.data<float>() + offset;
    float* v = v_.data<float>() + offset;
    if (options_.clip_norm > 0.0) {  // local clipping to this bucket's share of clip_norm N^-1/2
      double sq = 0.0;
      for (int64_t i = 0; i < n; ++i) sq += static_cast<double>(g[i]) * g[i];
      const double share = static_cast<double>(n) / (static_cast<double>(total_) * comm.size());
      const double limit = options_.clip_norm * std::sqrt(share), norm = std::sqrt(sq);
      if (norm > limit) {
        const float scale = static_cast<float>(limit / norm);
        for (int64_t i = 0; i < n; ++i) g[i] *= scale;
      }
    }
    const float m = static_cast<float>(options_.momentum);
    for (int64_t i = 0; i < n; ++i) {
      u[i] = m * u[i] + g[i];  // momentum correction
      v[i] += u[i];            // accumulation
    }
    const double density = t < options_.warmup_steps && stages_ > 0
                               ? std::pow(0.25, static_cast<double>(1 + t * stages_ / options_.warmup_steps))
                               : options_.ratio;
    for (const int32_t i : exchange_top_k(comm, allocator_, v, g, n, sparse_count(density, n))) {
      u[i] = 0.0f;  // momentum factor masking (v was zeroed by the exchange)
    }
  }

  const Tensor& residual() const override { return v_; }
  const Tensor* momentum() const override { return &u_; }

 private:
  Allocator& allocator_;
  int64_t total_;
  DgcOptions options_;
  int64_t stages_ = 0;  // S: warm-up stages
  Tensor u_, v_;
  std::map<int64_t, int64_t> steps_;  // reduce() calls so far, by bucket offset
};

class OneBit final : public GradCompressor {
 public:
  OneBit(Allocator& allocator, int64_t total) : allocator_(allocator) {
    residual_ = Tensor::zeros(allocator, {total}, DTYPE_F32, MEM_OPTIMIZER_STATE);
  }

  void reduce(Communicator& comm, const Tensor& bucket, int64_t offset) override {
    const int64_t n = bucket.numel(), words = (n + 31) / 32;
    float* g = bucket.data<float>();
    float* e = residual_.data<float>() + offset;
    double l1 = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      e[i] += g[i];  // a = gradient + residual
      l1 += std::fabs(static_cast<double>(e[i]));
    }
    const float scale = static_cast<float>(l1 / static_cast<double>(n));
    Tensor bits = Tensor::zeros(allocator_, {words}, DTYPE_I32, MEM_WORKSPACE);
    auto* w = reinterpret_cast<uint32_t*>(bits.data<int32_t>());
    for (int64_t i = 0; i < n; ++i) {
      const bool negative = e[i] < 0.0f;
      if (negative) w[i / 32] |= 1u << (i % 32);
      e[i] -= negative ? -scale : scale;  // residual = a - p
    }
    gather_and_sum(comm, allocator_, bits, scale, g, n, [](const int32_t* rw, float s, int64_t i) {
      return (reinterpret_cast<const uint32_t*>(rw)[i / 32] >> (i % 32)) & 1u ? -s : s;
    });
  }
  const Tensor& residual() const override { return residual_; }

 private:
  Allocator& allocator_;
  Tensor residual_;
};

class Qsgd final : public GradCompressor {
 public:
  Qsgd(Allocator& allocator, int levels, uint64_t seed) : allocator_(allocator), levels_(levels), seed_(seed) {
    LOOM_CHECK(levels >= 1 && levels <= 127, "parallel.qsgd_levels must be in [1, 127], got ", levels);
    empty_ = Tensor::zeros(allocator, {1}, DTYPE_F32, MEM_WORKSPACE);
  }

  void reduce(Communicator& comm, const Tensor& bucket, int64_t offset) override {
    const int64_t n = bucket.numel(), words = (n + 3) / 4;
    float* g = bucket.data<float>();
    double sq = 0.0;
    for (int64_t i = 0; i < n; ++i) sq += static_cast<double>(g[i]) * g[i];
    const float norm = static_cast<float>(std::sqrt(sq));
    Tensor codes = Tensor::zeros(allocator_, {words}, DTYPE_I32, MEM_WORKSPACE);
    auto* bytes = reinterpret_cast<int8_t*>(codes.data<int32_t>());
    const PhiloxKey key = {static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32)};
    const uint32_t draw = static_cast<uint32_t>(calls_++);
    for (int64_t q = 0; q < words && norm > 0.0f; ++q) {
      const PhiloxCounter r = philox4x32_10(
          {static_cast<uint32_t>(offset + 4 * q), static_cast<uint32_t>(comm.rank()), draw, 0x9597u}, key);
      for (int64_t j = 0; j < 4 && 4 * q + j < n; ++j) {
        const int64_t i = 4 * q + j;
        const double x = std::fabs(static_cast<double>(g[i])) / norm * levels_;
        const double l = std::floor(x);
        const int level = static_cast<int>(l) + (philox_uniform(r[static_cast<size_t>(j)]) < x - l ? 1 : 0);
        bytes[i] = static_cast<int8_t>(g[i] < 0.0f ? -level : level);
      }
    }
    const float levels = static_cast<float>(levels_);
    gather_and_sum(comm, allocator_, codes, norm, g, n, [levels](const int32_t* rw, float s, int64_t i) {
      return s / levels * static_cast<float>(reinterpret_cast<const int8_t*>(rw)[i]);
    });
  }
  const Tensor& residual() const override { return empty_; }  // unbiased: no error feedback

 private:
  Allocator& allocator_;
  int levels_;
  uint64_t seed_;
  int64_t calls_ = 0;
  Tensor empty_;
};

class PowerSgd final : public GradCompressor {
 public:
  PowerSgd(Allocator& allocator, const ParamLayout& layout, int rank, uint64_t seed)
      : allocator_(allocator), layout_(layout) {
    LOOM_CHECK(rank >= 1, "parallel.powersgd_rank must be >= 1, got ", rank);
    residual_ = Tensor::zeros(allocator, {layout.total}, DTYPE_F32, MEM_OPTIMIZER_STATE);
    for (size_t k = 0; k < layout.params.size(); ++k) {
      const ParamSpec& p = layout.params[k];
      if (p.shape.size() != 2) continue;
      const int64_t cols = p.numel / p.shape[0], r = std::min<int64_t>(rank, std::min(p.shape[0], cols));
      std::vector<float> q(static_cast<size_t>(cols * r));
      philox_fill_normal(q.data(), cols * r, seed, static_cast<uint32_t>(k), 0, 0.0f, 1.0f);
      q_.emplace(p.offset, std::move(q));
    }
  }

  void reduce(Communicator& comm, const Tensor& bucket, int64_t offset) override {
    const int64_t n = bucket.numel();
    float* g = bucket.data<float>();
    for (const ParamSpec& p : layout_.params) {
      if (p.offset < offset || p.offset + p.numel > offset + n) continue;
      float* m = g + (p.offset - offset);
      auto it = q_.find(p.offset);
      if (it == q_.end()) {  // a vector: plain all-reduce
        comm.all_reduce(bucket.view(p.offset - offset, {p.numel}));
        continue;
      }
      const int64_t rows = p.shape[0], cols = p.numel / rows;
      std::vector<float>& q = it->second;
      const int64_t r = static_cast<int64_t>(q.size()) / cols;
      float* e = residual_.data<float>() + p.offset;
      for (int64_t i = 0; i < p.numel; ++i) e[i] += m[i];  // M = gradient + residual
      Tensor pt = Tensor::zeros(allocator_, {rows * r}, DTYPE_F32, MEM_WORKSPACE);
      float* P = pt.data<float>();
      for (int64_t i = 0; i < rows; ++i) {  // P = M Q
        for (int64_t j = 0; j < r; ++j) {
          double acc = 0.0;
          for (int64_t c = 0; c < cols; ++c) acc += static_cast<double>(e[i * cols + c]) * q[static_cast<size_t>(c * r + j)];
          P[i * r + j] = static_cast<float>(acc);
        }
      }
      comm.all_reduce(pt);
      {  // orthonormalize P's columns: modified Gram-Schmidt in double, twice ("twice is enough")
        std::vector<double> d(P, P + rows * r);
        for (int pass = 0; pass < 2; ++pass) {
          for (int64_t j = 0; j < r; ++j) {
            for (int64_t k = 0; k < j; ++k) {
              double dot = 0.0;
              for (int64_t i = 0; i < rows; ++i) dot += d[static_cast<size_t>(i * r + j)] * d[static_cast<size_t>(i * r + k)];
              for (int64_t i = 0; i < rows; ++i) d[static_cast<size_t>(i * r + j)] -= dot * d[static_cast<size_t>(i * r + k)];
            }
            double norm = 0.0;
            for (int64_t i = 0; i < rows; ++i) norm += d[static_cast<size_t>(i * r + j)] * d[static_cast<size_t>(i * r + j)];
            const double inv = norm > 1e-30 ? 1.0 / std::sqrt(norm) : 0.0;
            for (int64_t i = 0; i < rows; ++i) d[static_cast<size_t>(i * r + j)] *= inv;
          }
        }
        for (int64_t i = 0; i < rows * r; ++i) P[i] = static_cast<float>(d[static_cast<size_t>(i)]);
      }
      Tensor qt = Tensor::zeros(allocator_, {cols * r}, DTYPE_F32, MEM_WORKSPACE);
      float* Q = qt.data<float>();
      for (int64_t c = 0; c < cols; ++c) {  // Q = M^T P (own M), residual = M - P P^T M
        for (int64_t j = 0; j < r; ++j) {
          double acc = 0.0;
          for (int64_t i = 0; i < rows; ++i) acc += static_cast<double>(e[i * cols + c]) * P[i * r + j];
          Q[c * r + j] = static_cast<float>(acc);
        }
      }
      const std::vector<float> own = times_transpose(P, Q, rows, cols, r);  // P P^T M (own M)
      for (int64_t i = 0; i < p.numel; ++i) e[i] -= own[static_cast<size_t>(i)];
      comm.all_reduce(qt);  // sum over ranks of M_i^T P
      std::copy_n(Q, cols * r, q.data());  // warm start for the next step
      const std::vector<float> sum = times_transpose(P, Q, rows, cols, r);  // P P^T (sum of M)
      std::copy(sum.begin(), sum.end(), m);
    }
  }
  const Tensor& residual() const override { return residual_; }

 private:
  Allocator& allocator_;
  const ParamLayout& layout_;
  Tensor residual_;
  std::map<int64_t, std::vector<float>> q_;  // by parameter offset
};

}  // namespace

std::unique_ptr<GradCompressor> make_powersgd_compressor(Allocator& allocator, const ParamLayout& layout, int rank,
                                                         uint64_t seed) {
  return std::make_unique<PowerSgd>(allocator, layout, rank, seed);
}

std::unique_ptr<GradCompressor> make_qsgd_compressor(Allocator& allocator, int64_t total, int levels, uint64_t seed) {
  (void)total;
  return std::make_unique<Qsgd>(allocator, levels, seed);
}

std::unique_ptr<GradCompressor> make_onebit_compressor(Allocator& allocator, int64_t total) {
  return std::make_unique<OneBit>(allocator, total);
}

std::unique_ptr<GradCompressor> make_dgc_compressor(Allocator& allocator, int64_t total, const DgcOptions& options) {
  return std::make_unique<Dgc>(allocator, total, options);
}

std::unique_ptr<GradCompressor> make_topk_compressor(Allocator& allocator, int64_t total, double ratio) {
  return std::make_unique<TopK>(allocator, total, ratio);
}

}  // namespace loom
