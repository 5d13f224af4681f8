// CUDA kernels of the factored optimizers (launchers in cuda_optim_factored.h): Adafactor, SM3-II,
// CAME and LDAdam's device steps. Every kernel computes its CPU twin's formula
// (cpu/cpu_optim_factored.cpp, cpu/cpu_optim_ops.cpp) with the same f32 / f64 types and the same
// operation order, so the results are the CPU's bits. Where the CPU sums "in order, in double"
// (the factored row and column means, mean(R), Gram-Schmidt's dots and norms, LDAdam's Q), one
// thread adds the terms sequentially in that order. The RMS sums (whose CPU order is OpenMP's
// reduction, which depends on the thread count) are a fixed tree here: per-block partials, added
// by one block in a fixed order. No floating-point atomics: every run gives the same bits.
// No contraction either: this file is compiled with nvcc's -fmad=false (g++'s and hipcc's
// -ffp-contract=off), its CPU twins with -ffp-contract=off (CMakeLists.txt), so every product is
// rounded on its own on both sides. (Compiled with contraction, as when only the simulator had run
// it, an H200 differed from the CPU in the last bits of Adafactor, SM3, CAME and LDAdam's Adam,
// 2026-12-04: nvcc and GCC fuse different products of b m + (1 - b) v.)
//
// Per element of an m x n segment (N = m n); bytes of device memory moved, FLOPs, launch shape.
// kBlock = 256 threads; "flat": grid-stride, grid min(ceil(N / 256), 256) when it writes RMS
// partials (else min(ceil(N / 256), 8192)); "rows": block b takes rows b, b + grid, ..., its
// threads the columns (coalesced), grid min(m, 256 or 8192).
//   sumsq_partials      partial_b = sum x^2 (double)                     4 B, 2 FLOP; flat
//   row_ema<f>          R_i = b R_i + (1-b) mean_j f(i, j), in j order   4 B (8 for CAME), 3 FLOP;
//                       block (32, 8) per 32 rows: tiles staged in shared memory (coalesced, the
//                       next tile loaded while this one is added), one thread per row adds its row's
//                       tile in order
//   col_ema<f>          C_j = b C_j + (1-b) mean_i f(i, j), in i order   4 B (8 for CAME), 3 FLOP;
//                       one thread per column (coalesced across the warp)
//     f (Adafactor)     (g gs)^2 + eps;  f (CAME) (U - m)^2 + eps2 (double)
//   mean                mean(R) in order, one block (chunks staged in shared memory)   per call: 4 m B
//   factors             rf_i = f32(1 / sqrt(R_i / mean(R))), cf_j = f32(1 / sqrt(C_j))  per call: 8 (m + n) B
//   precondition_matrix U = g gs rf_i cf_j, partial sum U^2              8 B, 5 FLOP; rows
//   precondition_vector V = b V + (1-b)(d^2 + eps), U = d / sqrt(V)       16 B, 8 FLOP; flat
//   adafactor_scalars   rate = lr max(eps2, RMS(p)); scale = rate / max(1, RMS(U) / clip);
//                       decay = 1 - wd rate                             one block
//   adafactor_update    v = U scale; (m = b1 m + (1-b1) v; v = m); p = p decay - v
//                                                                       12 B (20 with m), 6 FLOP; flat
//   came_scalars        clip = 1 / max(1, RMS(U) / clip_threshold)      one block
//   came_momentum       U *= clip; m = b1 m + (1-b1) U (vector: p = p decay - lr m)
//                                                                       16 B (24 vector), 6 FLOP; flat
//   came_apply_matrix   p = p decay - lr m rf_i cf_j                    12 B, 5 FLOP; rows
//   sm3_vector          acc += d^2; p = p decay - lr d / (sqrt(acc) + eps)  20 B, 8 FLOP; flat
//   sm3_cols            col'_j = max_i (min(row_i, col_j) + d^2)       4 B, 4 FLOP; thread per column
//   sm3_rows            p = p decay - lr d / (sqrt(nu) + eps); row_i = max_j nu   12 B, 9 FLOP;
//                       one warp per row (8 rows per block), the maxima by a shuffle tree
//   copy                col_j = col'_j                                 per call: 8 n B
//   gram_schmidt        right-looking modified Gram-Schmidt (the left-looking CPU's operations,
//                       in the same order per column); one block; per call 2 n r^2 FLOP (double),
//                       n r (4 + 4 + 4) B plus its f64 copy in scratch (L2-resident for LDAdam's sizes)
//   ldadam_q            Q_ab = sum_i P_ia prev_ib (double, in order)    per call 2 M r^2 FLOP, thread per (a, b)
//   ldadam_rotate       mt = Q m; vt = bc2 |sum_b Q^2 (v / bc2 - m^2 c1) + mt^2 c1|
//                       per element of (r, N): 16 B (m, v read, mt, vt written; each thread
//                       reads r of m and v, shared with the other a through L1 / L2), 8 r FLOP; flat
//   ldadam_adam         Adam in the subspace                           24 B, 12 FLOP; flat
//   ldadam_apply        p = p decay - lr D; grad = E                  20 B, 3 FLOP; flat, or (transposed)
//                       32 x 32 tiles through shared memory, block (32, 8)
// Every kernel is memory-bound (at most ~1 FLOP per byte). Per element of a factored segment, a
// whole step moves: Adafactor 32 B (40 with m; the floor, p, g, m read and p, m written, is 20 B),
// CAME 60 B, SM3 16 B; per-element (vector) segments: Adafactor 32 B (40 with m), CAME 40 B, SM3 20 B. The
// factored steps read g three times (row means, column means, U): the EMAs must be complete
// before U, and the CPU's in-order sums fix one thread per row and one per column. The in-order
// sums are latency chains: a row mean costs n dependent double adds, a column mean m, and
// Gram-Schmidt 2 n per column (r columns), which bounds those kernels' time more than bytes do.

