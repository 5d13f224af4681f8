// CPU kernels of the model-parallel ops (contracts in backend.h; the layouts and formulas in
// nn/vocab_parallel.h and nn/context_parallel.h). Row loops run under a static schedule and each
// row's sums run in index order, so the results are the same bits for any thread count.
#include "loom/backend/cpu/cpu_parallel_ops.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "loom/backend/checks.h"
#include "loom/backend/parallel_checks.h"
#include "loom/core/error.h"
#include "loom/core/targets.h"

namespace loom::cpu {

using checks::dispatch_float;

namespace {

constexpr const char* kBackend = "CPU";

// The dimensions of one ring attention call on a local shard (the zig-zag layout of
// nn/context_parallel.h: local query t < C is at global position rank C + t, the others at
// (2 world - 1 - rank) C + t - C).
struct RingDims {
  int64_t B = 0, Tl = 0, H = 0, KV = 0, hd = 0;
  int N = 1, r = 0;
  int64_t C() const { return Tl / 2; }
  int64_t QW() const { return H * hd; }
  int64_t KW() const { return KV * hd; }
  int64_t pos(int64_t t) const {
    return t < C() ? r * C() + t : (2 * static_cast<int64_t>(N) - 1 - r) * C() + (t - C());
  }
};

// The kernels' RingDims of a ring op's checked dimensions and its rank / world.
RingDims ring_dims(const checks::RingOpDims& c, int rank, int world) {
  return {c.B, c.Tl, c.H, c.KV, c.hd, world, rank};
}

// How many of the C keys at global positions [start, start + C) a query at position pq sees.
inline int64_t visible_keys(int64_t pq, int64_t start, int64_t C) { return std::clamp<int64_t>(pq - start + 1, 0, C); }

template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
inline void axpy(T alpha, const T* x, T* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// The merge of one block (Backend::ring_attention_merge); one query's scores in s (2C per thread).
template <typename T>
void ring_merge_block(const RingDims& d, int owner, const T* q, const T* kblk, const T* vblk, T* acc, T* m, T* l,
                      T* scratch) {
  const int64_t C = d.C(), group = d.H / d.KV, QW = d.QW(), KW = d.KW(), hd = d.hd;
  const int64_t kstart[2] = {owner * C, (2 * d.N - 1 - owner) * C};  // global start of the block's two chunks
  const T scale = T(1) / std::sqrt(static_cast<T>(hd));
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t h = 0; h < d.H; ++h) {
      for (int64_t i = 0; i < d.Tl; ++i) {
        const int64_t cnt[2] = {visible_keys(d.pos(i), kstart[0], C), visible_keys(d.pos(i), kstart[1], C)};
        if (cnt[0] + cnt[1] == 0) continue;
        T* s = scratch + omp_get_thread_num() * 2 * C;
        const int64_t g = h / group;
        const T* qi = q + (b * d.Tl + i) * QW + h * hd;
        T block_max = -std::numeric_limits<T>::infinity();
        for (int c = 0; c < 2; ++c) {
          for (int64_t j = c * C; j < c * C + cnt[c]; ++j) {
            s[j] = scale * dot(qi, kblk + (b * d.Tl + j) * KW + g * hd, hd);
            block_max = std::max(block_max, s[j]);
          }
        }
        const int64_t st = (b * d.H + h) * d.Tl + i;
        const T m_new = std::max(m[st], block_max);
        const T alpha = std::exp(m[st] - m_new);  // 0 while m is -inf
        T* oi = acc + (b * d.Tl + i) * QW + h * hd;
        for (int64_t e = 0; e < hd; ++e) oi[e] *= alpha;
        T sum = l[st] * alpha;
        for (int c = 0; c < 2; ++c) {
          for (int64_t j = c * C; j < c * C + cnt[c]; ++j) {
            const T p = std::exp(s[j] - m_new);
            sum += p;
            axpy(p, vblk + (b * d.Tl + j) * KW + g * hd, oi, hd);
          }
        }
        l[st] = sum;
        m[st] = m_new;
      }
    }
  }
}

// One task per (b, kv head g): it owns dK/dV of g and dQ of g's query heads, so no two threads
// write the same element.
template <typename T>
void ring_backward_block(const RingDims& d, int owner, const T* q, const T* dout, const T* lse, const T* D,
                         const T* kblk, const T* vblk, T* dq, T* dkblk, T* dvblk) {
  const int64_t C = d.C(), group = d.H / d.KV, QW = d.QW(), KW = d.KW(), hd = d.hd;
  const int64_t kstart[2] = {owner * C, (2 * d.N - 1 - owner) * C};
  const T scale = T(1) / std::sqrt(static_cast<T>(hd));
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t g = 0; g < d.KV; ++g) {
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t i = 0; i < d.Tl; ++i) {
          const int64_t cnt[2] = {visible_keys(d.pos(i), kstart[0], C), visible_keys(d.pos(i), kstart[1], C)};
          const int64_t st = (b * d.H + h) * d.Tl + i;
          const T* qi = q + (b * d.Tl + i) * QW + h * hd;
          const T* doi = dout + (b * d.Tl + i) * QW + h * hd;
          T* dqi = dq + (b * d.Tl + i) * QW + h * hd;
          for (int c = 0; c < 2; ++c) {
            for (int64_t j = c * C; j < c * C + cnt[c]; ++j) {
              const int64_t kv_off = (b * d.Tl + j) * KW + g * hd;
              const T p = std::exp(scale * dot(qi, kblk + kv_off, hd) - lse[st]);
              axpy(p, doi, dvblk + kv_off, hd);
              const T ds = p * (dot(doi, vblk + kv_off, hd) - D[st]);
              axpy(scale * ds, kblk + kv_off, dqi, hd);
              axpy(scale * ds, qi, dkblk + kv_off, hd);
            }
          }
        }
      }
    }
  }
}

}  // namespace

