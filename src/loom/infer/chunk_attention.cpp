#include "loom/infer/chunk_attention.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"

namespace loom {

ChunkAttention::ChunkAttention(const ModelConfig& config)
    : c_(config), hd_(config.head_dim()), group_(config.n_head / config.n_kv_head), cpu_(make_cpu_backend()) {}

Tensor ChunkAttention::grow(Tensor& t, int64_t numel) {
  if (!t.defined() || t.numel() < numel) t = Tensor::empty(cpu_->allocator(), {numel}, DTYPE_F32, MEM_WORKSPACE);
  return t;
}

void ChunkAttention::run(int64_t first, int64_t n, int64_t lo, const HeadRows& keys, const HeadRows& values,
                         const float* q, int64_t q_stride, float* out, int64_t out_stride) {
  const int64_t W = c_.attn_window, P = first + n - lo, M = group_ * n;
  LOOM_CHECK(n >= 1 && lo >= 0 && lo <= first && (W <= 0 || lo <= std::max<int64_t>(0, first + 1 - W)),
             "chunk attention: rows ", first, " .. ", first + n - 1, " over positions from ", lo);
  const Tensor qg = grow(q_, M * hd_).view(0, {M, hd_}), s = grow(s_, M * P).view(0, {M, P});
  const Tensor o = grow(o_, M * hd_).view(0, {M, hd_});
  GemmSpec scores;
  scores.trans_b = true, scores.alpha = 1.0f / std::sqrt(static_cast<float>(hd_));
  for (int64_t g = 0; g < c_.n_kv_head; ++g) {
    for (int64_t j = 0; j < group_; ++j) {  // query head g * group + j: rows j * n + r
      for (int64_t r = 0; r < n; ++r) {
        const float* src = q + r * q_stride + (g * group_ + j) * hd_;
        std::copy(src, src + hd_, qg.data<float>() + (j * n + r) * hd_);
      }
    }
    const Tensor k = keys(g), v = values(g);
    LOOM_CHECK(k.numel() == P * hd_ && v.numel() == P * hd_, "chunk attention: kv head ", g, " rows ", k.describe(),
               " for ", P, " positions");
    cpu_->gemm(qg, k, s, scores);
    float* S = s.data<float>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < M; ++i) {  // row i: position p = first + i % n sees [max(lo, p + 1 - W), p]
      const int64_t p = first + i % n, from = (W > 0 ? std::max<int64_t>(0, p + 1 - W) : 0) - lo, to = p - lo;
      float* row = S + i * P;
      float m = row[from];
      for (int64_t t = from + 1; t <= to; ++t) m = std::max(m, row[t]);
      float sum = 0.0f;
      for (int64_t t = from; t <= to; ++t) sum += (row[t] = std::exp(row[t] - m));
      const float inv = 1.0f / sum;
      for (int64_t t = 0; t < P; ++t) row[t] = t >= from && t <= to ? row[t] * inv : 0.0f;
    }
    cpu_->gemm(s, v, o, GemmSpec{});
    for (int64_t j = 0; j < group_; ++j) {
      for (int64_t r = 0; r < n; ++r) {
        const float* src = o.data<float>() + (j * n + r) * hd_;
        std::copy(src, src + hd_, out + r * out_stride + (g * group_ + j) * hd_);
      }
    }
  }
}

void ChunkAttention::set_interleaved(const float* k, const float* v, int64_t P) {
  const int64_t G = c_.n_kv_head, width = G * hd_;
  float* K = grow(k_, G * P * hd_).data<float>();
  float* V = grow(v_, G * P * hd_).data<float>();
  for (int64_t t = 0; t < P; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      std::copy(k + t * width + g * hd_, k + t * width + (g + 1) * hd_, K + (g * P + t) * hd_);
      std::copy(v + t * width + g * hd_, v + t * width + (g + 1) * hd_, V + (g * P + t) * hd_);
    }
  }
  interleaved_ = P;
}

ChunkAttention::HeadRows ChunkAttention::keys_by_head() const {
  return [this](int64_t g) { return k_.view(g * interleaved_ * hd_, {interleaved_, hd_}); };
}

ChunkAttention::HeadRows ChunkAttention::values_by_head() const {
  return [this](int64_t g) { return v_.view(g * interleaved_ * hd_, {interleaved_, hd_}); };
}

}  // namespace loom
