#include "loom/nn/vocab_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "loom/core/error.h"

namespace loom {

namespace {
int64_t rows_of(const Tensor& t) { return t.numel() / t.dim(-1); }
}  // namespace

void vocab_parallel_embedding_forward(const Tensor& tokens, const Tensor& weight, int64_t begin, int64_t valid,
                                      const Tensor& out) {
  const int64_t n = tokens.numel(), C = weight.dim(1);
  LOOM_CHECK(out.numel() == n * C && valid <= weight.dim(0), "vocab-parallel embedding: out ", out.describe(),
             " and table ", weight.describe(), " do not fit ", n, " tokens");
  const int32_t* tok = tokens.data<int32_t>();
  const float* w = weight.data<float>();
  float* o = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = tok[i] - begin;
    if (row >= 0 && row < valid) std::memcpy(o + i * C, w + row * C, static_cast<size_t>(C) * sizeof(float));
    else std::memset(o + i * C, 0, static_cast<size_t>(C) * sizeof(float));
  }
}

void vocab_parallel_embedding_backward(const Tensor& tokens, const Tensor& d_out, const Tensor& d_weight,
                                       int64_t begin, int64_t valid) {
  const int64_t n = tokens.numel(), C = d_weight.dim(1);
  const int32_t* tok = tokens.data<int32_t>();
  const float* d = d_out.data<float>();
  float* dw = d_weight.data<float>();
  for (int64_t i = 0; i < n; ++i) {  // serial: tokens repeat, rows would race
    const int64_t row = tok[i] - begin;
    if (row < 0 || row >= valid) continue;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) dw[row * C + c] += d[i * C + c];
  }
}

void add_positions(const Tensor& out, const Tensor& positions, int64_t first) {
  const int64_t B = out.dim(0), T = out.dim(1), C = out.dim(2);
  const float* p = positions.data<float>() + first * C;
  float* o = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < B * T; ++i) {
    const int64_t t = i % T;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[i * C + c] += p[t * C + c];
  }
}

void positions_backward(const Tensor& d_out, const Tensor& d_positions, int64_t first) {
  const int64_t B = d_out.dim(0), T = d_out.dim(1), C = d_out.dim(2);
  const float* d = d_out.data<float>();
  float* dp = d_positions.data<float>() + first * C;
  for (int64_t b = 0; b < B; ++b) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dp[t * C + c] += d[(b * T + t) * C + c];
    }
  }
}

void vocab_parallel_cross_entropy_forward(Communicator& tp, const Tensor& logits, const Tensor& targets, int64_t begin,
                                          int64_t valid, const Tensor& losses, const Tensor& lse, const Tensor& sums) {
  const int64_t n = rows_of(logits), V = logits.dim(-1);
  LOOM_CHECK(targets.numel() == n && losses.numel() == n && lse.numel() == n && sums.numel() == n && valid <= V,
             "vocab-parallel cross-entropy: logits ", logits.describe(), ", targets ", targets.describe(),
             " and losses do not match");
  const float* x = logits.data<float>();
  const int32_t* tgt = targets.data<int32_t>();
  float* m = lse.data<float>();     // the row max, then lse
  float* t = losses.data<float>();  // the target's logit, then the loss
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    float mx = -INFINITY;
    for (int64_t v = 0; v < valid; ++v) mx = std::max(mx, x[r * V + v]);
    m[r] = mx;
    const int64_t col = tgt[r] - begin;
    t[r] = col >= 0 && col < valid ? x[r * V + col] : 0.0f;
  }
  tp.all_reduce(lse, REDUCE_MAX);
  tp.all_reduce(losses, REDUCE_SUM);  // exactly one rank holds each target
  float* sum = sums.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    float s = 0.0f;
    for (int64_t v = 0; v < valid; ++v) s += std::exp(x[r * V + v] - m[r]);
    sum[r] = s;
  }
  tp.all_reduce(sums, REDUCE_SUM);
  for (int64_t r = 0; r < n; ++r) {
    m[r] = m[r] + std::log(sum[r]);
    t[r] = m[r] - t[r];
  }
}

void vocab_parallel_cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t begin,
                                           int64_t valid, float scale, const Tensor& d_logits) {
  const int64_t n = rows_of(logits), V = logits.dim(-1);
  const float* x = logits.data<float>();
  const int32_t* tgt = targets.data<int32_t>();
  const float* l = lse.data<float>();
  float* d = d_logits.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t v = 0; v < V; ++v) d[r * V + v] = v < valid ? scale * std::exp(x[r * V + v] - l[r]) : 0.0f;
    const int64_t col = tgt[r] - begin;
    if (col >= 0 && col < valid) d[r * V + col] -= scale;
  }
}

}  // namespace loom