// ---- The vocabulary-parallel ends --------------------------------------------------------------

void vocab_embedding_forward(const Tensor& tokens, const Tensor& weight, int64_t begin, int64_t valid,
                             const Tensor& out) {
  const checks::VocabTokenDims dims = checks::check_vocab_embedding_forward(tokens, weight, valid, out);
  const int64_t n = dims.n, C = dims.C;
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

void vocab_embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dweight, int64_t begin,
                              int64_t valid) {
  const checks::VocabTokenDims dims = checks::check_vocab_embedding_backward(tokens, dout, dweight, valid);
  const int64_t n = dims.n, C = dims.C;
  const int32_t* tok = tokens.data<int32_t>();
  const float* d = dout.data<float>();
  float* dw = dweight.data<float>();
  for (int64_t i = 0; i < n; ++i) {  // serial: tokens repeat, rows would race
    const int64_t row = tok[i] - begin;
    if (row < 0 || row >= valid) continue;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) dw[row * C + c] += d[i * C + c];
  }
}

void add_positions(const Tensor& out, const Tensor& positions, int64_t first) {
  const checks::Dims3 dims = checks::check_position_rows("add_positions", out, positions, first);
  const int64_t B = dims.a, T = dims.b, C = dims.c;
  const float* p = positions.data<float>() + first * C;
  float* o = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < B * T; ++i) {
    const int64_t t = i % T;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[i * C + c] += p[t * C + c];
  }
}

void positions_backward(const Tensor& dout, const Tensor& dpositions, int64_t first) {
  const checks::Dims3 dims = checks::check_position_rows("positions_backward", dout, dpositions, first);
  const int64_t B = dims.a, T = dims.b, C = dims.c;
  const float* d = dout.data<float>();
  float* dp = dpositions.data<float>() + first * C;
  for (int64_t b = 0; b < B; ++b) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dp[t * C + c] += d[(b * T + t) * C + c];
    }
  }
}

void vocab_ce_partials(const Tensor& logits, const Tensor& targets, int64_t begin, int64_t valid, const Tensor& max,
                       const Tensor& target) {
  const int64_t n = checks::check_vocab_ce_partials(logits, targets, valid, max, target);
  const int64_t V = logits.dim(-1);
  const float* x = logits.data<float>();
  const int32_t* tgt = targets.data<int32_t>();
  float* m = max.data<float>();
  float* t = target.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    float mx = -INFINITY;
    for (int64_t v = 0; v < valid; ++v) mx = std::max(mx, x[r * V + v]);
    m[r] = mx;
    const int64_t col = tgt[r] - begin;
    t[r] = col >= 0 && col < valid ? x[r * V + col] : 0.0f;
  }
}

void vocab_ce_sums(const Tensor& logits, const Tensor& max, int64_t valid, const Tensor& sums) {
  const int64_t n = checks::check_vocab_ce_sums(logits, max, valid, sums);
  const int64_t V = logits.dim(-1);
  const float* x = logits.data<float>();
  const float* m = max.data<float>();
  float* sum = sums.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    float s = 0.0f;
    for (int64_t v = 0; v < valid; ++v) s += std::exp(x[r * V + v] - m[r]);
    sum[r] = s;
  }
}

void vocab_ce_finish(const Tensor& targets, const Tensor& lse, const Tensor& sums, const Tensor& losses) {
  const int64_t n = checks::check_vocab_ce_finish(targets, lse, sums, losses);
  const int32_t* tgt = targets.data<int32_t>();
  float* m = lse.data<float>();
  const float* sum = sums.data<float>();
  float* t = losses.data<float>();
  for (int64_t r = 0; r < n; ++r) {
    m[r] = m[r] + std::log(sum[r]);
    t[r] = tgt[r] == kIgnoreTarget ? 0.0f : m[r] - t[r];  // a loss mask: the row counts nothing
  }
}

void vocab_ce_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t begin, int64_t valid,
                       float scale, const Tensor& dlogits) {
  const int64_t n = checks::check_vocab_ce_backward(logits, targets, lse, valid, dlogits);
  const int64_t V = logits.dim(-1);
  const float* x = logits.data<float>();
  const int32_t* tgt = targets.data<int32_t>();
  const float* l = lse.data<float>();
  float* d = dlogits.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    if (tgt[r] == kIgnoreTarget) {  // a loss mask: no gradient
      for (int64_t v = 0; v < V; ++v) d[r * V + v] = 0.0f;
      continue;
    }
    for (int64_t v = 0; v < V; ++v) d[r * V + v] = v < valid ? scale * std::exp(x[r * V + v] - l[r]) : 0.0f;
    const int64_t col = tgt[r] - begin;
    if (col >= 0 && col < valid) d[r * V + col] -= scale;
  }
}

