// Causal attention with grouped KV heads and an optional sliding window on the GPU: the
// probabilities-saved path (cuBLAS GEMMs, cuda_blas.h, + small row kernels) and FlashAttention-2 (Dao 2023,
// "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning").
// Semantics are those of backend.h and cpu/cpu_kernels.h (attention_forward[_window],
// attention_backward[_window]).
//
// Shapes (B batch, T seq_len, H query heads, KV kv heads, G = H / KV, hd head_dim):
//   qkv  (B, T, W), W = (H + 2 KV) hd: query head h at columns [h hd, (h+1) hd), kv head g's key
//        at (H + g) hd, its value at (H + KV + g) hd. Query head h reads kv head g = h / G.
//   out  (B, T, H hd);  probs (B, H, T, T);  lse (B, H, T);  dqkv like qkv (overwritten).
// Math, per (b, h), scale = 1 / sqrt(hd), mask(i, j) = i - Wn < j <= i (Wn = window, or all
// j <= i when window = 0 or window >= T):
//   S = scale Q_h K_g^T;  P = softmax_j(S) over the mask, exactly 0 outside;  O_h = P V_g.
//   dP = dO_h V_g^T;  D_i = dO_i . O_i;  dS = scale P o (dP - D);
//   dQ_h = dS K_g;  dK_g = sum_{h in group g} dS^T Q_h;  dV_g = sum_{h in group g} P^T dO_h.
//
// Determinism: no atomics anywhere. Every sum is either inside one cuBLAS call (bitwise
// reproducible for a fixed toolkit, GPU and handle workspace) or a fixed-order loop in one
// thread followed by a fixed shuffle tree; the group sums of dK and dV run in the order
// h = g G, g G + 1, ... (beta = 0 for the first, 1 after), as on the CPU.
#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)

#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "loom/backend/cuda/cuda_blas.h"
#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_launch.h"
#include "loom/backend/cuda/cuda_kernels.h"
#include "loom/core/error.h"

namespace loom::cuda {
namespace {

// ------------------------------------------------------------------------------------ shapes
struct AttnDims {
  int64_t B, T, H, KV, G, hd, W, OW;
  int64_t window;  // normalized: 0 = full causal (window = 0 or window >= T)
  bool empty;
};

AttnDims attention_dims(const char* op, int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                        int64_t head_dim, int64_t window) {
  LOOM_CHECK(batch >= 0 && seq_len >= 0, op, ": batch and seq_len must be >= 0, got ", batch, ", ", seq_len);
  LOOM_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0, op,
             ": n_head must be a positive multiple of n_kv_head, got ", n_head, " and ", n_kv_head);
  LOOM_CHECK(head_dim > 0, op, ": head_dim must be > 0, got ", head_dim);
  LOOM_CHECK(window >= 0, op, ": window must be >= 0, got ", window);
  AttnDims d{};
  d.B = batch;
  d.T = seq_len;
  d.H = n_head;
  d.KV = n_kv_head;
  d.G = n_head / n_kv_head;
  d.hd = head_dim;
  d.W = (n_head + 2 * n_kv_head) * head_dim;
  d.OW = n_head * head_dim;
  d.window = (window > 0 && window < seq_len) ? window : 0;
  d.empty = batch == 0 || seq_len == 0;
  LOOM_CHECK(d.W <= INT_MAX && seq_len <= INT_MAX, op, ": row width ", d.W, " or seq_len ", seq_len,
             " exceeds the 32-bit sizes of the kernels and cuBLAS");
  LOOM_CHECK(n_head <= 65535 && batch <= 65535, op, ": n_head (", n_head, ") and batch (", batch,
             ") must be <= 65535 (grid dimensions)");
  return d;
}

// ------------------------------------------------------------------------------------ device helpers
// (exp_of / log_of: expf and logf, exp and log; group_sum<kG> over kG consecutive lanes and
// warp_sum: cuda_device.h. All 32 lanes of the warp call them.)
__device__ __forceinline__ float neg_inf(float) { return -CUDART_INF_F; }
__device__ __forceinline__ double neg_inf(double) { return -CUDART_INF; }
// a unless b is larger (a NaN in b is not taken; of +0 and -0 the second): this file's max,
// which differs from cuda_device.h's max_of (std::max's) only on ties and NaNs.
template <typename T>
__device__ __forceinline__ T max_t(T a, T b) {
  return a > b ? a : b;
}
template <typename T>
__device__ __forceinline__ T warp_max_t(T v) {
  return warp_fold(v, [](T a, T b) { return max_t(a, b); });
}

constexpr int kRowWarps = 8;  // rows (one warp each) per block of the row kernels

// ------------------------------------------------------------------------------------ probs path kernels
// In place on probs rows (B H T rows of T): row r is query i = r % T.
//   P[i, j] = exp(S_ij - max) / sum over first <= j <= i, first = max(0, i - window + 1)
//   (0 when window = 0), and exactly 0 for the other j.
// One warp per row; each lane reads and writes only its own columns j = lane (mod 32).
template <typename T>
__global__ void __launch_bounds__(kRowWarps* kWarp)
    masked_softmax_kernel(T* __restrict__ probs, int64_t rows, int seq_len, int window) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  if (r >= rows) return;  // warp-uniform
  const int lane = threadIdx.x % kWarp;
  const int i = static_cast<int>(r % seq_len);
  const int first = window > 0 ? max(0, i - window + 1) : 0;
  T* row = probs + r * seq_len;
  T mx = neg_inf(T(0));
  for (int j = first + lane; j <= i; j += kWarp) mx = max_t(mx, row[j]);
  mx = warp_max_t(mx);
  T sum = 0;
  for (int j = first + lane; j <= i; j += kWarp) {
    const T e = exp_of(row[j] - mx);
    row[j] = e;
    sum += e;
  }
  sum = warp_sum(sum);
  const T inv = T(1) / sum;
  for (int j = first + lane; j <= i; j += kWarp) row[j] *= inv;
  for (int j = lane; j < first; j += kWarp) row[j] = T(0);
  for (int j = i + 1 + lane; j < seq_len; j += kWarp) row[j] = T(0);
}