#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)
#include "loom/backend/cuda/cuda_optim_factored.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_launch.h"

namespace loom::cuda {
namespace {

// (kWarp, kMaxBlocks, grid_for, align256, thread_index / thread_count, max_of / min_of,
// warp_fold: cuda_device.h)
constexpr int kBlock = 256;
constexpr int64_t kPartialBlocks = 256;  // at most this many RMS partials (one block adds them)
constexpr int kTile = 32;       // row_ema and the transposed ldadam_apply: 32 x 32 tiles
constexpr int kTileRows = 8;    // block (32, 8)
constexpr int kRowsPerBlock = kBlock / kWarp;  // sm3_rows: a warp per row

// Scratch carved in 256-byte aligned pieces, in the order the *_scratch_bytes functions count them.
struct Carve {
  char* at;
  template <typename T>
  T* take(int64_t count) {
    T* p = reinterpret_cast<T*>(at);
    at += align256(static_cast<size_t>(count) * sizeof(T));
    return p;
  }
};

// std::max / std::min's own selection (a NaN in b is not taken by max, as on the CPU):
// cuda_device.h's max_of / min_of.

// The kBlock threads' values summed by a fixed halving tree; every thread gets the total.
__device__ double block_sum(double v, double* sums) {
  sums[threadIdx.x] = v;
  __syncthreads();
  for (int half = kBlock / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.x) < half) sums[threadIdx.x] += sums[threadIdx.x + half];
    __syncthreads();
  }
  const double total = sums[0];
  __syncthreads();
  return total;
}

// ---------------------------------------------------------------- sums of squares (RMS)
// partials[blockIdx] = the block's sum of x^2 in double (grid <= kPartialBlocks).
__global__ void __launch_bounds__(kBlock) sumsq_partials_kernel(const float* x, int64_t n, double* partials) {
  __shared__ double sums[kBlock];
  double acc = 0.0;
  for (int64_t i = thread_index(); i < n; i += thread_count()) acc += static_cast<double>(x[i]) * x[i];
  const double total = block_sum(acc, sums);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// ---------------------------------------------------------------- factored EMA
// Adafactor's term: (g gs)^2 + eps, the product g gs rounded to f32 first (as the CPU).
struct GradSquare {
  const float* g;
  float gs;
  double eps;
  int64_t n;
  __device__ double operator()(int64_t i, int64_t j) const {
    const double d = g[i * n + j] * gs;
    return d * d + eps;
  }
};
// CAME's residual term: (U - m)^2 + eps2 in double.
struct Residual {
  const float* U;
  const float* M;
  double eps;
  int64_t n;
  __device__ double operator()(int64_t i, int64_t j) const {
    const double d = static_cast<double>(U[i * n + j]) - M[i * n + j];
    return d * d + eps;
  }
};

// R_i = beta R_i + (1-beta) (sum_j f(i, j)) / n, the sum in j order by one thread per row.
// Block (32, 8) per band of 32 rows: each 32 x 32 tile is staged in shared memory by coalesced
// loads, then thread (i, 0) adds its row's 32 values in order.
template <typename F>
__global__ void __launch_bounds__(kBlock) row_ema_kernel(F f, int64_t m, int64_t n, float* R, double beta) {
  __shared__ double tile[kTile][kTile + 1];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile; r0 < m; r0 += static_cast<int64_t>(gridDim.x) * kTile) {
    double s = 0.0;
    double next[kTile / kTileRows];  // the next tile's values, loaded while warp 0 adds this one
#pragma unroll
    for (int k = 0; k < kTile / kTileRows; ++k) {
      const int64_t i = r0 + ty + k * kTileRows;
      next[k] = (i < m && tx < n) ? f(i, tx) : 0.0;
    }
    for (int64_t j0 = 0; j0 < n; j0 += kTile) {
#pragma unroll
      for (int k = 0; k < kTile / kTileRows; ++k) tile[ty + k * kTileRows][tx] = next[k];
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kTile / kTileRows; ++k) {
        const int64_t i = r0 + ty + k * kTileRows, j = j0 + kTile + tx;
        next[k] = (i < m && j < n) ? f(i, j) : 0.0;
      }
      if (ty == 0 && r0 + tx < m) {
        const int cols = n - j0 < kTile ? static_cast<int>(n - j0) : kTile;
        for (int c = 0; c < cols; ++c) s += tile[tx][c];
      }
      __syncthreads();
    }
    if (ty == 0 && r0 + tx < m) {
      const int64_t i = r0 + tx;
      R[i] = static_cast<float>(beta * R[i] + (1.0 - beta) * (s / static_cast<double>(n)));
    }
  }
}