// ---- Ring attention ----------------------------------------------------------------------------

void ring_attention_merge(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& m,
                          const Tensor& l, const Tensor& scratch, const RingBlock& block) {
  const char* op = "ring_attention_merge";
  const RingDims d = ring_dims(checks::check_ring_attention_merge(q, k, v, out, m, l, block), block.rank, block.world);
  LOOM_CHECK(scratch.dtype() == q.dtype() && scratch.numel() >= omp_get_max_threads() * d.Tl, op, ": scratch is ",
             scratch.describe(), ", expected ", omp_get_max_threads() * d.Tl, " elements (threads x Tl)");
  dispatch_float(q.dtype(), op, kBackend, [&]<typename T>() {
    ring_merge_block<T>(d, block.owner, q.data<T>(), k.data<T>(), v.data<T>(), out.data<T>(), m.data<T>(),
                        l.data<T>(), scratch.data<T>());
  });
}

void ring_attention_finish(const Tensor& out, const Tensor& lse, const Tensor& l, int64_t n_head) {
  const char* op = "ring_attention_finish";
  const RingDims d = ring_dims(checks::check_ring_attention_finish(out, lse, l, n_head), 0, 1);
  dispatch_float(out.dtype(), op, kBackend, [&]<typename T>() {
    T* acc = out.data<T>();
    T* m = lse.data<T>();
    const T* lp = l.data<T>();
#pragma omp parallel for collapse(3) schedule(static)
    for (int64_t b = 0; b < d.B; ++b) {
      for (int64_t h = 0; h < d.H; ++h) {
        for (int64_t i = 0; i < d.Tl; ++i) {
          const int64_t st = (b * d.H + h) * d.Tl + i;
          T* oi = acc + (b * d.Tl + i) * d.QW() + h * d.hd;
          const T inv = T(1) / lp[st];
          for (int64_t e = 0; e < d.hd; ++e) oi[e] *= inv;
          m[st] += std::log(lp[st]);
        }
      }
    }
  });
}

void attention_row_dot(const Tensor& dout, const Tensor& out, const Tensor& D, int64_t n_head) {
  const char* op = "attention_row_dot";
  const RingDims d = ring_dims(checks::check_attention_row_dot(dout, out, D, n_head), 0, 1);
  dispatch_float(out.dtype(), op, kBackend, [&]<typename T>() {
    const T* po = out.data<T>();
    const T* pdo = dout.data<T>();
    T* pD = D.data<T>();
#pragma omp parallel for collapse(3) schedule(static)
    for (int64_t b = 0; b < d.B; ++b) {
      for (int64_t h = 0; h < d.H; ++h) {
        for (int64_t i = 0; i < d.Tl; ++i) {
          const int64_t off = (b * d.Tl + i) * d.QW() + h * d.hd;
          pD[(b * d.H + h) * d.Tl + i] = dot(pdo + off, po + off, d.hd);
        }
      }
    }
  });
}

void ring_attention_block_backward(const Tensor& q, const Tensor& dout, const Tensor& lse, const Tensor& D,
                                   const Tensor& k, const Tensor& v, const Tensor& dq, const Tensor& dk,
                                   const Tensor& dv, const RingBlock& block) {
  const char* op = "ring_attention_block_backward";
  const RingDims d = ring_dims(checks::check_ring_attention_block_backward(q, dout, lse, D, k, v, dq, dk, dv, block),
                               block.rank, block.world);
  dispatch_float(q.dtype(), op, kBackend, [&]<typename T>() {
    ring_backward_block<T>(d, block.owner, q.data<T>(), dout.data<T>(), lse.data<T>(), D.data<T>(), k.data<T>(),
                           v.data<T>(), dq.data<T>(), dk.data<T>(), dv.data<T>());
  });
}

// ---- Model-parallel slicing

void copy_block(const Tensor& src, const Tensor& dst, const BlockCopy& b) {
  checks::check_copy_block(src, dst, b);
  if (b.rows == 0 || b.cols == 0) return;
  const int64_t elem = static_cast<int64_t>(dtype_size(src.dtype()));
  const char* s = static_cast<const char*>(src.raw_data()) + (b.src_row * b.src_stride + b.src_col) * elem;
  char* d = static_cast<char*>(dst.raw_data()) + (b.dst_row * b.dst_stride + b.dst_col) * elem;
  const size_t bytes = static_cast<size_t>(b.cols * elem);
#pragma omp parallel for schedule(static) if (b.rows * b.cols > 4096)
  for (int64_t i = 0; i < b.rows; ++i) std::memcpy(d + i * b.dst_stride * elem, s + i * b.src_stride * elem, bytes);
}

}  // namespace loom::cpu