// For one batch element b, in place on ds (H, T, T) holding dP:
//   D_i = dO_i . O_i;  dS[h, i, j] = scale P[h, i, j] (dP[h, i, j] - D_i)   (the CPU's formula, all j).
// One warp per (h, i) row.
template <typename T>
__global__ void __launch_bounds__(kRowWarps* kWarp)
    attention_dscores_kernel(const T* __restrict__ dout, const T* __restrict__ out, const T* __restrict__ probs_b,
                             T* __restrict__ ds, int64_t b, int seq_len, int n_head, int head_dim, T scale) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  if (r >= static_cast<int64_t>(n_head) * seq_len) return;  // warp-uniform
  const int lane = threadIdx.x % kWarp;
  const int h = static_cast<int>(r / seq_len), i = static_cast<int>(r % seq_len);
  const int64_t off = (b * seq_len + i) * static_cast<int64_t>(n_head) * head_dim + static_cast<int64_t>(h) * head_dim;
  T dsum = 0;
  for (int d = lane; d < head_dim; d += kWarp) dsum += dout[off + d] * out[off + d];
  dsum = warp_sum(dsum);
  const T* p = probs_b + r * seq_len;
  T* row = ds + r * seq_len;
  for (int j = lane; j < seq_len; j += kWarp) row[j] = scale * p[j] * (row[j] - dsum);
}

// ------------------------------------------------------------------------------------ flash configuration
// CUDA-core FlashAttention-2 in fp32 / fp64. A group of kG consecutive lanes owns one row (a
// query in the forward and the dQ kernel, a key in the dK/dV kernel); lane t of the group holds
// kE = kHd / kG of the row's head dims in registers, in 16-byte chunks so that shared-memory
// reads are 128-bit: register e <-> dim (t + kG (e / kV)) kV + e % kV, kV = 16 / sizeof(T).
// Dims >= head_dim are zero (kHd = head_dim rounded up to 16, 32, 64, 128 or 256).
// Dot products: kE FMAs per lane, then a log2(kG) shuffle tree (group_sum).
// Where tensor cores would go (bf16/fp16, or tf32 if allowed): the S = Q K^T and O += P V tile
// products of the forward and the four tile products of the backward become wgmma (sm_90a)
// warpgroup MMAs on shared-memory tiles fed by TMA, with a Br = 64/128-row query tile per
// warpgroup; the softmax bookkeeping (m, l, rescale) stays as written here.
constexpr int kFlashThreads = 128;
// The dK/dV kernel asks for only 2 resident blocks per SM: ptxas's default heuristic capped it at
// 128 registers and spilled (fp32, hd 128); with this it takes ~180 and spills nothing. The
// forward and dQ kernels keep the default (they spill with the looser cap: ptxas hoists more loads).
constexpr int kDkdvMinBlocks = 2;

template <typename T>
__host__ __device__ constexpr int vec_len() {
  return 16 / static_cast<int>(sizeof(T));
}
// Keys (forward, dQ) or queries (dK/dV) per shared tile: two (kTile, kHd) tiles <= 32 KB.
template <typename T, int kHd>
__host__ __device__ constexpr int flash_tile() {
  return 16384 / (kHd * static_cast<int>(sizeof(T))) < 32 ? 16384 / (kHd * static_cast<int>(sizeof(T))) : 32;
}
// Lanes per row: the forward keeps q, o (kE each) and kTile scores in registers; the backward
// kernels keep four (dK/dV: k, v, dk, dv) or three (dQ: q, dO, dq) rows of kE.
template <typename T, int kHd>
__host__ __device__ constexpr int fwd_group() {
  return kHd / (sizeof(T) == 4 ? 32 : 16) > 1 ? kHd / (sizeof(T) == 4 ? 32 : 16) : 1;
}
template <typename T, int kHd>
__host__ __device__ constexpr int bwd_group() {
  return kHd / (sizeof(T) == 4 ? 16 : 8) > 1 ? kHd / (sizeof(T) == 4 ? 16 : 8) : 1;
}

template <int kG, int kV>
__device__ __forceinline__ int dim_of(int t, int e) {
  return (t + kG * (e / kV)) * kV + e % kV;
}

__device__ __forceinline__ void load_vec(const float* p, float (&r)[4]) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  r[0] = x.x;
  r[1] = x.y;
  r[2] = x.z;
  r[3] = x.w;
}
__device__ __forceinline__ void load_vec(const double* p, double (&r)[2]) {
  const double2 x = *reinterpret_cast<const double2*>(p);
  r[0] = x.x;
  r[1] = x.y;
}

// Loads rows [r0, r0 + kTile) of a (rows, ld) matrix's head_dim-wide column block into
// tile (kTile, kHd); rows >= r1 and dims >= head_dim are 0.
template <typename T, int kTile, int kHd>
__device__ __forceinline__ void load_tile(T (*tile)[kHd], const T* __restrict__ src, int64_t ld, int r0, int r1,
                                          int head_dim) {
  for (int idx = threadIdx.x; idx < kTile * kHd; idx += kFlashThreads) {
    const int rr = idx / kHd, d = idx % kHd, r = r0 + rr;
    tile[rr][d] = (r < r1 && d < head_dim) ? src[static_cast<int64_t>(r) * ld + d] : T(0);
  }
}

// Loads one row's kE dims owned by lane t (0 outside the row or for an inactive row).
template <typename T, int kE, int kG>
__device__ __forceinline__ void load_row(T (&x)[kE], const T* __restrict__ src, bool active, int t, int head_dim) {
  constexpr int kV = vec_len<T>();
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    const int d = dim_of<kG, kV>(t, e);
    x[e] = (active && d < head_dim) ? src[d] : T(0);
  }
}
template <typename T, int kE, int kG>
__device__ __forceinline__ void store_row(const T (&x)[kE], T* __restrict__ dst, T factor, int t, int head_dim) {
  constexpr int kV = vec_len<T>();
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    const int d = dim_of<kG, kV>(t, e);
    if (d < head_dim) dst[d] = x[e] * factor;
  }
}

// The query rows a forward or dQ block owns, grid (ceil(T / kRows), H, B) with the latest query
// tiles first (they see the most keys): rows [i0, i0 + kRows) of head h of sequence b; lane t of
// row i's group of kG lanes; the row widths of qkv (W) and out (H hd); the sequence's qkv rows
// and its kv head's key and value columns.
template <typename T>
struct QueryBlock {
  int i0, h, b, t, i;
  bool active;  // i < T
  int64_t width, out_width;
  const T* base;
  const T* kbase;
  const T* vbase;
};

