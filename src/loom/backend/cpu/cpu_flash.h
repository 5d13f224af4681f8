// FlashAttention-2 on the CPU (Dao 2023, "FlashAttention-2: Faster Attention with Better
// Parallelism and Work Partitioning", arXiv 2307.08691), templated on the float type (float for
// training, double for reference checks). The attention is cpu_kernels.h's attention_forward /
// attention_forward_window (causal, grouped KV heads, optional sliding window W; query head h
// reads kv head g = h / G, G = H / KV, scale = 1/sqrt(hd)), but only lse (B,H,T) is kept:
//
// Forward, per query tile Q_i = rows [i0, i1) (Br of them) of head h, starting from m = -inf,
// l = 0, O = 0 and streaming the key tiles K_j, V_j (Bc keys each) of [lo, i1),
// lo = max(0, i0 - W + 1) (W = 0: lo = 0). Tiles above the diagonal and left of the window are
// never visited; inside a visited tile the entries j > i or j <= i - W are masked (P = 0):
//   S = scale Q_i K_j^T;  m' = max(m, rowmax S);  P = exp(S - m');  l = e^{m - m'} l + rowsum P;
//   O = diag(e^{m - m'}) O + P V_j;  m = m'.
// Then O /= l and lse = m + log l (the natural log-sum-exp of the row's scaled scores).
//
// Backward, D_i = rowsum(dO_i o O_i), and for the same tiles with P recomputed from lse:
//   P = exp(S - lse);  dP = dO_i V_j^T;  dS = scale P o (dP - D_i);
//   dV_j += P^T dO_i;  dK_j += dS^T Q_i;  dQ_i += dS K_j.
// dqkv is overwritten (every element is written: dQ by its first key tile, dK and dV zeroed
// first). Extra memory: lse, O(T), kept; the tiles live in a per-thread scratch of O(Br Bc).
//
// Work partition: the forward runs one task per (batch, head), the backward one per
// (batch, kv head) that walks the group's G query heads in order, so dK_g and dV_g are summed
// over the group inside one task: no two tasks write the same memory, and every sum is taken in
// a fixed order (heads, then query tiles, then key tiles ascending): results are bitwise
// independent of the thread count and the schedule. Tasks are spread over the threads with a
// static schedule; the tile GEMMs (gemm_t) run on the calling thread. That is the opposite of
// attention_forward, whose whole-sequence GEMMs use all threads: oneDNN's sgemm on one tile per
// thread inside the parallel region was measured at 340 GFLOP/s on 2 threads for 128x128x64
// tiles, against 120 for the same tiles run one after another with threads inside each GEMM.
// bench/flash_attention_bench.cpp compares tile sizes and the probabilities kernels.
#pragma once
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "loom/backend/cpu/cpu_gemm.h"
#include "loom/backend/cpu/cpu_math.h"

namespace loom::cpu {

// Query rows (Br) and keys (Bc) per tile. At hd = 64 (the bench) 128 x 128 is as fast as
// 128 x 256 with half the scratch, and faster than 64 x 64 or 256 x 256.
struct FlashTiles {
  int64_t rows = 128, cols = 128;
};

// The window the kernels apply: W >= T is full causal attention, computed exactly as W = 0.
inline int64_t flash_window(int64_t window, int64_t seq_len) { return window >= seq_len ? 0 : window; }

// Query rows per tile: a sliding window W shorter than Br would make a tile compute
// Br x (Br + W - 1) scores for Br x W visible ones, so the rows shrink to max(W, 32) (as
// cpu_kernels.h's window_tile_rows: under 2x the band for W >= 32, GEMMs still large enough).
inline int64_t flash_tile_rows(FlashTiles t, int64_t window) {
  return window > 0 ? std::min(t.rows, std::max<int64_t>(window, 32)) : t.rows;
}

// Scratch elements each thread needs: forward S (Br x Bc), O (Br x hd), m and l (Br);
// backward P (Br x Bc), dS (Br x Bc), D (Br).
inline int64_t flash_forward_scratch(FlashTiles t, int64_t head_dim) {
  return t.rows * t.cols + t.rows * head_dim + 2 * t.rows;
}
inline int64_t flash_backward_scratch(FlashTiles t) { return 2 * t.rows * t.cols + t.rows; }

// The first key query i attends to (its last is i itself).
inline int64_t flash_first_key(int64_t i, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, i - window + 1) : 0;
}