// C_j = beta C_j + (1-beta) (sum_i f(i, j)) / m, the sum in i order by one thread per column.
template <typename F>
__global__ void __launch_bounds__(kBlock) col_ema_kernel(F f, int64_t m, int64_t n, float* C, double beta) {
  for (int64_t j = thread_index(); j < n; j += thread_count()) {
    double s = 0.0;
#pragma unroll 8
    for (int64_t i = 0; i < m; ++i) s += f(i, j);  // (unrolled: several loads in flight, the adds in order)
    C[j] = static_cast<float>(beta * C[j] + (1.0 - beta) * (s / static_cast<double>(m)));
  }
}

// *mean = (sum_i R_i in order) / m; one block: chunks of kBlock values staged in shared memory,
// added in order by thread 0.
__global__ void __launch_bounds__(kBlock) mean_kernel(const float* R, int64_t m, double* mean) {
  __shared__ double chunk[kBlock];
  double s = 0.0;
  for (int64_t base = 0; base < m; base += kBlock) {
    const int64_t i = base + threadIdx.x;
    chunk[threadIdx.x] = i < m ? static_cast<double>(R[i]) : 0.0;
    __syncthreads();
    if (threadIdx.x == 0) {
      const int count = m - base < kBlock ? static_cast<int>(m - base) : kBlock;
      for (int k = 0; k < count; ++k) s += chunk[k];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *mean = s / static_cast<double>(m);
}

// rf_i = f32(1 / sqrt(R_i / mean)), cf_j = f32(1 / sqrt(C_j)) (Adafactor's approx_sq_grad).
__global__ void __launch_bounds__(kBlock) factors_kernel(const float* R, const float* C, int64_t m, int64_t n,
                                                         const double* mean, float* rf, float* cf) {
  const double mu = *mean;
  for (int64_t k = thread_index(); k < m + n; k += thread_count()) {
    if (k < m) {
      rf[k] = static_cast<float>(1.0 / ::sqrt(R[k] / mu));
    } else {
      cf[k - m] = static_cast<float>(1.0 / ::sqrt(static_cast<double>(C[k - m])));
    }
  }
}

// ---------------------------------------------------------------- preconditioning
// U = g gs rf_i cf_j (f32, left to right as the CPU); partials[block] = its sum of U^2.
__global__ void __launch_bounds__(kBlock) precondition_matrix_kernel(const float* g, float gs, const float* rf,
                                                                     const float* cf, int64_t m, int64_t n, float* U,
                                                                     double* partials) {
  __shared__ double sums[kBlock];
  double acc = 0.0;
  for (int64_t i = blockIdx.x; i < m; i += gridDim.x) {
    const float r = rf[i];
    const float* gi = g + i * n;
    float* ui = U + i * n;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float u = gi[j] * gs * r * cf[j];
      ui[j] = u;
      acc += static_cast<double>(u) * u;
    }
  }
  const double total = block_sum(acc, sums);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// Per element: V = b V + (1-b)(d^2 + e), U = d / sqrt(V), d = g gs (f32); partials of U^2.
__global__ void __launch_bounds__(kBlock) precondition_vector_kernel(const float* g, float gs, float b, float e,
                                                                     float* V, float* U, int64_t n, double* partials) {
  __shared__ double sums[kBlock];
  double acc = 0.0;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const float d = g[i] * gs;
    const float v = b * V[i] + (1.0f - b) * (d * d + e);
    V[i] = v;
    const float u = d / sqrtf(v);
    U[i] = u;
    acc += static_cast<double>(u) * u;
  }
  const double total = block_sum(acc, sums);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// ---------------------------------------------------------------- Adafactor
// One block: out[0] = scale, out[1] = decay (f32, as the CPU computes them from the two RMS).
__global__ void __launch_bounds__(kBlock) adafactor_scalars_kernel(const double* pp, int np, const double* pu, int nu,
                                                                   int64_t count, double lr, double eps2,
                                                                   bool scale_parameter, double clip, float wd,
                                                                   float* out) {
  __shared__ double sums[kBlock];
  const int t = static_cast<int>(threadIdx.x);
  const double sp = block_sum(t < np ? pp[t] : 0.0, sums);
  const double su = block_sum(t < nu ? pu[t] : 0.0, sums);
  if (t == 0) {
    const double n = static_cast<double>(count);
    const float lr_eff = static_cast<float>(lr * (scale_parameter ? max_of(eps2, ::sqrt(sp / n)) : 1.0));
    const double rms_u = ::sqrt(su / n);
    out[0] = static_cast<float>(lr_eff / max_of(1.0, rms_u / clip));
    out[1] = 1.0f - wd * lr_eff;
  }
}

__global__ void __launch_bounds__(kBlock) adafactor_update_kernel(float* p, const float* U, float* M, int64_t n,
                                                                  const float* scalars, float b1) {
  const float scale = scalars[0], decay = scalars[1];
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    float v = U[i] * scale;
    if (M != nullptr) {
      const float mi = b1 * M[i] + (1.0f - b1) * v;
      M[i] = mi;
      v = mi;
    }
    p[i] = p[i] * decay - v;
  }
}

// ---------------------------------------------------------------- CAME
// One block: out[0] = clip = f32(1 / max(1, RMS(U) / clip_threshold)).
__global__ void __launch_bounds__(kBlock) came_scalars_kernel(const double* pu, int nu, int64_t count, double clip,
                                                              float* out) {
  __shared__ double sums[kBlock];
  const int t = static_cast<int>(threadIdx.x);
  const double su = block_sum(t < nu ? pu[t] : 0.0, sums);
  if (t == 0) out[0] = static_cast<float>(1.0 / max_of(1.0, ::sqrt(su / static_cast<double>(count)) / clip));
}

// U *= clip; m = b1 m + (1-b1) U; vector segments (apply) also p = p decay - eta m.
__global__ void __launch_bounds__(kBlock) came_momentum_kernel(float* U, float* M, float* p, int64_t n,
                                                               const float* scalars, float b1, bool apply, float eta,
                                                               float decay) {
  const float clip = scalars[0];
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const float u = U[i] * clip;
    U[i] = u;
    const float mi = b1 * M[i] + (1.0f - b1) * u;
    M[i] = mi;
    if (apply) p[i] = p[i] * decay - eta * mi;
  }
}