template <typename T, int kG, int kRows>
__device__ __forceinline__ QueryBlock<T> query_block(const T* qkv, int seq_len, int n_head, int n_kv_head,
                                                     int head_dim) {
  QueryBlock<T> q;
  const int n_tiles = (seq_len + kRows - 1) / kRows;
  q.i0 = (n_tiles - 1 - static_cast<int>(blockIdx.x)) * kRows;
  q.h = blockIdx.y;
  q.b = blockIdx.z;
  const int g = q.h / (n_head / n_kv_head);
  q.width = static_cast<int64_t>(n_head + 2 * n_kv_head) * head_dim;
  q.out_width = static_cast<int64_t>(n_head) * head_dim;
  q.t = threadIdx.x % kG;
  q.i = q.i0 + static_cast<int>(threadIdx.x) / kG;
  q.active = q.i < seq_len;
  q.base = qkv + static_cast<int64_t>(q.b) * seq_len * q.width;
  q.kbase = q.base + static_cast<int64_t>(n_head + g) * head_dim;
  q.vbase = q.base + static_cast<int64_t>(n_head + n_kv_head + g) * head_dim;
  return q;
}

// ------------------------------------------------------------------------------------ flash forward
// Grid (ceil(T / kRows), H, B), kRows = 128 / kG query rows per block (the latest query tiles,
// which see the most keys, are scheduled first). Keys [lo, hi) of the block, lo = max(0, i0 -
// window + 1) (0 without a window), hi = min(T, i0 + kRows): tiles fully above the diagonal or
// left of the window are never loaded; inside the loaded tiles the mask sets s = -inf.
// Online softmax per row (FlashAttention-2, Algorithm 1): per key tile
//   m' = max(m, max_j s_j);  c = exp(m - m');  l = c l + sum_j exp(s_j - m');  o = c o + sum_j exp(s_j - m') v_j
// and at the end out = o (1 / l), lse = m + log(l). A row with no key seen yet has m = -inf; the
// reference m_use = 0 then keeps exp() away from (-inf) - (-inf).
template <typename T, int kHd, int kG>
__global__ void __launch_bounds__(kFlashThreads)
    flash_forward_kernel(const T* __restrict__ qkv, T* __restrict__ out, T* __restrict__ lse, int seq_len, int n_head,
                         int n_kv_head, int head_dim, int window, T scale) {
  constexpr int kV = vec_len<T>();
  constexpr int kE = kHd / kG;
  constexpr int kRows = kFlashThreads / kG;
  constexpr int kTile = flash_tile<T, kHd>();
  static_assert(kE % kV == 0, "a lane's dims come in 16-byte chunks");
  __shared__ __align__(16) T ks[kTile][kHd];
  __shared__ __align__(16) T vs[kTile][kHd];

  const auto [i0, h, b, t, i, active, width, out_width, base, kbase, vbase] =
      query_block<T, kG, kRows>(qkv, seq_len, n_head, n_kv_head, head_dim);

  T q[kE], o[kE];
  load_row<T, kE, kG>(q, base + static_cast<int64_t>(i) * width + static_cast<int64_t>(h) * head_dim, active, t,
                      head_dim);
#pragma unroll
  for (int e = 0; e < kE; ++e) o[e] = T(0);
  T m = neg_inf(T(0)), l = T(0);

  const int lo = window > 0 ? max(0, i0 - window + 1) : 0;
  const int hi = min(seq_len, i0 + kRows);
  const int row_lo = window > 0 ? i - window + 1 : 0;  // may be negative
  for (int j0 = lo; j0 < hi; j0 += kTile) {
    __syncthreads();  // the previous tile is no longer read
    load_tile<T, kTile, kHd>(ks, kbase + static_cast<int64_t>(j0) * width, width, 0, hi - j0, head_dim);
    load_tile<T, kTile, kHd>(vs, vbase + static_cast<int64_t>(j0) * width, width, 0, hi - j0, head_dim);
    __syncthreads();

    T s[kTile];
    T mx = m;
#pragma unroll
    for (int jj = 0; jj < kTile; ++jj) {
      T acc = T(0);
#pragma unroll
      for (int c = 0; c < kE / kV; ++c) {
        T kv[kV];
        load_vec(&ks[jj][(t + kG * c) * kV], kv);
#pragma unroll
        for (int v = 0; v < kV; ++v) acc += q[c * kV + v] * kv[v];
      }
      acc = group_sum<kG>(acc);
      const int j = j0 + jj;
      s[jj] = (j < hi && j >= row_lo && j <= i) ? acc * scale : neg_inf(T(0));
      mx = max_t(mx, s[jj]);
    }
    const T m_use = mx == neg_inf(T(0)) ? T(0) : mx;
    const T corr = exp_of(m - m_use);  // 0 while m = -inf (l and o are 0 then)
    l *= corr;
#pragma unroll
    for (int e = 0; e < kE; ++e) o[e] *= corr;
#pragma unroll
    for (int jj = 0; jj < kTile; ++jj) {
      const T p = exp_of(s[jj] - m_use);  // exp(-inf) = 0 for masked keys
      l += p;
#pragma unroll
      for (int c = 0; c < kE / kV; ++c) {
        T vv[kV];
        load_vec(&vs[jj][(t + kG * c) * kV], vv);
#pragma unroll
        for (int v = 0; v < kV; ++v) o[c * kV + v] += p * vv[v];
      }
    }
    m = mx;
  }

  if (active) {  // every active row saw key j = i, so l >= 1
    T* dst = out + (static_cast<int64_t>(b) * seq_len + i) * out_width + static_cast<int64_t>(h) * head_dim;
    store_row<T, kE, kG>(o, dst, T(1) / l, t, head_dim);
    if (t == 0) lse[(static_cast<int64_t>(b) * n_head + h) * seq_len + i] = m + log_of(l);
  }
}

