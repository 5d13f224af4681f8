// CPU kernels of the model-parallel ops (contracts in backend.h; the layouts and formulas in
// nn/vocab_parallel.h and nn/context_parallel.h). Row loops run under a static schedule and each
// row's sums run in index order, so the results are the same bits for any thread count.
#include "loom/backend/cpu/cpu_parallel_ops.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <utility>

#include "loom/backend/checks.h"
#include "loom/core/error.h"
#include "loom/core/targets.h"

namespace loom::cpu {

using checks::dispatch_float;
using checks::expect_dtype;
using checks::expect_numel;

namespace {

constexpr const char* kBackend = "CPU";

int64_t rows_of(const Tensor& t) { return t.numel() / t.dim(-1); }

void expect_f32(const Tensor& t, const char* op, const char* what) { expect_dtype(t, DTYPE_F32, op, what); }

using NamedRows = std::initializer_list<std::pair<const char*, const Tensor*>>;

// Each of `rows` is f32 with n elements.
void expect_rows(const char* op, int64_t n, NamedRows rows) {
  for (const auto& [what, t] : rows) {
    expect_f32(*t, op, what);
    expect_numel(*t, n, op, what);
  }
}

// logits (N, Vs) f32 with valid <= Vs, targets (N) i32 when given, and the f32 rows (N) by name: returns N.
int64_t check_ce_rows(const char* op, const Tensor& logits, const Tensor* targets, int64_t valid, NamedRows rows) {
  expect_f32(logits, op, "logits");
  const int64_t n = rows_of(logits), V = logits.dim(-1);
  LOOM_CHECK(valid <= V, op, ": valid ", valid, " exceeds the ", V, " columns of ", logits.describe());
  if (targets != nullptr) {
    expect_dtype(*targets, DTYPE_I32, op, "targets");
    expect_numel(*targets, n, op, "targets");
  }
  expect_rows(op, n, rows);
  return n;
}

// (B, T, C) activations: 3 dims, f32.
void expect_activations(const Tensor& t, const char* op, const char* what) {
  expect_f32(t, op, what);
  LOOM_CHECK(t.ndim() == 3, op, ": ", what, " is ", t.describe(), ", expected (B, T, C)");
}

// Rows first .. first + T - 1 of positions (Tmax, C) against activations (B, T, C).
void check_position_rows(const char* op, const Tensor& act, const Tensor& positions, int64_t first) {
  expect_activations(act, op, "activations");
  expect_f32(positions, op, "positions");
  LOOM_CHECK(positions.ndim() == 2 && positions.dim(1) == act.dim(2) && first >= 0 &&
                 first + act.dim(1) <= positions.dim(0),
             op, ": positions ", positions.describe(), " has no rows ", first, " .. ", first + act.dim(1) - 1,
             " of width ", act.dim(2));
}

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

// q (B, Tl, H hd) and the per-row stats (B, H, Tl) of a ring op; k, v (B, Tl, KV hd) when given.
RingDims ring_dims(const char* op, const Tensor& q, int64_t n_head, int64_t n_kv_head, int rank, int world) {
  LOOM_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0, op, ": n_head ", n_head,
             " must be a positive multiple of n_kv_head ", n_kv_head);
  LOOM_CHECK(q.ndim() == 3 && q.dim(2) % n_head == 0 && q.dim(1) % 2 == 0, op, ": q is ", q.describe(),
             ", expected (B, Tl, n_head * head_dim) with n_head ", n_head, " and an even Tl");
  LOOM_CHECK(world >= 1 && rank >= 0 && rank < world, op, ": rank ", rank, " outside [0, ", world, ")");
  return {q.dim(0), q.dim(1), n_head, n_kv_head, q.dim(2) / n_head, world, rank};
}

void expect_like(const char* op, const char* what, const Tensor& t, const Tensor& like, const Shape& shape) {
  LOOM_CHECK(t.shape() == shape && t.dtype() == like.dtype(), op, ": ", what, " is ", t.describe(), ", expected ",
             dtype_name(like.dtype()), shape_str(shape));
}

void expect_block(const char* op, const RingDims& d, const Tensor& q, const Tensor& k, const Tensor& v,
                  const RingBlock& block) {
  LOOM_CHECK(block.owner >= 0 && block.owner < d.N, op, ": owner ", block.owner, " outside [0, ", d.N, ")");
  expect_like(op, "k", k, q, {d.B, d.Tl, d.KW()});
  expect_like(op, "v", v, q, {d.B, d.Tl, d.KW()});
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
  const char* op = "vocab_embedding_forward";
  expect_dtype(tokens, DTYPE_I32, op, "tokens");
  expect_f32(weight, op, "weight");
  expect_f32(out, op, "out");
  const int64_t n = tokens.numel(), C = weight.dim(1);
  LOOM_CHECK(weight.ndim() == 2 && out.numel() == n * C && valid <= weight.dim(0), "vocab-parallel embedding: out ",
             out.describe(), " and table ", weight.describe(), " do not fit ", n, " tokens");
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
  const char* op = "vocab_embedding_backward";
  expect_dtype(tokens, DTYPE_I32, op, "tokens");
  expect_f32(dout, op, "dout");
  expect_f32(dweight, op, "dweight");
  const int64_t n = tokens.numel(), C = dweight.dim(1);
  LOOM_CHECK(dweight.ndim() == 2 && dout.numel() == n * C && valid <= dweight.dim(0), op, ": dout ",
             dout.describe(), " and dweight ", dweight.describe(), " do not fit ", n, " tokens");
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
  check_position_rows("add_positions", out, positions, first);
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

void positions_backward(const Tensor& dout, const Tensor& dpositions, int64_t first) {
  check_position_rows("positions_backward", dout, dpositions, first);
  const int64_t B = dout.dim(0), T = dout.dim(1), C = dout.dim(2);
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
  const int64_t n = check_ce_rows("vocab_ce_partials", logits, &targets, valid, {{"max", &max}, {"target", &target}});
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
  const int64_t n = check_ce_rows("vocab_ce_sums", logits, nullptr, valid, {{"max", &max}, {"sums", &sums}});
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
  const int64_t n = lse.numel();
  expect_rows("vocab_ce_finish", n, {{"lse", &lse}, {"sums", &sums}, {"losses", &losses}});
  expect_dtype(targets, DTYPE_I32, "vocab_ce_finish", "targets");
  expect_numel(targets, n, "vocab_ce_finish", "targets");
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
  const char* op = "vocab_ce_backward";
  const int64_t n = check_ce_rows(op, logits, &targets, valid, {{"lse", &lse}});
  const int64_t V = logits.dim(-1);
  expect_f32(dlogits, op, "dlogits");
  expect_numel(dlogits, logits.numel(), op, "dlogits");
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
  const RingDims d = ring_dims(op, q, block.n_head, block.n_kv_head, block.rank, block.world);
  expect_block(op, d, q, k, v, block);
  expect_like(op, "out", out, q, q.shape());
  expect_like(op, "m", m, q, {d.B, d.H, d.Tl});
  expect_like(op, "l", l, q, {d.B, d.H, d.Tl});
  LOOM_CHECK(scratch.dtype() == q.dtype() && scratch.numel() >= omp_get_max_threads() * d.Tl, op, ": scratch is ",
             scratch.describe(), ", expected ", omp_get_max_threads() * d.Tl, " elements (threads x Tl)");
  dispatch_float(q.dtype(), op, kBackend, [&]<typename T>() {
    ring_merge_block<T>(d, block.owner, q.data<T>(), k.data<T>(), v.data<T>(), out.data<T>(), m.data<T>(),
                        l.data<T>(), scratch.data<T>());
  });
}

void ring_attention_finish(const Tensor& out, const Tensor& lse, const Tensor& l, int64_t n_head) {
  const char* op = "ring_attention_finish";
  const RingDims d = ring_dims(op, out, n_head, 1, 0, 1);
  expect_like(op, "lse", lse, out, {d.B, d.H, d.Tl});
  expect_like(op, "l", l, out, {d.B, d.H, d.Tl});
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
  const RingDims d = ring_dims(op, out, n_head, 1, 0, 1);
  expect_like(op, "dout", dout, out, out.shape());
  expect_like(op, "D", D, out, {d.B, d.H, d.Tl});
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
  const RingDims d = ring_dims(op, q, block.n_head, block.n_kv_head, block.rank, block.world);
  expect_block(op, d, q, k, v, block);
  expect_like(op, "dout", dout, q, q.shape());
  expect_like(op, "dq", dq, q, q.shape());
  expect_like(op, "lse", lse, q, {d.B, d.H, d.Tl});
  expect_like(op, "D", D, q, {d.B, d.H, d.Tl});
  expect_like(op, "dk", dk, q, k.shape());
  expect_like(op, "dv", dv, q, k.shape());
  dispatch_float(q.dtype(), op, kBackend, [&]<typename T>() {
    ring_backward_block<T>(d, block.owner, q.data<T>(), dout.data<T>(), lse.data<T>(), D.data<T>(), k.data<T>(),
                           v.data<T>(), dq.data<T>(), dk.data<T>(), dv.data<T>());
  });
}

// ---- Model-parallel slicing

namespace {
// The block's extent on one side fits in t: the last row ends within its numel.
void check_block_side(const char* what, const Tensor& t, int64_t row, int64_t col, int64_t stride,
                      const BlockCopy& b) {
  LOOM_CHECK(t.defined(), "copy_block: ", what, " is undefined");
  LOOM_CHECK(row >= 0 && col >= 0 && col + b.cols <= stride &&
                 (b.rows == 0 || (row + b.rows - 1) * stride + col + b.cols <= t.numel()),
             "copy_block: ", b.rows, " x ", b.cols, " block at (", row, ", ", col, ") with row stride ", stride,
             " is outside ", what, " ", t.describe());
}
}  // namespace

void copy_block(const Tensor& src, const Tensor& dst, const BlockCopy& b) {
  LOOM_CHECK(src.defined() && dst.defined() && src.dtype() == dst.dtype(), "copy_block: src ",
             src.defined() ? src.describe() : "undefined", " and dst ", dst.defined() ? dst.describe() : "undefined",
             " must share a dtype");
  LOOM_CHECK(b.rows >= 0 && b.cols >= 0, "copy_block: negative block ", b.rows, " x ", b.cols);
  check_block_side("src", src, b.src_row, b.src_col, b.src_stride, b);
  check_block_side("dst", dst, b.dst_row, b.dst_col, b.dst_stride, b);
  if (b.rows == 0 || b.cols == 0) return;
  const int64_t elem = static_cast<int64_t>(dtype_size(src.dtype()));
  const char* s = static_cast<const char*>(src.raw_data()) + (b.src_row * b.src_stride + b.src_col) * elem;
  char* d = static_cast<char*>(dst.raw_data()) + (b.dst_row * b.dst_stride + b.dst_col) * elem;
  const size_t bytes = static_cast<size_t>(b.cols * elem);
#pragma omp parallel for schedule(static) if (b.rows * b.cols > 4096)
  for (int64_t i = 0; i < b.rows; ++i) std::memcpy(d + i * b.dst_stride * elem, s + i * b.src_stride * elem, bytes);
}

}  // namespace loom::cpu