// p = p decay - eta m rf_i cf_j (the residual's factors).
__global__ void __launch_bounds__(kBlock) came_apply_matrix_kernel(float* p, const float* M, const float* rf,
                                                                   const float* cf, int64_t m, int64_t n, float eta,
                                                                   float decay) {
  for (int64_t i = blockIdx.x; i < m; i += gridDim.x) {
    const float r = rf[i];
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const int64_t k = i * n + j;
      p[k] = p[k] * decay - eta * M[k] * r * cf[j];
    }
  }
}

// ---------------------------------------------------------------- SM3
__device__ __forceinline__ float sm3_step_of(float gv, float nu, float eps) {
  return nu > 0.0f ? gv / (sqrtf(nu) + eps) : 0.0f;
}

__global__ void __launch_bounds__(kBlock) sm3_vector_kernel(float* p, const float* g, float* acc, int64_t n, float gs,
                                                            float eps, float eta, float decay) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const float d = g[i] * gs;
    const float a = acc[i] + d * d;
    acc[i] = a;
    p[i] = p[i] * decay - eta * sm3_step_of(d, a, eps);
  }
}

// cols[j] = max over i (in order, from 0) of nu_ij = min(row_i, col_j) + d_ij^2; one thread per column.
__global__ void __launch_bounds__(kBlock) sm3_cols_kernel(const float* g, float gs, const float* mr, const float* mc,
                                                          int64_t m, int64_t n, float* cols) {
  for (int64_t j = thread_index(); j < n; j += thread_count()) {
    const float cj = mc[j];
    float mx = 0.0f;
    for (int64_t i = 0; i < m; ++i) {
      const float d = g[i * n + j] * gs;
      mx = max_of(mx, min_of(mr[i], cj) + d * d);
    }
    cols[j] = mx;
  }
}