// ------------------------------------------------------------------------------------ flash backward
// D (B, H, T): D[b, h, t] = dO[b, t, h] . O[b, t, h]. One warp per (b, t, h) row of dout/out.
template <typename T>
__global__ void __launch_bounds__(kRowWarps* kWarp)
    flash_dsum_kernel(const T* __restrict__ dout, const T* __restrict__ out, T* __restrict__ dsum, int64_t rows,
                      int seq_len, int n_head, int head_dim) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  if (r >= rows) return;  // warp-uniform
  const int lane = threadIdx.x % kWarp;
  const T* x = dout + r * head_dim;
  const T* y = out + r * head_dim;
  T acc = 0;
  for (int d = lane; d < head_dim; d += kWarp) acc += x[d] * y[d];
  acc = warp_sum(acc);
  const int64_t bt = r / n_head, h = r % n_head, b = bt / seq_len, i = bt % seq_len;
  if (lane == 0) dsum[(b * n_head + h) * seq_len + i] = acc;
}

// dK, dV: grid (ceil(T / kRows), KV, B); a block owns kRows keys [j0, j0 + kRows) of kv head g,
// keeps k, v, dk, dv of each key in registers, and streams (Q, dO, lse, D) tiles of the group's
// query heads h = g G .. g G + G - 1 (in that order), query rows [j0, qhi) in increasing order
// (qhi = T, or the last query that sees the block's last key through the window, + 1). Per
// query i, for the lane group's key j (the FlashAttention-2 backward, Algorithm 2, lines 11-20):
//   p = exp(scale q_i . k_j - lse_i);  dp = dO_i . v_j;  ds = scale p (dp - D_i)   (0 off the mask)
//   dv += p dO_i;  dk += ds q_i.
template <typename T, int kHd, int kG>
__global__ void __launch_bounds__(kFlashThreads, kDkdvMinBlocks)
    flash_backward_dkdv_kernel(const T* __restrict__ dout, const T* __restrict__ qkv, const T* __restrict__ lse,
                               const T* __restrict__ dsum, T* __restrict__ dqkv, int seq_len, int n_head,
                               int n_kv_head, int head_dim, int window, T scale) {
  constexpr int kV = vec_len<T>();
  constexpr int kE = kHd / kG;
  constexpr int kRows = kFlashThreads / kG;
  constexpr int kTile = flash_tile<T, kHd>();
  static_assert(kE % kV == 0, "a lane's dims come in 16-byte chunks");
  __shared__ __align__(16) T qs[kTile][kHd];
  __shared__ __align__(16) T dos[kTile][kHd];
  __shared__ T lses[kTile];
  __shared__ T dsums[kTile];

  const int j0 = static_cast<int>(blockIdx.x) * kRows;
  const int g = blockIdx.y, b = blockIdx.z;
  const int group = n_head / n_kv_head;
  const int64_t width = static_cast<int64_t>(n_head + 2 * n_kv_head) * head_dim;
  const int64_t out_width = static_cast<int64_t>(n_head) * head_dim;
  const int t = threadIdx.x % kG;
  const int j = j0 + static_cast<int>(threadIdx.x) / kG;
  const bool active = j < seq_len;
  const T* base = qkv + static_cast<int64_t>(b) * seq_len * width;
  const int64_t kcol = static_cast<int64_t>(n_head + g) * head_dim;
  const int64_t vcol = static_cast<int64_t>(n_head + n_kv_head + g) * head_dim;

  T k[kE], v[kE], dk[kE], dv[kE];
  load_row<T, kE, kG>(k, base + static_cast<int64_t>(j) * width + kcol, active, t, head_dim);
  load_row<T, kE, kG>(v, base + static_cast<int64_t>(j) * width + vcol, active, t, head_dim);
#pragma unroll
  for (int e = 0; e < kE; ++e) dk[e] = dv[e] = T(0);

  const int qlo = j0;
  const int qhi = window > 0 ? min(seq_len, j0 + kRows - 1 + window) : seq_len;
  const int row_hi = window > 0 ? j + window : seq_len;  // key j is seen by queries j <= i < j + window

  for (int r = 0; r < group; ++r) {
    const int h = g * group + r;
    const T* qsrc = base + static_cast<int64_t>(h) * head_dim;
    const T* dosrc = dout + static_cast<int64_t>(b) * seq_len * out_width + static_cast<int64_t>(h) * head_dim;
    const T* lse_h = lse + (static_cast<int64_t>(b) * n_head + h) * seq_len;
    const T* dsum_h = dsum + (static_cast<int64_t>(b) * n_head + h) * seq_len;
    for (int i0 = qlo; i0 < qhi; i0 += kTile) {
      __syncthreads();  // the previous tile is no longer read
      load_tile<T, kTile, kHd>(qs, qsrc + static_cast<int64_t>(i0) * width, width, 0, qhi - i0, head_dim);
      load_tile<T, kTile, kHd>(dos, dosrc + static_cast<int64_t>(i0) * out_width, out_width, 0, qhi - i0, head_dim);
      if (threadIdx.x < kTile) {
        const int i = i0 + static_cast<int>(threadIdx.x);
        lses[threadIdx.x] = i < qhi ? lse_h[i] : T(0);
        dsums[threadIdx.x] = i < qhi ? dsum_h[i] : T(0);
      }
      __syncthreads();

#pragma unroll 2
      for (int ii = 0; ii < kTile; ++ii) {
        T s = T(0), dp = T(0);
#pragma unroll
        for (int c = 0; c < kE / kV; ++c) {
          T qv[kV], ov[kV];
          load_vec(&qs[ii][(t + kG * c) * kV], qv);
          load_vec(&dos[ii][(t + kG * c) * kV], ov);
#pragma unroll
          for (int x = 0; x < kV; ++x) {
            s += k[c * kV + x] * qv[x];
            dp += v[c * kV + x] * ov[x];
          }
        }
        s = group_sum<kG>(s);
        dp = group_sum<kG>(dp);
        const int i = i0 + ii;
        const bool ok = active && i < qhi && j <= i && i < row_hi;
        const T p = ok ? exp_of(s * scale - lses[ii]) : T(0);
        const T ds = ok ? scale * p * (dp - dsums[ii]) : T(0);
#pragma unroll
        for (int c = 0; c < kE / kV; ++c) {
          T qv[kV], ov[kV];
          load_vec(&qs[ii][(t + kG * c) * kV], qv);
          load_vec(&dos[ii][(t + kG * c) * kV], ov);
#pragma unroll
          for (int x = 0; x < kV; ++x) {
            dv[c * kV + x] += p * ov[x];
            dk[c * kV + x] += ds * qv[x];
          }
        }
      }
    }
  }

  if (active) {
    T* dst = dqkv + (static_cast<int64_t>(b) * seq_len + j) * width;
    store_row<T, kE, kG>(dk, dst + kcol, T(1), t, head_dim);
    store_row<T, kE, kG>(dv, dst + vcol, T(1), t, head_dim);
  }
}