// One row of a score tile with keys [j0, j0 + n): the visible keys [first, last] keep their
// score, the others are masked. Returns the visible range relative to the tile (first > last
// when the row sees none of the tile's keys).
inline void flash_row_range(int64_t i, int64_t j0, int64_t n, int64_t window, int64_t& first, int64_t& last) {
  first = std::max(flash_first_key(i, window), j0) - j0;
  last = std::min(i, j0 + n - 1) - j0;
}

// Online softmax update of one row (Dao 2023, Algorithm 1): s (n) holds the tile's scaled
// scores and leaves with P = exp(s - m') on [first, last], 0 elsewhere; m and l are updated and
// the factor e^{m - m'} that rescales the row's O is returned (1 when the row sees no key).
template <typename T>
T flash_online_row(T* s, int64_t n, int64_t first, int64_t last, T& m, T& l) {
  if (first > last) {
    std::fill(s, s + n, T(0));
    return T(1);
  }
  const T max_s = max_of(s + first, last - first + 1);
  const T m_new = std::max(m, max_s);
  const T alpha = m == -INFINITY ? T(0) : exp_t<T>(m - m_new);
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = first; j <= last; ++j) {
    s[j] = exp_t<T>(s[j] - m_new);
    sum += s[j];
  }
  std::fill(s, s + first, T(0));
  std::fill(s + last + 1, s + n, T(0));
  l = alpha * l + sum;
  m = m_new;
  return alpha;
}

// Forward (see the top of the file). qkv (B,T,(H+2KV)hd), out (B,T,H hd), lse (B,H,T);
// scratch holds threads * flash_forward_scratch(tiles, hd) elements.
template <typename T>
void flash_attention_forward(const T* qkv, T* out, T* lse, T* scratch, int threads, int64_t batch, int64_t seq_len,
                             int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t window,
                             FlashTiles tiles = {}) {
  window = flash_window(window, seq_len);
  const int64_t W = (n_head + 2 * n_kv_head) * head_dim, OW = n_head * head_dim, Tn = seq_len, hd = head_dim;
  const int64_t group = n_head / n_kv_head, Br = flash_tile_rows(tiles, window), Bc = tiles.cols;
  const int64_t per_thread = flash_forward_scratch(tiles, hd);
  const T scale = T(1) / std::sqrt(static_cast<T>(hd));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < batch * n_head; ++task) {
    const int64_t b = task / n_head, h = task % n_head, g = h / group;
    const T* q = qkv + b * Tn * W + h * hd;                            // (T, hd), row stride W
    const T* k = qkv + b * Tn * W + (n_head + g) * hd;                 // (T, hd), row stride W
    const T* v = qkv + b * Tn * W + (n_head + n_kv_head + g) * hd;     // (T, hd), row stride W
    T* o_head = out + b * Tn * OW + h * hd;                            // (T, hd), row stride OW
    T* lse_head = lse + (b * n_head + h) * Tn;                         // (T)
    T* s = scratch + omp_get_thread_num() * per_thread;                // (Br, Bc) scores, then P
    T* o = s + Br * Bc;                                                // (Br, hd) unnormalised O
    T* m = o + Br * hd;                                                // (Br) running max
    T* l = m + Br;                                                     // (Br) running sum
    for (int64_t i0 = 0; i0 < Tn; i0 += Br) {
      const int64_t i1 = std::min(Tn, i0 + Br), r = i1 - i0;
      std::fill(m, m + r, T(-INFINITY));
      std::fill(l, l + r, T(0));
      std::fill(o, o + r * hd, T(0));
      for (int64_t j0 = flash_first_key(i0, window); j0 < i1; j0 += Bc) {
        const int64_t c = std::min(i1, j0 + Bc) - j0;
        gemm_t<T>(false, true, r, c, hd, scale, q + i0 * W, W, k + j0 * W, W, T(0), s, c);
        for (int64_t x = 0; x < r; ++x) {
          int64_t first = 0, last = 0;
          flash_row_range(i0 + x, j0, c, window, first, last);
          const T alpha = flash_online_row(s + x * c, c, first, last, m[x], l[x]);
          T* orow = o + x * hd;
#pragma omp simd
          for (int64_t d = 0; d < hd; ++d) orow[d] *= alpha;
        }
        gemm_t<T>(false, false, r, hd, c, T(1), s, c, v + j0 * W, W, T(1), o, hd);
      }
      for (int64_t x = 0; x < r; ++x) {
        const T inv = T(1) / l[x];
        T* dst = o_head + (i0 + x) * OW;
        const T* orow = o + x * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) dst[d] = orow[d] * inv;
        lse_head[i0 + x] = m[x] + std::log(l[x]);
      }
    }
  }
}