// One warp per row: p updated per element with nu_ij, row_i = max_j nu_ij. Each lane keeps a
// running max from 0 (a NaN never enters, as in the CPU's max from 0); the lanes' maxima are
// combined by a shuffle tree, which for non-NaN values is the sequential max. Every lane reads
// row_i before the shuffles; lane 0 writes it after them.
__global__ void __launch_bounds__(kBlock) sm3_rows_kernel(float* p, const float* g, float gs, float* mr,
                                                          const float* mc, int64_t m, int64_t n, float eps, float eta,
                                                          float decay) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  for (int64_t i = warp; i < m; i += warps) {
    const float ri = mr[i];
    float mx = 0.0f;
    for (int64_t j = lane; j < n; j += kWarp) {
      const int64_t k = i * n + j;
      const float d = g[k] * gs;
      const float nu = min_of(ri, mc[j]) + d * d;
      mx = max_of(mx, nu);
      p[k] = p[k] * decay - eta * sm3_step_of(g[k] * gs, nu, eps);
    }
    mx = warp_max(mx);
    if (lane == 0) mr[i] = mx;
  }
}

__global__ void __launch_bounds__(kBlock) copy_kernel(const float* src, float* dst, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) dst[i] = src[i];
}

// ---------------------------------------------------------------- LDAdam
// Modified Gram-Schmidt, one block. V (n x r, f64, column c at V + c n) holds the columns. The CPU
// goes left-looking (column c projected on q_0 .. q_{c-1} in turn); this goes right-looking (once
// q_k is final, every later column is projected on it): each column sees the same projections in
// the same order with the same arithmetic, so the bits are the CPU's. Each dot and norm is added
// in order by one thread (the later columns' dots in parallel, one thread per column); the
// updates run across the block. dots: r doubles of scratch.
__global__ void __launch_bounds__(kBlock) gram_schmidt_kernel(const float* y, const float* fallback, float* p,
                                                              double* V, double* dots, int64_t n, int64_t r) {
  __shared__ double norm_sh;
  const int64_t t = threadIdx.x, T = blockDim.x;
  for (int64_t k = t; k < n * r; k += T) {
    const int64_t i = k % n, c = k / n;
    V[c * n + i] = y[i * r + c];
  }
  __syncthreads();
  for (int64_t c = 0; c < r; ++c) {
    double* v = V + c * n;
    if (t == 0) {
      double norm = 0.0;
      for (int64_t i = 0; i < n; ++i) norm += v[i] * v[i];
      norm_sh = norm;
    }
    __syncthreads();
    if (norm_sh <= 1e-60) {  // the column vanished: fallback's, projected on q_0 .. q_{c-1} (left-looking)
      __syncthreads();       // (every thread has read norm_sh)
      for (int64_t i = t; i < n; i += T) v[i] = fallback[i * r + c];
      __syncthreads();
      for (int64_t k = 0; k < c; ++k) {
        const double* q = V + k * n;
        if (t == 0) {
          double dot = 0.0;
          for (int64_t i = 0; i < n; ++i) dot += q[i] * v[i];
          norm_sh = dot;
        }
        __syncthreads();
        const double dot = norm_sh;
        for (int64_t i = t; i < n; i += T) v[i] -= dot * q[i];
        __syncthreads();
      }
      if (t == 0) {
        double norm = 0.0;
        for (int64_t i = 0; i < n; ++i) norm += v[i] * v[i];
        norm_sh = norm;
      }
      __syncthreads();
    }
    const double norm = ::sqrt(norm_sh);
    for (int64_t i = t; i < n; i += T) v[i] = norm > 0.0 ? v[i] / norm : 0.0;
    __syncthreads();
    // Project the later columns on q_c.
    for (int64_t c2 = c + 1 + t; c2 < r; c2 += T) {
      const double* w = V + c2 * n;
      double dot = 0.0;
      for (int64_t i = 0; i < n; ++i) dot += v[i] * w[i];
      dots[c2] = dot;
    }
    __syncthreads();
    const int64_t later = (r - c - 1) * n;
    for (int64_t k = t; k < later; k += T) {
      const int64_t c2 = c + 1 + k / n, i = k % n;
      V[c2 * n + i] -= dots[c2] * v[i];
    }
    __syncthreads();
  }
  for (int64_t k = t; k < n * r; k += T) {
    const int64_t i = k / r, c = k % r;
    p[k] = static_cast<float>(V[c * n + i]);
  }
}

// Q_ab = sum_i P_ia prev_ib (double, in i order), or 0 at step 1; a thread per (a, b).
__global__ void __launch_bounds__(kBlock) ldadam_q_kernel(const float* P, const float* prev, int64_t M, int64_t r,
                                                          bool first, double* Q) {
  for (int64_t k = thread_index(); k < r * r; k += thread_count()) {
    const int64_t a = k / r, b = k % r;
    double dot = 0.0;
    if (!first) {
      for (int64_t i = 0; i < M; ++i) dot += static_cast<double>(P[i * r + a]) * prev[i * r + b];
    }
    Q[k] = dot;
  }
}