// dQ without atomics: a second pass, grid (ceil(T / kRows), H, B) like the forward, each lane
// group owning query i (q, dO, dq in registers, lse_i and D_i scalars) and streaming the same
// key/value tiles as the forward, recomputing p and ds (fixed key order):
//   dq += ds k_j,  ds = scale exp(scale q_i . k_j - lse_i) (dO_i . v_j - D_i).
template <typename T, int kHd, int kG>
__global__ void __launch_bounds__(kFlashThreads)
    flash_backward_dq_kernel(const T* __restrict__ dout, const T* __restrict__ qkv, const T* __restrict__ lse,
                             const T* __restrict__ dsum, T* __restrict__ dqkv, int seq_len, int n_head, int n_kv_head,
                             int head_dim, int window, T scale) {
  constexpr int kV = vec_len<T>();
  constexpr int kE = kHd / kG;
  constexpr int kRows = kFlashThreads / kG;
  constexpr int kTile = flash_tile<T, kHd>();
  static_assert(kE % kV == 0, "a lane's dims come in 16-byte chunks");
  __shared__ __align__(16) T ks[kTile][kHd];
  __shared__ __align__(16) T vs[kTile][kHd];

  const auto [i0, h, b, t, i, active, width, out_width, base, kbase, vbase] =
      query_block<T, kG, kRows>(qkv, seq_len, n_head, n_kv_head, head_dim);

  T q[kE], dO[kE], dq[kE];
  load_row<T, kE, kG>(q, base + static_cast<int64_t>(i) * width + static_cast<int64_t>(h) * head_dim, active, t,
                      head_dim);
  load_row<T, kE, kG>(
      dO, dout + (static_cast<int64_t>(b) * seq_len + i) * out_width + static_cast<int64_t>(h) * head_dim, active, t,
      head_dim);
#pragma unroll
  for (int e = 0; e < kE; ++e) dq[e] = T(0);
  const int64_t row_stat = (static_cast<int64_t>(b) * n_head + h) * seq_len + i;
  const T lse_i = active ? lse[row_stat] : T(0);
  const T dsum_i = active ? dsum[row_stat] : T(0);

  const int lo = window > 0 ? max(0, i0 - window + 1) : 0;
  const int hi = min(seq_len, i0 + kRows);
  const int row_lo = window > 0 ? i - window + 1 : 0;
  for (int j0 = lo; j0 < hi; j0 += kTile) {
    __syncthreads();
    load_tile<T, kTile, kHd>(ks, kbase + static_cast<int64_t>(j0) * width, width, 0, hi - j0, head_dim);
    load_tile<T, kTile, kHd>(vs, vbase + static_cast<int64_t>(j0) * width, width, 0, hi - j0, head_dim);
    __syncthreads();

#pragma unroll 2
    for (int jj = 0; jj < kTile; ++jj) {
      T s = T(0), dp = T(0);
#pragma unroll
      for (int c = 0; c < kE / kV; ++c) {
        T kv[kV], vv[kV];
        load_vec(&ks[jj][(t + kG * c) * kV], kv);
        load_vec(&vs[jj][(t + kG * c) * kV], vv);
#pragma unroll
        for (int x = 0; x < kV; ++x) {
          s += q[c * kV + x] * kv[x];
          dp += dO[c * kV + x] * vv[x];
        }
      }
      s = group_sum<kG>(s);
      dp = group_sum<kG>(dp);
      const int j = j0 + jj;
      const bool ok = active && j < hi && j >= row_lo && j <= i;
      const T p = ok ? exp_of(s * scale - lse_i) : T(0);
      const T ds = ok ? scale * p * (dp - dsum_i) : T(0);
#pragma unroll
      for (int c = 0; c < kE / kV; ++c) {
        T kv[kV];
        load_vec(&ks[jj][(t + kG * c) * kV], kv);
#pragma unroll
        for (int x = 0; x < kV; ++x) dq[c * kV + x] += ds * kv[x];
      }
    }
  }

  if (active) {
    T* dst = dqkv + (static_cast<int64_t>(b) * seq_len + i) * width + static_cast<int64_t>(h) * head_dim;
    store_row<T, kE, kG>(dq, dst, T(1), t, head_dim);
  }
}

// ------------------------------------------------------------------------------------ flash launchers
template <typename T, int kHd>
void launch_flash_forward(const T* qkv, T* out, T* lse, const AttnDims& d, T scale, cudaStream_t stream) {
  constexpr int kG = fwd_group<T, kHd>();
  constexpr int kRows = kFlashThreads / kG;
  const dim3 grid(static_cast<unsigned>((d.T + kRows - 1) / kRows), static_cast<unsigned>(d.H),
                  static_cast<unsigned>(d.B));
  launch<flash_forward_kernel<T, kHd, kG>>(grid, kFlashThreads, 0, stream,
      qkv, out, lse, static_cast<int>(d.T), static_cast<int>(d.H), static_cast<int>(d.KV), static_cast<int>(d.hd),
      static_cast<int>(d.window), scale);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T, int kHd>
void launch_flash_backward(const T* dout, const T* qkv, const T* lse, const T* dsum, T* dqkv, const AttnDims& d,
                           T scale, cudaStream_t stream) {
  constexpr int kG = bwd_group<T, kHd>();
  constexpr int kRows = kFlashThreads / kG;
  const unsigned tiles = static_cast<unsigned>((d.T + kRows - 1) / kRows);
  launch<flash_backward_dkdv_kernel<T, kHd, kG>>(dim3(tiles, static_cast<unsigned>(d.KV), static_cast<unsigned>(d.B)), kFlashThreads, 0, stream,
          dout, qkv, lse, dsum, dqkv, static_cast<int>(d.T), static_cast<int>(d.H), static_cast<int>(d.KV),
          static_cast<int>(d.hd), static_cast<int>(d.window), scale);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<flash_backward_dq_kernel<T, kHd, kG>>(dim3(tiles, static_cast<unsigned>(d.H), static_cast<unsigned>(d.B)), kFlashThreads, 0, stream,
          dout, qkv, lse, dsum, dqkv, static_cast<int>(d.T), static_cast<int>(d.H), static_cast<int>(d.KV),
          static_cast<int>(d.hd), static_cast<int>(d.window), scale);
  LOOM_CUDA_CHECK_LAUNCH();
}

constexpr int64_t kFlashMaxHeadDim = 256;

template <typename T>
T attention_scale(int64_t head_dim) {
  return T(1) / std::sqrt(static_cast<T>(head_dim));  // as the CPU kernels
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps); }

