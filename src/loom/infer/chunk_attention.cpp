#include "loom/infer/chunk_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "loom/core/error.h"

namespace loom {

ChunkAttention::ChunkAttention(const ModelConfig& config)
    : c_(config), hd_(config.head_dim()), group_(config.n_head / config.n_kv_head), cpu_(make_cpu_backend()) {}

Tensor ChunkAttention::grow(Tensor& t, int64_t numel) {
  if (!t.defined() || t.numel() < numel) t = Tensor::empty(cpu_->allocator(), {numel}, DTYPE_F32, MEM_WORKSPACE);
  return t;
}

int64_t ChunkAttention::workspace_bytes(const ModelConfig& c, int64_t rows) {
  const int64_t hd = c.head_dim(), group = c.n_head / c.n_kv_head, tile = c.n_kv_head * kTile * hd;
  return 4 * (2 * c.n_head * rows * hd      // queries, outputs
              + group * rows * kTile        // a kv head's scores over a tile
              + 4 * tile                    // interleaved's slab and the per-head tile, keys and values
              + 2 * c.n_head * rows);       // running max and sum
}

void ChunkAttention::run(int64_t first, int64_t n, int64_t lo, int64_t window, const KvTile& tile, const float* q,
                         int64_t q_stride, float* out, int64_t out_stride, const float* sinks) {
  const int64_t W = window, P = first + n - lo, M = group_ * n, G = c_.n_kv_head;
  LOOM_CHECK(n >= 1 && lo >= 0 && lo <= first && (W <= 0 || lo <= std::max<int64_t>(0, first + 1 - W)),
             "chunk attention: rows ", first, " .. ", first + n - 1, " over positions from ", lo);
  // Query head h = g * group + j, row r: row (g * group + j) * n + r of q_ and o_, so kv head g's
  // M rows are consecutive.
  float* Q = grow(q_, G * M * hd_).data<float>();
  float* O = grow(o_, G * M * hd_).data<float>();
  for (int64_t h = 0; h < c_.n_head; ++h) {
    for (int64_t r = 0; r < n; ++r) std::copy(q + r * q_stride + h * hd_, q + r * q_stride + (h + 1) * hd_, Q + (h * n + r) * hd_);
  }
  std::fill(O, O + G * M * hd_, 0.0f);
  max_.assign(static_cast<size_t>(G * M), -std::numeric_limits<float>::infinity());
  sum_.assign(static_cast<size_t>(G * M), 0.0f);
  if (sinks != nullptr) {  // head h's rows start from its sink: max s_h, sum exp(s_h - s_h) = 1
    for (int64_t h = 0; h < c_.n_head; ++h) {
      std::fill_n(max_.begin() + h * n, n, sinks[h]);
      std::fill_n(sum_.begin() + h * n, n, 1.0f);
    }
  }
  GemmSpec scores, accumulate;
  scores.trans_b = true, scores.alpha = 1.0f / std::sqrt(static_cast<float>(hd_));
  accumulate.beta = 1.0f;
  for (int64_t begin = 0; begin < P; begin += kTile) {
    const int64_t end = std::min(P, begin + kTile), T = end - begin;
    const Tensor s = grow(s_, M * T).view(0, {M, T});
    for (int64_t g = 0; g < G; ++g) {
      const auto [k, v] = tile(g, begin, end);
      LOOM_CHECK(k.numel() == T * hd_ && v.numel() == T * hd_, "chunk attention: kv head ", g, " tile ", k.describe(),
                 " for positions ", begin, " .. ", end - 1);
      const Tensor qg = q_.view(g * M * hd_, {M, hd_}), og = o_.view(g * M * hd_, {M, hd_});
      cpu_->gemm(qg, k, s, scores);
      float* S = s.data<float>();
      float *mx = max_.data() + g * M, *sm = sum_.data() + g * M, *Og = O + g * M * hd_;
#pragma omp parallel for schedule(static) if (M * T >= kParallelScores)
      for (int64_t i = 0; i < M; ++i) {  // row i: position p = first + i % n sees [max(lo, p + 1 - W), p]
        const int64_t p = first + i % n, from = std::max((W > 0 ? std::max<int64_t>(0, p + 1 - W) : 0) - lo, begin),
                      to = std::min(p - lo, end - 1);
        float* row = S + i * T;
        if (from > to) {  // nothing of this tile is visible to the row
          std::fill(row, row + T, 0.0f);
          continue;
        }
        float m = mx[i];
        for (int64_t t = from; t <= to; ++t) m = std::max(m, row[t - begin]);
        const float rescale = std::exp(mx[i] - m);  // 0 on the row's first visible tile (without a sink)
        float sum = 0.0f;
        for (int64_t t = 0; t < T; ++t) {
          const int64_t at = begin + t;
          row[t] = at >= from && at <= to ? std::exp(row[t] - m) : 0.0f;
          sum += row[t];
        }
        mx[i] = m, sm[i] = sm[i] * rescale + sum;
        for (int64_t d = 0; d < hd_; ++d) Og[i * hd_ + d] *= rescale;
      }
      cpu_->gemm(s, v, og, accumulate);
    }
  }
  for (int64_t h = 0; h < c_.n_head; ++h) {
    for (int64_t r = 0; r < n; ++r) {
      const float inv = 1.0f / sum_[static_cast<size_t>(h * n + r)];
      const float* src = O + (h * n + r) * hd_;
      float* dst = out + r * out_stride + h * hd_;
      for (int64_t d = 0; d < hd_; ++d) dst[d] = src[d] * inv;
    }
  }
}

ChunkAttention::KvTile ChunkAttention::interleaved(ReadRows read) {
  const int64_t G = c_.n_kv_head, width = G * hd_;
  slab_k_.resize(static_cast<size_t>(kTile * width)), slab_v_.resize(static_cast<size_t>(kTile * width));
  grow(tile_k_, G * kTile * hd_), grow(tile_v_, G * kTile * hd_);
  return [this, read = std::move(read), G, width, loaded = int64_t{-1}](int64_t g, int64_t begin, int64_t end) mutable {
    const int64_t T = end - begin;
    if (loaded != begin) {  // the tile's first kv head: read it, and split it by kv head
      read(begin, end, slab_k_.data(), slab_v_.data());
      float *K = tile_k_.data<float>(), *V = tile_v_.data<float>();
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < G; ++h) {
          std::copy_n(slab_k_.data() + t * width + h * hd_, hd_, K + (h * T + t) * hd_);
          std::copy_n(slab_v_.data() + t * width + h * hd_, hd_, V + (h * T + t) * hd_);
        }
      }
      loaded = begin;
    }
    return std::pair{tile_k_.view(g * T * hd_, {T, hd_}), tile_v_.view(g * T * hd_, {T, hd_})};
  };
}

}  // namespace loom