// Backward (see the top of the file). dout, out (B,T,H hd), lse (B,H,T), dqkv (B,T,(H+2KV)hd)
// overwritten; scratch holds threads * flash_backward_scratch(tiles) elements.
template <typename T>
void flash_attention_backward(const T* dout, const T* qkv, const T* out, const T* lse, T* dqkv, T* scratch,
                              int threads, int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                              int64_t head_dim, int64_t window, FlashTiles tiles = {}) {
  window = flash_window(window, seq_len);
  const int64_t W = (n_head + 2 * n_kv_head) * head_dim, OW = n_head * head_dim, Tn = seq_len, hd = head_dim;
  const int64_t group = n_head / n_kv_head, Br = flash_tile_rows(tiles, window), Bc = tiles.cols;
  const int64_t per_thread = flash_backward_scratch(tiles);
  const T scale = T(1) / std::sqrt(static_cast<T>(hd));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < batch * n_kv_head; ++task) {
    const int64_t b = task / n_kv_head, g = task % n_kv_head;
    const T* k = qkv + b * Tn * W + (n_head + g) * hd;                 // (T, hd), row stride W
    const T* v = qkv + b * Tn * W + (n_head + n_kv_head + g) * hd;     // (T, hd), row stride W
    T* dk = dqkv + b * Tn * W + (n_head + g) * hd;                     // (T, hd), row stride W
    T* dv = dqkv + b * Tn * W + (n_head + n_kv_head + g) * hd;         // (T, hd), row stride W
    T* p = scratch + omp_get_thread_num() * per_thread;                // (Br, Bc) S, then P
    T* ds = p + Br * Bc;                                               // (Br, Bc) dP, then dS
    T* D = ds + Br * Bc;                                               // (Br) rowsum(dO o O)
    for (int64_t t = 0; t < Tn; ++t) {
      std::fill(dk + t * W, dk + t * W + hd, T(0));
      std::fill(dv + t * W, dv + t * W + hd, T(0));
    }
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const T* q = qkv + b * Tn * W + h * hd;                          // (T, hd), row stride W
      const T* o = out + b * Tn * OW + h * hd;                         // (T, hd), row stride OW
      const T* dO = dout + b * Tn * OW + h * hd;                       // (T, hd), row stride OW
      const T* lse_head = lse + (b * n_head + h) * Tn;                 // (T)
      T* dq = dqkv + b * Tn * W + h * hd;                              // (T, hd), row stride W
      for (int64_t i0 = 0; i0 < Tn; i0 += Br) {
        const int64_t i1 = std::min(Tn, i0 + Br), r = i1 - i0;
        for (int64_t x = 0; x < r; ++x) {
          T acc = 0;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < hd; ++d) acc += dO[(i0 + x) * OW + d] * o[(i0 + x) * OW + d];
          D[x] = acc;
        }
        const int64_t lo = flash_first_key(i0, window);
        for (int64_t j0 = lo; j0 < i1; j0 += Bc) {
          const int64_t c = std::min(i1, j0 + Bc) - j0;
          gemm_t<T>(false, true, r, c, hd, scale, q + i0 * W, W, k + j0 * W, W, T(0), p, c);
          gemm_t<T>(false, true, r, c, hd, T(1), dO + i0 * OW, OW, v + j0 * W, W, T(0), ds, c);
          for (int64_t x = 0; x < r; ++x) {
            int64_t first = 0, last = 0;
            flash_row_range(i0 + x, j0, c, window, first, last);
            T* prow = p + x * c;
            T* dsrow = ds + x * c;
            const T L = lse_head[i0 + x], Dx = D[x];
#pragma omp simd
            for (int64_t j = first; j <= last; ++j) {
              prow[j] = exp_t<T>(prow[j] - L);
              dsrow[j] = scale * prow[j] * (dsrow[j] - Dx);
            }
            const int64_t lead = std::max<int64_t>(0, std::min(first, c)), tail = std::max(last + 1, lead);
            std::fill(prow, prow + lead, T(0));
            std::fill(dsrow, dsrow + lead, T(0));
            std::fill(prow + tail, prow + c, T(0));
            std::fill(dsrow + tail, dsrow + c, T(0));
          }
          gemm_t<T>(true, false, c, hd, r, T(1), p, c, dO + i0 * OW, OW, T(1), dv + j0 * W, W);
          gemm_t<T>(true, false, c, hd, r, T(1), ds, c, q + i0 * W, W, T(1), dk + j0 * W, W);
          gemm_t<T>(false, false, r, hd, c, T(1), ds, c, k + j0 * W, W, j0 == lo ? T(0) : T(1), dq + i0 * W, W);
        }
      }
    }
  }
}

}  // namespace loom::cpu