// ------------------------------------------------------------------------------------ attention sinks
// backend.h attention_sink_forward / _backward: g = sigmoid(lse - s_h) = 1 / (1 + e^(s_h - lse))
// per (b, t, h) row, as the CPU computes it. Forward: the row times g. Backward: the row's share of
// d(s_h), -(1 - g) dO.O, into partial[r], then dO times g; the per-head sum runs in sink_sum_kernel
// over the rows in a fixed order (no atomics: the same bytes every run).
template <typename T>
__device__ __forceinline__ T sink_gate(T lse, T sink) {
  return T(1) / (T(1) + exp_of(sink - lse));
}

// Row r's g: rows = B T H, row r = (b T + t) H + h; lse (B, H, T).
template <typename T>
__device__ __forceinline__ T sink_row_gate(const T* lse, const T* sinks, int64_t r, int seq_len, int n_head) {
  const int64_t bt = r / n_head, h = r % n_head, b = bt / seq_len, t = bt % seq_len;
  return sink_gate(lse[(b * n_head + h) * seq_len + t], sinks[h]);
}

// One warp per (b, t, h) row of out.
template <typename T>
__global__ void __launch_bounds__(kRowWarps* kWarp)
    sink_forward_kernel(T* __restrict__ out, const T* __restrict__ lse, const T* __restrict__ sinks, int64_t rows,
                        int seq_len, int n_head, int head_dim) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  if (r >= rows) return;  // warp-uniform
  const int lane = threadIdx.x % kWarp;
  const T g = sink_row_gate(lse, sinks, r, seq_len, n_head);
  T* x = out + r * head_dim;
  for (int d = lane; d < head_dim; d += kWarp) x[d] *= g;
}

template <typename T>
__global__ void __launch_bounds__(kRowWarps* kWarp)
    sink_backward_kernel(T* __restrict__ dout, const T* __restrict__ out, const T* __restrict__ lse,
                         const T* __restrict__ sinks, T* __restrict__ partial, int64_t rows, int seq_len, int n_head,
                         int head_dim) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  if (r >= rows) return;  // warp-uniform
  const int lane = threadIdx.x % kWarp;
  const T g = sink_row_gate(lse, sinks, r, seq_len, n_head);
  T* x = dout + r * head_dim;
  const T* y = out + r * head_dim;
  T acc = 0;
  for (int d = lane; d < head_dim; d += kWarp) acc += x[d] * y[d];
  acc = warp_sum(acc);  // every lane holds the sum
  if (lane == 0) partial[r] = -(T(1) - g) * acc;
  for (int d = lane; d < head_dim; d += kWarp) x[d] *= g;
}

constexpr int kSinkSumThreads = 256;

// A block per head h: thread i sums partial rows i, i + 256, ... of head h in order, then a fixed
// halving tree; dsinks[h] += the total.
template <typename T>
__global__ void __launch_bounds__(kSinkSumThreads)
    sink_sum_kernel(const T* __restrict__ partial, T* __restrict__ dsinks, int64_t bt_rows, int n_head) {
  __shared__ T part[kSinkSumThreads];
  const int h = static_cast<int>(blockIdx.x), i = static_cast<int>(threadIdx.x);
  T acc = 0;
  for (int64_t bt = i; bt < bt_rows; bt += kSinkSumThreads) acc += partial[bt * n_head + h];
  part[i] = acc;
  __syncthreads();
  for (int s = kSinkSumThreads / 2; s > 0; s >>= 1) {
    if (i < s) part[i] += part[i + s];
    __syncthreads();
  }
  if (i == 0) dsinks[h] += part[0];
}

}  // namespace

size_t attention_sink_backward_scratch_bytes(int64_t batch, int64_t seq_len, int64_t n_head, size_t elem_bytes) {
  return static_cast<size_t>(batch * seq_len * n_head) * elem_bytes;
}