// Per (a, j): mt = f32(sum_b Q_ab m_bj); vt = f32(bc2 |sum_b Q_ab^2 (v_bj / bc2 - m_bj^2 c1) + mt^2 c1|)
// (0 at step 1), c1 = 1 / bc1^2, in double.
__global__ void __launch_bounds__(kBlock) ldadam_rotate_kernel(const double* Q, const float* m, const float* v,
                                                               float* mt, float* vt, int64_t r, int64_t N, bool first,
                                                               double bc2, double c1) {
  for (int64_t k = thread_index(); k < r * N; k += thread_count()) {
    const int64_t a = k / N, j = k % N;
    const double* q = Q + a * r;
    double acc = 0.0;
    for (int64_t b = 0; b < r; ++b) acc += q[b] * m[b * N + j];
    const float mtk = static_cast<float>(acc);
    mt[k] = mtk;
    if (first) {
      vt[k] = 0.0f;
      continue;
    }
    double s = 0.0;
    for (int64_t b = 0; b < r; ++b) {
      const double qq = q[b] * q[b];
      s += qq * (v[b * N + j] / bc2 - static_cast<double>(m[b * N + j]) * m[b * N + j] * c1);
    }
    s += static_cast<double>(mtk) * mtk * c1;
    vt[k] = static_cast<float>(bc2 * ::fabs(s));
  }
}

__global__ void __launch_bounds__(kBlock) ldadam_adam_kernel(float* m, float* v, float* mt, const float* vt,
                                                             const float* gh, int64_t n, float b1, float b2, float bc1,
                                                             float bc2, float eps) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const float g = gh[i];
    const float mi = b1 * mt[i] + (1.0f - b1) * g;
    const float vi = b2 * vt[i] + (1.0f - b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    mt[i] = (mi / bc1) / (sqrtf(vi / bc2) + eps);
  }
}

__global__ void __launch_bounds__(kBlock) ldadam_apply_kernel(float* p, float* grad, const float* d, const float* e,
                                                              int64_t n, float eta, float decay) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    p[i] = p[i] * decay - eta * d[i];
    grad[i] = e[i];
  }
}