template <typename T>
void attention_sink_forward(T* out, const T* lse, const T* sinks, int64_t batch, int64_t seq_len, int64_t n_head,
                            int64_t head_dim, cudaStream_t stream) {
  const int64_t rows = batch * seq_len * n_head;
  if (rows == 0) return;
  LOOM_CHECK(seq_len <= INT_MAX && n_head <= INT_MAX && head_dim <= INT_MAX, "attention_sink_forward: sizes exceed 32 bits");
  launch<sink_forward_kernel<T>>(row_blocks(rows), kRowWarps * kWarp, 0, stream, out, lse, sinks, rows,
                                 static_cast<int>(seq_len), static_cast<int>(n_head), static_cast<int>(head_dim));
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void attention_sink_backward(T* dout, const T* out, const T* lse, const T* sinks, T* dsinks, void* scratch,
                             int64_t batch, int64_t seq_len, int64_t n_head, int64_t head_dim, cudaStream_t stream) {
  const int64_t rows = batch * seq_len * n_head;
  if (rows == 0) return;
  LOOM_CHECK(seq_len <= INT_MAX && n_head <= INT_MAX && head_dim <= INT_MAX, "attention_sink_backward: sizes exceed 32 bits");
  T* partial = static_cast<T*>(scratch);  // (B T, H)
  launch<sink_backward_kernel<T>>(row_blocks(rows), kRowWarps * kWarp, 0, stream, dout, out, lse, sinks, partial, rows,
                                  static_cast<int>(seq_len), static_cast<int>(n_head), static_cast<int>(head_dim));
  LOOM_CUDA_CHECK_LAUNCH();
  launch<sink_sum_kernel<T>>(dim3(static_cast<unsigned>(n_head)), kSinkSumThreads, 0, stream, partial, dsinks,
                             batch * seq_len, static_cast<int>(n_head));
  LOOM_CUDA_CHECK_LAUNCH();
}

// ------------------------------------------------------------------------------------ probabilities-saved path
// GEMM scheme: for each batch element b and group member r in [0, G), one strided-batched call
// over the KV kv heads g (query head h = g G + r): Q_h, O_h, dO_h, dQ_h step by G hd columns,
// K_g, V_g, dK_g, dV_g by hd columns, the (T, T) blocks of probs and scratch by G T T. So
// B G calls of batch KV per GEMM, no permute copies.
//
// Scratch: one batch element's dP/dS, (H, T, T) of T at [h T T, (h + 1) T T) (the same layout
// as that batch element's probs), reused from one b to the next (stream order).
size_t attention_backward_scratch_bytes(int64_t /*batch*/, int64_t seq_len, int64_t n_head, int64_t /*head_dim*/,
                                        size_t elem_bytes) {
  return static_cast<size_t>(n_head) * static_cast<size_t>(seq_len) * static_cast<size_t>(seq_len) * elem_bytes;
}

// S_h = scale Q_h K_g^T into probs (all T x T), masked softmax in place, O_h = P_h V_g.
// With a window, the full S and P V are computed (the zeros of P contribute exact zeros): the
// probs layout is O(T^2) anyway; long sequences with short windows should use the flash path.
template <typename T>
void attention_forward(cublasHandle_t cublas, const T* qkv, T* out, T* probs, int64_t batch, int64_t seq_len,
                       int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t window, cudaStream_t stream) {
  const AttnDims d = attention_dims("attention_forward", batch, seq_len, n_head, n_kv_head, head_dim, window);
  if (d.empty) return;
  const BlasHostScalars host_scalars(cublas);
  const T scale = attention_scale<T>(d.hd);
  const int64_t TT = d.T * d.T;
  for (int64_t b = 0; b < d.B; ++b) {
    const T* base = qkv + b * d.T * d.W;
    for (int64_t r = 0; r < d.G; ++r) {
      // P_h (T, T) = scale Q_h (T, hd; ld W) K_g (T, hd; ld W)^T.
      // Column-major: gemm(T, N, m = T, n = T, k = hd, K_g ld W, Q_h ld W, P_h ld T).
      gemm_rm(cublas, false, true, d.T, d.T, d.hd, scale, base + r * d.hd, d.W, d.G * d.hd, base + d.H * d.hd, d.W,
                 d.hd, T(0), probs + (b * d.H + r) * TT, d.T, d.G * TT, d.KV, "attention_forward: S = scale Q K^T");
    }
  }
  const int64_t rows = d.B * d.H * d.T;
  launch<masked_softmax_kernel<T>>(row_blocks(rows), kRowWarps * kWarp, 0, stream, probs, rows, static_cast<int>(d.T),
                                                                                static_cast<int>(d.window));
  LOOM_CUDA_CHECK_LAUNCH();
  for (int64_t b = 0; b < d.B; ++b) {
    const T* base = qkv + b * d.T * d.W;
    for (int64_t r = 0; r < d.G; ++r) {
      // O_h (T, hd; ld OW) = P_h (T, T; ld T) V_g (T, hd; ld W).
      // Column-major: gemm(N, N, m = hd, n = T, k = T, V_g ld W, P_h ld T, O_h ld OW).
      gemm_rm(cublas, false, false, d.T, d.hd, d.T, T(1), probs + (b * d.H + r) * TT, d.T, d.G * TT,
                 base + (d.H + d.KV) * d.hd, d.W, d.hd, T(0), out + b * d.T * d.OW + r * d.hd, d.OW, d.G * d.hd, d.KV,
                 "attention_forward: O = P V");
    }
  }
}

// Per batch element b: dP_h = dO_h V_g^T into scratch (all H heads), dS in place (row kernel,
// D_i = dO_i . O_i), then per r: dQ_h = dS_h K_g; dK_g (+)= dS_h^T Q_h; dV_g (+)= P_h^T dO_h with
// beta = 0 for r = 0 and 1 after: the group's sum in the order h = g G, g G + 1, ...
template <typename T>
void attention_backward(cublasHandle_t cublas, const T* dout, const T* qkv, const T* out, const T* probs, T* dqkv,
                        void* scratch, int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                        int64_t head_dim, int64_t window, cudaStream_t stream) {
  const AttnDims d = attention_dims("attention_backward", batch, seq_len, n_head, n_kv_head, head_dim, window);
  if (d.empty) return;
  const BlasHostScalars host_scalars(cublas);
  const T scale = attention_scale<T>(d.hd);
  const int64_t TT = d.T * d.T;
  T* ds = static_cast<T*>(scratch);  // (H, T, T)
  for (int64_t b = 0; b < d.B; ++b) {
    const T* base = qkv + b * d.T * d.W;
    T* dbase = dqkv + b * d.T * d.W;
    const T* dobase = dout + b * d.T * d.OW;
    const T* pbase = probs + b * d.H * TT;
    for (int64_t r = 0; r < d.G; ++r) {
      // dP_h (T, T; ld T) = dO_h (T, hd; ld OW) V_g (T, hd; ld W)^T.
      // Column-major: gemm(T, N, m = T, n = T, k = hd, V_g ld W, dO_h ld OW, dP_h ld T).
      gemm_rm(cublas, false, true, d.T, d.T, d.hd, T(1), dobase + r * d.hd, d.OW, d.G * d.hd,
                 base + (d.H + d.KV) * d.hd, d.W, d.hd, T(0), ds + r * TT, d.T, d.G * TT, d.KV,
                 "attention_backward: dP = dO V^T");
    }
    launch<attention_dscores_kernel<T>>(row_blocks(d.H * d.T), kRowWarps * kWarp, 0, stream,
        dout, out, pbase, ds, b, static_cast<int>(d.T), static_cast<int>(d.H), static_cast<int>(d.hd), scale);
    LOOM_CUDA_CHECK_LAUNCH();
    for (int64_t r = 0; r < d.G; ++r) {
      const T beta = r == 0 ? T(0) : T(1);
      // dQ_h (T, hd; ld W) = dS_h (T, T; ld T) K_g (T, hd; ld W).
      // Column-major: gemm(N, N, m = hd, n = T, k = T, K_g ld W, dS_h ld T, dQ_h ld W).
      gemm_rm(cublas, false, false, d.T, d.hd, d.T, T(1), ds + r * TT, d.T, d.G * TT, base + d.H * d.hd, d.W, d.hd,
                 T(0), dbase + r * d.hd, d.W, d.G * d.hd, d.KV, "attention_backward: dQ = dS K");
      // dK_g (T, hd; ld W) (+)= dS_h^T Q_h (T, hd; ld W).
      // Column-major: gemm(N, T, m = hd, n = T, k = T, Q_h ld W, dS_h ld T, dK_g ld W).
      gemm_rm(cublas, true, false, d.T, d.hd, d.T, T(1), ds + r * TT, d.T, d.G * TT, base + r * d.hd, d.W,
                 d.G * d.hd, beta, dbase + d.H * d.hd, d.W, d.hd, d.KV, "attention_backward: dK += dS^T Q");
      // dV_g (T, hd; ld W) (+)= P_h^T dO_h (T, hd; ld OW).
      // Column-major: gemm(N, T, m = hd, n = T, k = T, dO_h ld OW, P_h ld T, dV_g ld W).
      gemm_rm(cublas, true, false, d.T, d.hd, d.T, T(1), pbase + r * TT, d.T, d.G * TT, dobase + r * d.hd, d.OW,
                 d.G * d.hd, beta, dbase + (d.H + d.KV) * d.hd, d.W, d.hd, d.KV, "attention_backward: dV += P^T dO");
    }
  }
}

// ------------------------------------------------------------------------------------ flash path
// Scratch: D (B, H, T) of T.
size_t flash_attention_backward_scratch_bytes(int64_t batch, int64_t seq_len, int64_t n_head, int64_t /*n_kv_head*/,
                                              int64_t /*head_dim*/, size_t elem_bytes) {
  return static_cast<size_t>(batch) * static_cast<size_t>(n_head) * static_cast<size_t>(seq_len) * elem_bytes;
}

template <typename T>
void flash_attention_forward(const T* qkv, T* out, T* lse, int64_t batch, int64_t seq_len, int64_t n_head,
                             int64_t n_kv_head, int64_t head_dim, int64_t window, cudaStream_t stream) {
  const AttnDims d = attention_dims("flash_attention_forward", batch, seq_len, n_head, n_kv_head, head_dim, window);
  LOOM_CHECK(head_dim <= kFlashMaxHeadDim, "flash_attention_forward: head_dim ", head_dim, " > ", kFlashMaxHeadDim,
             " is not supported");
  if (d.empty) return;
  const T scale = attention_scale<T>(d.hd);
  if (d.hd <= 16) launch_flash_forward<T, 16>(qkv, out, lse, d, scale, stream);
  else if (d.hd <= 32) launch_flash_forward<T, 32>(qkv, out, lse, d, scale, stream);
  else if (d.hd <= 64) launch_flash_forward<T, 64>(qkv, out, lse, d, scale, stream);
  else if (d.hd <= 128) launch_flash_forward<T, 128>(qkv, out, lse, d, scale, stream);
  else launch_flash_forward<T, 256>(qkv, out, lse, d, scale, stream);
}

template <typename T>
void flash_attention_backward(const T* dout, const T* qkv, const T* out, const T* lse, T* dqkv, void* scratch,
                              int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim,
                              int64_t window, cudaStream_t stream) {
  const AttnDims d = attention_dims("flash_attention_backward", batch, seq_len, n_head, n_kv_head, head_dim, window);
  LOOM_CHECK(head_dim <= kFlashMaxHeadDim, "flash_attention_backward: head_dim ", head_dim, " > ", kFlashMaxHeadDim,
             " is not supported");
  if (d.empty) return;
  const T scale = attention_scale<T>(d.hd);
  T* dsum = static_cast<T*>(scratch);  // (B, H, T)
  const int64_t rows = d.B * d.T * d.H;
  launch<flash_dsum_kernel<T>>(row_blocks(rows), kRowWarps * kWarp, 0, stream,
      dout, out, dsum, rows, static_cast<int>(d.T), static_cast<int>(d.H), static_cast<int>(d.hd));
  LOOM_CUDA_CHECK_LAUNCH();
  if (d.hd <= 16) launch_flash_backward<T, 16>(dout, qkv, lse, dsum, dqkv, d, scale, stream);
  else if (d.hd <= 32) launch_flash_backward<T, 32>(dout, qkv, lse, dsum, dqkv, d, scale, stream);
  else if (d.hd <= 64) launch_flash_backward<T, 64>(dout, qkv, lse, dsum, dqkv, d, scale, stream);
  else if (d.hd <= 128) launch_flash_backward<T, 128>(dout, qkv, lse, dsum, dqkv, d, scale, stream);
  else launch_flash_backward<T, 256>(dout, qkv, lse, dsum, dqkv, d, scale, stream);
}

// ------------------------------------------------------------------------------------ instantiations
#define LOOM_ATTENTION_INSTANTIATE(T)                                                                                  \
  template void attention_forward<T>(cublasHandle_t, const T*, T*, T*, int64_t, int64_t, int64_t, int64_t, int64_t,   \
                                     int64_t, cudaStream_t);                                                           \
  template void attention_backward<T>(cublasHandle_t, const T*, const T*, const T*, const T*, T*, void*, int64_t,     \
                                      int64_t, int64_t, int64_t, int64_t, int64_t, cudaStream_t);                      \
  template void flash_attention_forward<T>(const T*, T*, T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,    \
                                           cudaStream_t);                                                              \
  template void flash_attention_backward<T>(const T*, const T*, const T*, const T*, T*, void*, int64_t, int64_t,      \
                                            int64_t, int64_t, int64_t, int64_t, cudaStream_t);                          \
  template void attention_sink_forward<T>(T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t, cudaStream_t);  \
  template void attention_sink_backward<T>(T*, const T*, const T*, const T*, T*, void*, int64_t, int64_t, int64_t,    \
                                           int64_t, cudaStream_t);
LOOM_ATTENTION_INSTANTIATE(float)
LOOM_ATTENTION_INSTANTIATE(double)
#undef LOOM_ATTENTION_INSTANTIATE

}  // namespace loom::cuda