// D and E are (cols, rows): 32 x 32 tiles of them are read coalesced into shared memory (padded
// rows: no bank conflicts), then p and grad are written coalesced. Block (32, 8), a tile per block
// iteration.
__global__ void __launch_bounds__(kBlock) ldadam_apply_transposed_kernel(float* p, float* grad, const float* d,
                                                                         const float* e, int64_t rows, int64_t cols,
                                                                         float eta, float decay) {
  __shared__ float td[kTile][kTile + 1];
  __shared__ float te[kTile][kTile + 1];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int64_t tiles_c = (cols + kTile - 1) / kTile, tiles = tiles_c * ((rows + kTile - 1) / kTile);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t i0 = tile / tiles_c * kTile, j0 = tile % tiles_c * kTile;
    for (int jj = ty; jj < kTile; jj += kTileRows) {  // D[j0 + jj][i0 + tx]
      const int64_t j = j0 + jj, i = i0 + tx;
      if (j < cols && i < rows) {
        td[jj][tx] = d[j * rows + i];
        te[jj][tx] = e[j * rows + i];
      }
    }
    __syncthreads();
    for (int ii = ty; ii < kTile; ii += kTileRows) {  // p[i0 + ii][j0 + tx]
      const int64_t i = i0 + ii, j = j0 + tx;
      if (i < rows && j < cols) {
        const int64_t k = i * cols + j;
        p[k] = p[k] * decay - eta * td[tx][ii];
        grad[k] = te[tx][ii];
      }
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------- shared pieces of the steps
// The factored EMA of f into state (R then C), then rf, cf from it.
template <typename F>
void factored_ema(const F& f, int64_t m, int64_t n, float* state, double beta, double* mean, float* rf, float* cf,
                  cudaStream_t stream) {
  float* R = state;
  float* C = state + m;
  launch<row_ema_kernel<F>>(grid_for(m, kTile), dim3(kTile, kTileRows), 0, stream, f, m, n, R, beta);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<col_ema_kernel<F>>(grid_for(n, kBlock), kBlock, 0, stream, f, m, n, C, beta);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<mean_kernel>(1, kBlock, 0, stream, static_cast<const float*>(R), m, mean);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<factors_kernel>(grid_for(m + n, kBlock), kBlock, 0, stream, static_cast<const float*>(R),
                         static_cast<const float*>(C), m, n, static_cast<const double*>(mean), rf, cf);
  LOOM_CUDA_CHECK_LAUNCH();
}

// U of an m x n segment into U; its RMS partials into partials; returns their count.
int precondition(const float* g, float gs, double beta, double eps, bool factored, int64_t m, int64_t n, float* state,
                 float* U, double* mean, float* rf, float* cf, double* partials, cudaStream_t stream) {
  if (factored) {
    factored_ema(GradSquare{g, gs, eps, n}, m, n, state, beta, mean, rf, cf, stream);
    const unsigned grid = grid_for(m, 1, kPartialBlocks);
    launch<precondition_matrix_kernel>(grid, kBlock, 0, stream, g, gs, static_cast<const float*>(rf),
                                       static_cast<const float*>(cf), m, n, U, partials);
    LOOM_CUDA_CHECK_LAUNCH();
    return static_cast<int>(grid);
  }
  const int64_t count = m * n;
  const unsigned grid = grid_for(count, kBlock, kPartialBlocks);
  launch<precondition_vector_kernel>(grid, kBlock, 0, stream, g, gs, static_cast<float>(beta), static_cast<float>(eps),
                                     state, U, count, partials);
  LOOM_CUDA_CHECK_LAUNCH();
  return static_cast<int>(grid);
}

// The pieces of the Adafactor / CAME scratch: two partial arrays, the mean, 4 scalars, rf, cf.
size_t factored_scratch_bytes(int64_t m, int64_t n) {
  return 2 * align256(kPartialBlocks * sizeof(double)) + align256(sizeof(double)) + align256(4 * sizeof(float)) +
         align256(static_cast<size_t>(m) * sizeof(float)) + align256(static_cast<size_t>(n) * sizeof(float));
}

}  // namespace

// ================================================================ launchers

size_t adafactor_scratch_bytes(int64_t m, int64_t n) { return factored_scratch_bytes(m, n); }

void adafactor_step(float* p, const float* g, float* state, float* M, float* U, int64_t m, int64_t n, bool factored,
                    const FactoredHyper& h, void* scratch, cudaStream_t stream) {
  const int64_t count = m * n;
  if (count <= 0) return;
  Carve carve{static_cast<char*>(scratch)};
  double* pp = carve.take<double>(kPartialBlocks);
  double* pu = carve.take<double>(kPartialBlocks);
  double* mean = carve.take<double>(1);
  float* scalars = carve.take<float>(4);
  float* rf = carve.take<float>(m);
  float* cf = carve.take<float>(n);
  int np = 0;
  if (h.scale_parameter) {  // RMS(p) before the update
    const unsigned grid = grid_for(count, kBlock, kPartialBlocks);
    launch<sumsq_partials_kernel>(grid, kBlock, 0, stream, static_cast<const float*>(p), count, pp);
    LOOM_CUDA_CHECK_LAUNCH();
    np = static_cast<int>(grid);
  }
  const int nu = precondition(g, h.grad_scale, h.beta2, h.eps, factored, m, n, state, U, mean, rf, cf, pu, stream);
  launch<adafactor_scalars_kernel>(1, kBlock, 0, stream, static_cast<const double*>(pp), np,
                                   static_cast<const double*>(pu), nu, count, h.lr, h.eps2, h.scale_parameter,
                                   h.clip_threshold, h.weight_decay, scalars);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<adafactor_update_kernel>(grid_for(count, kBlock), kBlock, 0, stream, p, static_cast<const float*>(U), M, count,
                                  static_cast<const float*>(scalars), static_cast<float>(h.beta1));
  LOOM_CUDA_CHECK_LAUNCH();
}

size_t sm3_scratch_bytes(int64_t m, int64_t n) { return align256(static_cast<size_t>(n) * sizeof(float)); }

void sm3_step(float* p, const float* g, float* acc, int64_t m, int64_t n, bool factored, const FactoredHyper& h,
              void* scratch, cudaStream_t stream) {
  const int64_t count = m * n;
  if (count <= 0) return;
  const float eps = static_cast<float>(h.eps), gs = h.grad_scale;
  const float eta = static_cast<float>(h.lr), decay = 1.0f - eta * h.weight_decay;
  if (!factored) {
    launch<sm3_vector_kernel>(grid_for(count, kBlock), kBlock, 0, stream, p, g, acc, count, gs, eps, eta, decay);
    LOOM_CUDA_CHECK_LAUNCH();
    return;
  }
  float* cols = static_cast<float*>(scratch);
  float* mr = acc;
  float* mc = acc + m;
  launch<sm3_cols_kernel>(grid_for(n, kBlock), kBlock, 0, stream, g, gs, static_cast<const float*>(mr),
                          static_cast<const float*>(mc), m, n, cols);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<sm3_rows_kernel>(grid_for(m, kRowsPerBlock), kBlock, 0, stream, p, g, gs, mr, static_cast<const float*>(mc), m,
                          n, eps, eta, decay);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<copy_kernel>(grid_for(n, kBlock), kBlock, 0, stream, static_cast<const float*>(cols), mc, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

size_t came_scratch_bytes(int64_t m, int64_t n) { return factored_scratch_bytes(m, n); }

void came_step(float* p, const float* g, float* state, float* M, float* res, float* U, int64_t m, int64_t n,
               bool factored, const FactoredHyper& h, void* scratch, cudaStream_t stream) {
  const int64_t count = m * n;
  if (count <= 0) return;
  Carve carve{static_cast<char*>(scratch)};
  carve.take<double>(kPartialBlocks);  // (Adafactor's RMS(p) partials: unused here)
  double* pu = carve.take<double>(kPartialBlocks);
  double* mean = carve.take<double>(1);
  float* scalars = carve.take<float>(4);
  float* rf = carve.take<float>(m);
  float* cf = carve.take<float>(n);
  const float b1 = static_cast<float>(h.beta1);
  const float eta = static_cast<float>(h.lr), decay = 1.0f - eta * h.weight_decay;
  const int nu = precondition(g, h.grad_scale, h.beta2, h.eps, factored, m, n, state, U, mean, rf, cf, pu, stream);
  launch<came_scalars_kernel>(1, kBlock, 0, stream, static_cast<const double*>(pu), nu, count, h.clip_threshold,
                              scalars);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<came_momentum_kernel>(grid_for(count, kBlock), kBlock, 0, stream, U, M, p, count,
                               static_cast<const float*>(scalars), b1, !factored, eta, decay);
  LOOM_CUDA_CHECK_LAUNCH();
  if (!factored) return;
  // The confidence: the factored EMA of the residual (U - m)^2 + eps2 (rf and cf are reused).
  factored_ema(Residual{U, M, h.eps2, n}, m, n, res, h.beta3, mean, rf, cf, stream);
  launch<came_apply_matrix_kernel>(grid_for(m, 1), kBlock, 0, stream, p, static_cast<const float*>(M),
                                   static_cast<const float*>(rf), static_cast<const float*>(cf), m, n, eta, decay);
  LOOM_CUDA_CHECK_LAUNCH();
}

size_t gram_schmidt_scratch_bytes(int64_t n, int64_t r) {
  return align256(static_cast<size_t>(n * r) * sizeof(double)) + align256(static_cast<size_t>(r) * sizeof(double));
}

void gram_schmidt(const float* y, const float* fallback, float* p, int64_t n, int64_t r, void* scratch,
                  cudaStream_t stream) {
  if (n <= 0 || r <= 0) return;
  Carve carve{static_cast<char*>(scratch)};
  double* V = carve.take<double>(n * r);
  double* dots = carve.take<double>(r);
  launch<gram_schmidt_kernel>(1, kBlock, 0, stream, y, fallback, p, V, dots, n, r);
  LOOM_CUDA_CHECK_LAUNCH();
}

size_t ldadam_rotate_scratch_bytes(int64_t r) { return align256(static_cast<size_t>(r * r) * sizeof(double)); }

void ldadam_rotate(const float* P, const float* prev, const float* m, const float* v, float* mt, float* vt, int64_t M,
                   int64_t r, int64_t N, int64_t step, double bc1_prev, double bc2_prev, void* scratch,
                   cudaStream_t stream) {
  if (r <= 0 || N <= 0) return;
  double* Q = static_cast<double*>(scratch);
  const bool first = step <= 1;
  launch<ldadam_q_kernel>(grid_for(r * r, kBlock), kBlock, 0, stream, P, prev, M, r, first, Q);
  LOOM_CUDA_CHECK_LAUNCH();
  const double c1 = 1.0 / (bc1_prev * bc1_prev);
  launch<ldadam_rotate_kernel>(grid_for(r * N, kBlock), kBlock, 0, stream, static_cast<const double*>(Q), m, v, mt, vt,
                               r, N, first, bc2_prev, c1);
  LOOM_CUDA_CHECK_LAUNCH();
}

void ldadam_adam(float* m, float* v, float* mt, const float* vt, const float* gh, int64_t n, float b1, float b2,
                 float bc1, float bc2, float eps, cudaStream_t stream) {
  if (n <= 0) return;
  launch<ldadam_adam_kernel>(grid_for(n, kBlock), kBlock, 0, stream, m, v, mt, vt, gh, n, b1, b2, bc1, bc2, eps);
  LOOM_CUDA_CHECK_LAUNCH();
}

void ldadam_apply(float* p, float* grad, const float* d, const float* e, int64_t rows, int64_t cols, bool transpose,
                  float eta, float decay, cudaStream_t stream) {
  const int64_t count = rows * cols;
  if (count <= 0) return;
  if (!transpose) {
    launch<ldadam_apply_kernel>(grid_for(count, kBlock), kBlock, 0, stream, p, grad, d, e, count, eta, decay);
  } else {
    const int64_t tiles = ((rows + kTile - 1) / kTile) * ((cols + kTile - 1) / kTile);
    launch<ldadam_apply_transposed_kernel>(grid_for(tiles, 1), dim3(kTile, kTileRows), 0, stream, p, grad, d, e, rows,
                                           cols, eta, decay);
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace loom::cuda
