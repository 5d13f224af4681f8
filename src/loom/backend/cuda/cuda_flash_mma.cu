// FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and
// Work Partitioning") on tensor cores: every tile product is mma.sync m16n8k16 with bf16
// operands and fp32 accumulators (cuda_mma.h). Layout, semantics and numerics: cuda_flash_mma.h.
// Notation: B batch, T seq_len, H query heads, KV kv heads, G = H / KV, hd head_dim (64 or 128),
// W = (H + 2 KV) hd (a qkv row), OW = H hd (an out row), scale = 1 / sqrt(hd).
//
// Tiling (FlashAttention-2, section 3.3: the query tile is split across warps, so the softmax
// statistics of a row stay in one warp and no shared-memory exchange between warps is needed):
// every kernel runs 4 warps (128 threads); a warp owns 16 rows (one MMA row block) of a 64-row
// block tile; the operand it keeps for the whole loop (Q in the forward and dQ, K and V in dK/dV,
// dO in dQ) sits in registers as A fragments, read once from global memory and rounded to bf16;
// the streamed operand tiles are rounded to bf16 when stored into shared memory, one bf16 pair
// per 32-bit word, rows padded by 4 words (16 bytes) so that a warp's fragment loads hit 32
// distinct banks. A product's C fragments, rounded to bf16 pairwise, are the next product's A
// fragment (cuda_mma.h: acc_to_a), so P and dS never leave registers.
//
//   forward   grid (ceil(T / 64), H, B), latest query tiles first. Key/value tiles of 64 rows.
//             Per warp and tile: S (16 x 64) = Q K^T (8 n-tiles x hd/16 k-steps), mask, online
//             softmax in fp32 (row max and sum over the 4 lanes of a group), O (16 x hd) += P V.
//   dK, dV    grid (ceil(T / 64), KV, B). A warp owns 16 keys; it streams the group's query
//             heads h = g G .. g G + G - 1 in order, query tiles of kBq rows (64; 16 for hd 128)
//             from the block's first key on: S^T = K Q^T, dP^T = V dO^T, P^T = exp(scale S^T -
//             lse), dS^T = P^T o (dP^T - D); dV += P^T dO, dK += dS^T Q; dK is scaled at the end.
//             K and V are A fragments in registers (hd 64) or bf16 tiles in shared memory (hd 128,
//             where registers spilled).
//   dQ        grid (ceil(T / 64), H, B) like the forward, key tiles of kBc rows (64; 32 for hd
//             128): S = Q K^T, dP = dO V^T, dS = P o (dP - D), dQ += dS K, scaled at the end.
//   D         D = rowsum(dO o O) in fp32, one warp per (b, t, h) row.
// Fully masked MMA tiles above the diagonal are skipped (a warp-uniform test).
#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)

#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_flash_mma.h"
#include "loom/backend/cuda/cuda_launch.h"
#include "loom/backend/cuda/cuda_mma.h"
#include "loom/core/error.h"

namespace loom::cuda {
namespace {

using mma::acc_to_a;
using mma::mma_m16n8k16_bf16;
using mma::pack_bf16x2;
using mma::pair_bf16;

constexpr int kWarpSize = kWarp;  // cuda_device.h's logical warp
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kWarpRows = 16;                    // rows of one MMA A block
constexpr int kBlockRows = kWarps * kWarpRows;   // 64: queries (forward, dQ) or keys (dK/dV) per block
constexpr int kDsumWarps = 8;                    // rows per block of the D kernel

// 32-bit words per padded shared row of kHd bf16.
template <int kHd>
__host__ __device__ constexpr int words() {
  return kHd / 2 + 4;
}
// Streamed rows per tile. The dQ kernel keeps Q, dO (A fragments: hd / 16 x 4 registers each)
// and dQ (hd / 8 x 4) in registers per lane, so its key tiles are halved for hd 128. The dK/dV
// kernel keeps K, V, dK and dV (384 registers' worth at hd 128 without its streamed tiles), so
// its query tiles are 16 rows there: with 32, ptxas spilled 144 bytes per thread.
template <int kHd>
__host__ __device__ constexpr int stream_rows() {
  return kHd == 128 ? 32 : 64;
}
template <int kHd>
__host__ __device__ constexpr int dkdv_rows() {
  return kHd == 128 ? 16 : 64;
}
// Whether the dK/dV kernel reads its K and V A fragments from shared memory at each use rather
// than keeping them in registers: at hd 128 the registers spilled (48 bytes per thread at 255
// registers, even with 16-row query tiles); shared K and V (2 x 17 KB) leave none.
template <int kHd>
__host__ __device__ constexpr bool dkdv_kv_shared() {
  return kHd == 128;
}

// ---------------------------------------------------------------- loads
// Rows [r0, r0 + kRows) of a row-major f32 matrix (leading dimension ld, kHd columns from src)
// into a shared bf16 tile, one word (two columns) per thread and step; rows >= r_end are 0.
template <int kRows, int kHd>
__device__ __forceinline__ void load_tile(uint32_t (*tile)[words<kHd>()], const float* __restrict__ src, int64_t ld,
                                          int r0, int r_end) {
  constexpr int kW = kHd / 2;
  for (int idx = static_cast<int>(threadIdx.x); idx < kRows * kW; idx += kThreads) {
    const int rr = idx / kW, w = idx % kW, r = r0 + rr;
    uint32_t v = 0;
    if (r < r_end) {
      const float* p = src + static_cast<int64_t>(r) * ld + 2 * w;
      v = pack_bf16x2(p[0], p[1]);
    }
    tile[rr][w] = v;
  }
}

// The A fragments (16 rows from r0, all kHd columns: kHd / 16 k-steps) of a row-major f32
// matrix, straight from global memory, rounded to bf16; rows >= r_end are 0.
template <int kHd>
__device__ __forceinline__ void load_a_frags(uint32_t (&a)[kHd / 16][4], const float* __restrict__ src, int64_t ld,
                                             int r0, int r_end, int g, int t) {
#pragma unroll
  for (int ks = 0; ks < kHd / 16; ++ks) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = r0 + g + (j & 1) * 8;           // a[1], a[3]: row g + 8
      const int c = ks * 16 + 2 * t + (j >> 1) * 8;  // a[2], a[3]: columns + 8
      const float* p = src + static_cast<int64_t>(r) * ld + c;
      a[ks][j] = r < r_end ? pack_bf16x2(p[0], p[1]) : 0u;
    }
  }
}

// The A fragment (16 x 16) with A(m, k) = tile[m0 + m][k0 + k] (k0 even).
template <int kW>
__device__ __forceinline__ void a_from_rows(uint32_t (&a)[4], const uint32_t (*tile)[kW], int m0, int k0, int g,
                                            int t) {
  a[0] = tile[m0 + g][k0 / 2 + t];
  a[1] = tile[m0 + g + 8][k0 / 2 + t];
  a[2] = tile[m0 + g][k0 / 2 + t + 4];
  a[3] = tile[m0 + g + 8][k0 / 2 + t + 4];
}

// B (16 x 8) with B(k, n) = tile[n0 + n][k0 + k]: a tile row is a B column, so each register is
// one shared word (k0 even).
template <int kW>
__device__ __forceinline__ void b_from_rows(uint32_t (&b)[2], const uint32_t (*tile)[kW], int n0, int k0, int g,
                                            int t) {
  b[0] = tile[n0 + g][k0 / 2 + t];
  b[1] = tile[n0 + g][k0 / 2 + t + 4];
}

__device__ __forceinline__ uint32_t half_of(uint32_t word, int odd) { return odd ? word >> 16 : word & 0xffffu; }

// B (16 x 8) with B(k, n) = tile[k0 + k][n0 + n]: a register pairs two tile rows.
template <int kW>
__device__ __forceinline__ void b_from_cols(uint32_t (&b)[2], const uint32_t (*tile)[kW], int k0, int n0, int g,
                                            int t) {
  const int n = n0 + g, w = n >> 1, odd = n & 1;
  b[0] = pair_bf16(half_of(tile[k0 + 2 * t][w], odd), half_of(tile[k0 + 2 * t + 1][w], odd));
  b[1] = pair_bf16(half_of(tile[k0 + 2 * t + 8][w], odd), half_of(tile[k0 + 2 * t + 9][w], odd));
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, shfl_xor(v, 1));
  return fmaxf(v, shfl_xor(v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {  // the same bits on the 4 lanes
  v += shfl_xor(v, 1);
  return v + shfl_xor(v, 2);
}

// O's element: f32, or bf16 bits rounded to nearest even (the bits of the backend's cast:
// precision.activations = bf16 keeps O in bf16 for the output projection, which reads it so).
__device__ __forceinline__ void store_o(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_o(uint16_t* p, float v) { *p = bf16_bits(v); }
__device__ __forceinline__ float load_o(const float* p) { return *p; }
__device__ __forceinline__ float load_o(const uint16_t* p) { return bf16_value(*p); }

// ---------------------------------------------------------------- forward
template <int kHd, bool kCausal, typename O>
__global__ void __launch_bounds__(kThreads)
    flash_mma_forward_kernel(const float* __restrict__ qkv, O* __restrict__ out, float* __restrict__ lse,
                             int seq_len, int n_head, int n_kv_head, float scale) {
  constexpr int kW = words<kHd>();
  constexpr int kBc = 64;        // keys per tile
  constexpr int kKs = kHd / 16;  // k-steps of S = Q K^T
  constexpr int kNt = kBc / 8;   // key n-tiles of S
  constexpr int kDt = kHd / 8;   // dim n-tiles of O
  __shared__ __align__(16) uint32_t ks[kBc][kW];
  __shared__ __align__(16) uint32_t vs[kBc][kW];

  const int n_tiles = (seq_len + kBlockRows - 1) / kBlockRows;
  const int i0 = (n_tiles - 1 - static_cast<int>(blockIdx.x)) * kBlockRows;
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int kvh = h / (n_head / n_kv_head);
  const int64_t width = static_cast<int64_t>(n_head + 2 * n_kv_head) * kHd;
  const int64_t out_width = static_cast<int64_t>(n_head) * kHd;
  const float* base = qkv + static_cast<int64_t>(b) * seq_len * width;
  const float* kbase = base + static_cast<int64_t>(n_head + kvh) * kHd;
  const float* vbase = base + static_cast<int64_t>(n_head + n_kv_head + kvh) * kHd;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = mma::group_id(lane), t = mma::thread_in_group(lane);
  const int r0 = i0 + warp * kWarpRows;  // the warp's rows r0 + g and r0 + g + 8
  const int r_last = r0 + kWarpRows - 1;
  const bool warp_live = r0 < seq_len;  // the last block's warps past T only load tiles

  uint32_t qa[kKs][4];
  load_a_frags<kHd>(qa, base + static_cast<int64_t>(h) * kHd, width, r0, seq_len, g, t);
  float o[kDt][4];
#pragma unroll
  for (int dt = 0; dt < kDt; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  float m[2] = {-CUDART_INF_F, -CUDART_INF_F}, l[2] = {0.0f, 0.0f};  // l: this lane's part of the row sum

  const int hi = kCausal ? min(seq_len, i0 + kBlockRows) : seq_len;
  for (int j0 = 0; j0 < hi; j0 += kBc) {
    __syncthreads();  // the previous tile is no longer read
    load_tile<kBc, kHd>(ks, kbase, width, j0, hi);
    load_tile<kBc, kHd>(vs, vbase, width, j0, hi);
    __syncthreads();

    float s[kNt][4];
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      if (!warp_live || j0 + nt * 8 >= hi || (kCausal && j0 + nt * 8 > r_last)) continue;  // warp-uniform: masked
#pragma unroll
      for (int kk = 0; kk < kKs; ++kk) {
        uint32_t bk[2];
        b_from_rows<kW>(bk, ks, nt * 8, kk * 16, g, t);
        mma_m16n8k16_bf16(s[nt], qa[kk], bk, s[nt]);
      }
    }
    // Scale and mask; online softmax per row r (0: r0 + g, 1: r0 + g + 8).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r0 + g + 8 * r;
      float mx = m[r];
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = j0 + nt * 8 + 2 * t + e;
          const bool ok = col < hi && (!kCausal || col <= row);
          float& x = s[nt][2 * r + e];
          x = ok ? x * scale : -CUDART_INF_F;
          mx = fmaxf(mx, x);
        }
      }
      mx = quad_max(mx);
      const float m_use = mx == -CUDART_INF_F ? 0.0f : mx;  // no key yet: keep exp away from -inf - -inf
      const float corr = expf(m[r] - m_use);                // 0 while m = -inf (l and o are 0 then)
      l[r] *= corr;
#pragma unroll
      for (int dt = 0; dt < kDt; ++dt) {
        o[dt][2 * r] *= corr;
        o[dt][2 * r + 1] *= corr;
      }
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[nt][2 * r + e];
          x = expf(x - m_use);  // exp(-inf) = 0 off the mask
          l[r] += x;
        }
      }
      m[r] = mx;
    }
    // O += P V: P (16 x 64) as 4 k-steps of A fragments, V (64 x hd) as B.
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      if (!warp_live || j0 + kk * 16 >= hi || (kCausal && j0 + kk * 16 > r_last)) continue;  // P is 0 there
      uint32_t pa[4];
      acc_to_a(pa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dt = 0; dt < kDt; ++dt) {
        uint32_t bv[2];
        b_from_cols<kW>(bv, vs, kk * 16, dt * 8, g, t);
        mma_m16n8k16_bf16(o[dt], pa, bv, o[dt]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lsum = quad_sum(l[r]);
    const int row = r0 + g + 8 * r;
    if (row < seq_len) {  // every causal row saw key 0, so lsum >= 1
      const float inv = 1.0f / lsum;
      O* dst = out + (static_cast<int64_t>(b) * seq_len + row) * out_width + static_cast<int64_t>(h) * kHd;
#pragma unroll
      for (int dt = 0; dt < kDt; ++dt) {
        store_o(dst + dt * 8 + 2 * t, o[dt][2 * r] * inv);
        store_o(dst + dt * 8 + 2 * t + 1, o[dt][2 * r + 1] * inv);
      }
      if (t == 0) lse[(static_cast<int64_t>(b) * n_head + h) * seq_len + row] = m[r] + logf(lsum);
    }
  }
}

// ---------------------------------------------------------------- backward
// D[b, h, i] = dO[b, i, h] . O[b, i, h] in fp32; one warp per (b, i, h) row, lane-strided then a
// fixed shuffle tree.
template <typename O>
__global__ void __launch_bounds__(kDsumWarps* kWarpSize)
    flash_mma_dsum_kernel(const float* __restrict__ dout, const O* __restrict__ out, float* __restrict__ dsum,
                          int64_t rows, int seq_len, int n_head, int head_dim) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kDsumWarps + threadIdx.x / kWarpSize;
  if (r >= rows) return;  // warp-uniform
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const float* x = dout + r * head_dim;
  const O* y = out + r * head_dim;
  float acc = 0.0f;
  for (int d = lane; d < head_dim; d += kWarpSize) acc += x[d] * load_o(y + d);
  acc = warp_sum(acc);
  const int64_t bt = r / n_head, h = r % n_head, b = bt / seq_len, i = bt % seq_len;
  if (lane == 0) dsum[(b * n_head + h) * seq_len + i] = acc;
}

template <int kHd, bool kCausal, typename G>
__global__ void __launch_bounds__(kThreads, 1)
    flash_mma_dkdv_kernel(const float* __restrict__ dout, const float* __restrict__ qkv,
                          const float* __restrict__ lse, const float* __restrict__ dsum, G* __restrict__ dqkv,
                          int seq_len, int n_head, int n_kv_head, float scale) {
  constexpr int kW = words<kHd>();
  constexpr int kBq = dkdv_rows<kHd>();  // queries per tile
  constexpr int kKs = kHd / 16;
  constexpr int kQt = kBq / 8;  // query n-tiles of S^T
  constexpr int kDt = kHd / 8;
  __shared__ __align__(16) uint32_t qs[kBq][kW];
  __shared__ __align__(16) uint32_t dos[kBq][kW];
  __shared__ float lses[kBq];
  __shared__ float dsums[kBq];
  constexpr bool kKvShared = dkdv_kv_shared<kHd>();
  __shared__ __align__(16) uint32_t kts[kKvShared ? kBlockRows : 1][kW];  // the block's keys and values
  __shared__ __align__(16) uint32_t vts[kKvShared ? kBlockRows : 1][kW];

  const int j0 = static_cast<int>(blockIdx.x) * kBlockRows;
  const int kvh = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int group = n_head / n_kv_head;
  const int64_t width = static_cast<int64_t>(n_head + 2 * n_kv_head) * kHd;
  const int64_t out_width = static_cast<int64_t>(n_head) * kHd;
  const float* base = qkv + static_cast<int64_t>(b) * seq_len * width;
  const int64_t kcol = static_cast<int64_t>(n_head + kvh) * kHd;
  const int64_t vcol = static_cast<int64_t>(n_head + n_kv_head + kvh) * kHd;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = mma::group_id(lane), t = mma::thread_in_group(lane);
  const int k0 = j0 + warp * kWarpRows;  // the warp's keys k0 + g and k0 + g + 8
  const bool warp_live = k0 < seq_len;

  uint32_t ka[kKvShared ? 1 : kKs][4], va[kKvShared ? 1 : kKs][4];
  if constexpr (kKvShared) {  // read by every warp only after the first tile's barrier
    load_tile<kBlockRows, kHd>(kts, base + kcol, width, j0, seq_len);
    load_tile<kBlockRows, kHd>(vts, base + vcol, width, j0, seq_len);
  } else {
    load_a_frags<kHd>(ka, base + kcol, width, k0, seq_len, g, t);
    load_a_frags<kHd>(va, base + vcol, width, k0, seq_len, g, t);
  }
  float dk[kDt][4], dv[kDt][4];
#pragma unroll
  for (int dt = 0; dt < kDt; ++dt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.0f;
  }

  const int qlo = kCausal ? j0 : 0;
  for (int r = 0; r < group; ++r) {
    const int h = kvh * group + r;
    const float* qsrc = base + static_cast<int64_t>(h) * kHd;
    const float* dosrc = dout + static_cast<int64_t>(b) * seq_len * out_width + static_cast<int64_t>(h) * kHd;
    const float* lse_h = lse + (static_cast<int64_t>(b) * n_head + h) * seq_len;
    const float* dsum_h = dsum + (static_cast<int64_t>(b) * n_head + h) * seq_len;
    for (int i0 = qlo; i0 < seq_len; i0 += kBq) {
      __syncthreads();  // the previous tile is no longer read
      load_tile<kBq, kHd>(qs, qsrc + static_cast<int64_t>(i0) * width, width, 0, seq_len - i0);
      load_tile<kBq, kHd>(dos, dosrc + static_cast<int64_t>(i0) * out_width, out_width, 0, seq_len - i0);
      if (static_cast<int>(threadIdx.x) < kBq) {
        const int i = i0 + static_cast<int>(threadIdx.x);
        lses[threadIdx.x] = i < seq_len ? lse_h[i] : 0.0f;
        dsums[threadIdx.x] = i < seq_len ? dsum_h[i] : 0.0f;
      }
      __syncthreads();

      // S^T (16 keys x kBq queries) = K Q^T, dP^T = V dO^T.
      float st[kQt][4], dpt[kQt][4];
#pragma unroll
      for (int nt = 0; nt < kQt; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
        // warp-uniform: no key of the warp, no query of the n-tile, or every query before every key
        if (!warp_live || i0 + nt * 8 >= seq_len || (kCausal && i0 + nt * 8 + 7 < k0)) continue;
#pragma unroll
        for (int kk = 0; kk < kKs; ++kk) {
          uint32_t bq[2], bo[2];
          b_from_rows<kW>(bq, qs, nt * 8, kk * 16, g, t);
          b_from_rows<kW>(bo, dos, nt * 8, kk * 16, g, t);
          if constexpr (kKvShared) {
            uint32_t a[4];
            a_from_rows<kW>(a, kts, warp * kWarpRows, kk * 16, g, t);
            mma_m16n8k16_bf16(st[nt], a, bq, st[nt]);
            a_from_rows<kW>(a, vts, warp * kWarpRows, kk * 16, g, t);
            mma_m16n8k16_bf16(dpt[nt], a, bo, dpt[nt]);
          } else {
            mma_m16n8k16_bf16(st[nt], ka[kk], bq, st[nt]);
            mma_m16n8k16_bf16(dpt[nt], va[kk], bo, dpt[nt]);
          }
        }
      }
      // P^T = exp(scale S^T - lse) (0 off the mask), dS^T = P^T o (dP^T - D), in place.
#pragma unroll
      for (int nt = 0; nt < kQt; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + g + (e >= 2 ? 8 : 0);
          const int qq = nt * 8 + 2 * t + (e & 1), q = i0 + qq;
          const bool ok = key < seq_len && q < seq_len && (!kCausal || q >= key);
          const float p = ok ? expf(st[nt][e] * scale - lses[qq]) : 0.0f;
          st[nt][e] = p;
          dpt[nt][e] = p * (dpt[nt][e] - dsums[qq]);
        }
      }
      // dV += P^T dO, dK += dS^T Q (k = the tile's queries).
#pragma unroll
      for (int kk = 0; kk < kBq / 16; ++kk) {
        // warp-uniform: P^T and dS^T are 0 there
        if (!warp_live || i0 + kk * 16 >= seq_len || (kCausal && i0 + kk * 16 + 15 < k0)) continue;
        uint32_t pa[4], dsa[4];
        acc_to_a(pa, st[2 * kk], st[2 * kk + 1]);
        acc_to_a(dsa, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
        for (int dt = 0; dt < kDt; ++dt) {
          uint32_t bo[2], bq[2];
          b_from_cols<kW>(bo, dos, kk * 16, dt * 8, g, t);
          b_from_cols<kW>(bq, qs, kk * 16, dt * 8, g, t);
          mma_m16n8k16_bf16(dv[dt], pa, bo, dv[dt]);
          mma_m16n8k16_bf16(dk[dt], dsa, bq, dk[dt]);
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = k0 + g + 8 * r;
    if (key < seq_len) {
      G* dst = dqkv + (static_cast<int64_t>(b) * seq_len + key) * width;
#pragma unroll
      for (int dt = 0; dt < kDt; ++dt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          store_o(dst + kcol + dt * 8 + 2 * t + e, dk[dt][2 * r + e] * scale);
          store_o(dst + vcol + dt * 8 + 2 * t + e, dv[dt][2 * r + e]);
        }
      }
    }
  }
}

template <int kHd, bool kCausal, typename G>
__global__ void __launch_bounds__(kThreads, 1)
    flash_mma_dq_kernel(const float* __restrict__ dout, const float* __restrict__ qkv, const float* __restrict__ lse,
                        const float* __restrict__ dsum, G* __restrict__ dqkv, int seq_len, int n_head,
                        int n_kv_head, float scale) {
  constexpr int kW = words<kHd>();
  constexpr int kBc = stream_rows<kHd>();  // keys per tile
  constexpr int kKs = kHd / 16;
  constexpr int kNt = kBc / 8;
  constexpr int kDt = kHd / 8;
  __shared__ __align__(16) uint32_t ks[kBc][kW];
  __shared__ __align__(16) uint32_t vs[kBc][kW];

  const int n_tiles = (seq_len + kBlockRows - 1) / kBlockRows;
  const int i0 = (n_tiles - 1 - static_cast<int>(blockIdx.x)) * kBlockRows;
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int kvh = h / (n_head / n_kv_head);
  const int64_t width = static_cast<int64_t>(n_head + 2 * n_kv_head) * kHd;
  const int64_t out_width = static_cast<int64_t>(n_head) * kHd;
  const float* base = qkv + static_cast<int64_t>(b) * seq_len * width;
  const float* kbase = base + static_cast<int64_t>(n_head + kvh) * kHd;
  const float* vbase = base + static_cast<int64_t>(n_head + n_kv_head + kvh) * kHd;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = mma::group_id(lane), t = mma::thread_in_group(lane);
  const int r0 = i0 + warp * kWarpRows;
  const int r_last = r0 + kWarpRows - 1;
  const bool warp_live = r0 < seq_len;  // the last block's warps past T only load tiles

  uint32_t qa[kKs][4], doa[kKs][4];
  load_a_frags<kHd>(qa, base + static_cast<int64_t>(h) * kHd, width, r0, seq_len, g, t);
  load_a_frags<kHd>(doa, dout + static_cast<int64_t>(b) * seq_len * out_width + static_cast<int64_t>(h) * kHd,
                    out_width, r0, seq_len, g, t);
  float lse_r[2], dsum_r[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r0 + g + 8 * r;
    const int64_t at = (static_cast<int64_t>(b) * n_head + h) * seq_len + row;
    lse_r[r] = row < seq_len ? lse[at] : 0.0f;
    dsum_r[r] = row < seq_len ? dsum[at] : 0.0f;
  }
  float dq[kDt][4];
#pragma unroll
  for (int dt = 0; dt < kDt; ++dt) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.0f;

  const int hi = kCausal ? min(seq_len, i0 + kBlockRows) : seq_len;
  for (int j0 = 0; j0 < hi; j0 += kBc) {
    __syncthreads();
    load_tile<kBc, kHd>(ks, kbase, width, j0, hi);
    load_tile<kBc, kHd>(vs, vbase, width, j0, hi);
    __syncthreads();

    // S = Q K^T, dP = dO V^T (16 queries x kBc keys).
    float s[kNt][4], dp[kNt][4];
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
      if (!warp_live || j0 + nt * 8 >= hi || (kCausal && j0 + nt * 8 > r_last)) continue;  // warp-uniform: masked
#pragma unroll
      for (int kk = 0; kk < kKs; ++kk) {
        uint32_t bk[2], bv[2];
        b_from_rows<kW>(bk, ks, nt * 8, kk * 16, g, t);
        b_from_rows<kW>(bv, vs, nt * 8, kk * 16, g, t);
        mma_m16n8k16_bf16(s[nt], qa[kk], bk, s[nt]);
        mma_m16n8k16_bf16(dp[nt], doa[kk], bv, dp[nt]);
      }
    }
    // dS = P o (dP - D), P = exp(scale S - lse) (0 off the mask), in s.
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = r0 + g + (e >= 2 ? 8 : 0);
        const int col = j0 + nt * 8 + 2 * t + (e & 1);
        const bool ok = row < seq_len && col < hi && (!kCausal || col <= row);
        const float p = ok ? expf(s[nt][e] * scale - lse_r[e >> 1]) : 0.0f;
        s[nt][e] = p * (dp[nt][e] - dsum_r[e >> 1]);
      }
    }
    // dQ += dS K.
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      if (!warp_live || j0 + kk * 16 >= hi || (kCausal && j0 + kk * 16 > r_last)) continue;  // dS is 0 there
      uint32_t dsa[4];
      acc_to_a(dsa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dt = 0; dt < kDt; ++dt) {
        uint32_t bk[2];
        b_from_cols<kW>(bk, ks, kk * 16, dt * 8, g, t);
        mma_m16n8k16_bf16(dq[dt], dsa, bk, dq[dt]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r0 + g + 8 * r;
    if (row < seq_len) {
      G* dst = dqkv + (static_cast<int64_t>(b) * seq_len + row) * width + static_cast<int64_t>(h) * kHd;
#pragma unroll
      for (int dt = 0; dt < kDt; ++dt) {
        store_o(dst + dt * 8 + 2 * t, dq[dt][2 * r] * scale);
        store_o(dst + dt * 8 + 2 * t + 1, dq[dt][2 * r + 1] * scale);
      }
    }
  }
}

// ---------------------------------------------------------------- launchers
struct Dims {
  int T, H, KV, hd;
  bool empty;
};

Dims check_dims(const char* op, int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim,
                int64_t window) {
  LOOM_CHECK(batch >= 0 && seq_len >= 0, op, ": batch and seq_len must be >= 0, got ", batch, ", ", seq_len);
  LOOM_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0, op,
             ": n_head must be a positive multiple of n_kv_head, got ", n_head, " and ", n_kv_head);
  LOOM_CHECK(head_dim == 64 || head_dim == 128, op, ": head_dim ", head_dim,
             " is not supported by the tensor-core kernels (64 or 128)");
  LOOM_CHECK(window == 0, op, ": a sliding window (window = ", window,
             ") is not supported by the tensor-core kernels");
  LOOM_CHECK((n_head + 2 * n_kv_head) * head_dim <= INT_MAX && seq_len <= INT_MAX - 2 * kBlockRows, op,
             ": row width or seq_len exceeds the kernels' 32-bit sizes");
  LOOM_CHECK(n_head <= 65535 && n_kv_head <= 65535 && batch <= 65535, op, ": n_head (", n_head, ") and batch (", batch,
             ") must be <= 65535 (grid dimensions)");
  return Dims{static_cast<int>(seq_len), static_cast<int>(n_head), static_cast<int>(n_kv_head),
              static_cast<int>(head_dim), batch == 0 || seq_len == 0};
}

float attention_scale(int hd) { return 1.0f / std::sqrt(static_cast<float>(hd)); }

template <int kHd, bool kCausal, typename O>
void forward_hd(const float* qkv, O* out, float* lse, int64_t batch, const Dims& d, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((d.T + kBlockRows - 1) / kBlockRows), static_cast<unsigned>(d.H),
                  static_cast<unsigned>(batch));
  launch<flash_mma_forward_kernel<kHd, kCausal, O>>(grid, kThreads, 0, stream, qkv, out, lse, d.T, d.H, d.KV,
                                                 attention_scale(kHd));
  LOOM_CUDA_CHECK_LAUNCH();
}

template <int kHd, bool kCausal, typename G>
void backward_hd(const float* dout, const float* qkv, const float* dsum, const float* lse, G* dqkv, int64_t batch,
                 const Dims& d, cudaStream_t stream) {
  const unsigned tiles = static_cast<unsigned>((d.T + kBlockRows - 1) / kBlockRows);
  const float scale = attention_scale(kHd);
  launch<flash_mma_dkdv_kernel<kHd, kCausal, G>>(dim3(tiles, static_cast<unsigned>(d.KV), static_cast<unsigned>(batch)),
                                              kThreads, 0, stream, dout, qkv, lse, dsum, dqkv, d.T, d.H, d.KV, scale);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<flash_mma_dq_kernel<kHd, kCausal, G>>(dim3(tiles, static_cast<unsigned>(d.H), static_cast<unsigned>(batch)),
                                            kThreads, 0, stream, dout, qkv, lse, dsum, dqkv, d.T, d.H, d.KV, scale);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename O>
void forward_o(const float* qkv, O* out, float* lse, int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
               int64_t head_dim, int64_t window, cudaStream_t stream, bool causal, const char* op) {
  const Dims d = check_dims(op, batch, seq_len, n_head, n_kv_head, head_dim, window);
  if (d.empty) return;
  if (d.hd == 64) {
    if (causal) forward_hd<64, true, O>(qkv, out, lse, batch, d, stream);
    else forward_hd<64, false, O>(qkv, out, lse, batch, d, stream);
  } else {
    if (causal) forward_hd<128, true, O>(qkv, out, lse, batch, d, stream);
    else forward_hd<128, false, O>(qkv, out, lse, batch, d, stream);
  }
}

template <typename O, typename G>
void backward_o(const float* dout, const float* qkv, const O* out, const float* lse, G* dqkv, void* scratch,
                int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t window,
                cudaStream_t stream, bool causal, const char* op) {
  const Dims d = check_dims(op, batch, seq_len, n_head, n_kv_head, head_dim, window);
  if (d.empty) return;
  float* dsum = static_cast<float*>(scratch);  // (B, H, T)
  const int64_t rows = batch * seq_len * n_head;
  launch<flash_mma_dsum_kernel<O>>(static_cast<unsigned>((rows + kDsumWarps - 1) / kDsumWarps),
                                   kDsumWarps * kWarpSize, 0, stream, dout, out, dsum, rows, d.T, d.H, d.hd);
  LOOM_CUDA_CHECK_LAUNCH();
  if (d.hd == 64) {
    if (causal) backward_hd<64, true, G>(dout, qkv, dsum, lse, dqkv, batch, d, stream);
    else backward_hd<64, false, G>(dout, qkv, dsum, lse, dqkv, batch, d, stream);
  } else {
    if (causal) backward_hd<128, true, G>(dout, qkv, dsum, lse, dqkv, batch, d, stream);
    else backward_hd<128, false, G>(dout, qkv, dsum, lse, dqkv, batch, d, stream);
  }
}

}  // namespace

void flash_mma_attention_forward(const float* qkv, float* out, float* lse, int64_t batch, int64_t seq_len,
                                 int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t window,
                                 cudaStream_t stream, bool causal) {
  forward_o(qkv, out, lse, batch, seq_len, n_head, n_kv_head, head_dim, window, stream, causal,
            "flash_mma_attention_forward");
}

void flash_mma_attention_forward_bf16_out(const float* qkv, uint16_t* out, float* lse, int64_t batch, int64_t seq_len,
                                          int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t window,
                                          cudaStream_t stream) {
  forward_o(qkv, out, lse, batch, seq_len, n_head, n_kv_head, head_dim, window, stream, true,
            "flash_mma_attention_forward_bf16_out");
}

size_t flash_mma_attention_backward_scratch_bytes(int64_t batch, int64_t seq_len, int64_t n_head,
                                                  int64_t /*n_kv_head*/, int64_t /*head_dim*/) {
  return static_cast<size_t>(batch) * static_cast<size_t>(n_head) * static_cast<size_t>(seq_len) * sizeof(float);
}

void flash_mma_attention_backward(const float* dout, const float* qkv, const float* out, const float* lse,
                                  float* dqkv, void* scratch, int64_t batch, int64_t seq_len, int64_t n_head,
                                  int64_t n_kv_head, int64_t head_dim, int64_t window, cudaStream_t stream,
                                  bool causal) {
  backward_o(dout, qkv, out, lse, dqkv, scratch, batch, seq_len, n_head, n_kv_head, head_dim, window, stream, causal,
             "flash_mma_attention_backward");
}

template <typename O, typename G>
void flash_mma_attention_backward_as(const float* dout, const float* qkv, const O* out, const float* lse, G* dqkv,
                                     void* scratch, int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                                     int64_t head_dim, int64_t window, cudaStream_t stream) {
  backward_o(dout, qkv, out, lse, dqkv, scratch, batch, seq_len, n_head, n_kv_head, head_dim, window, stream, true,
             "flash_mma_attention_backward");
}
#define LOOM_FLASH_MMA_BACKWARD_AS(O, G)                                                                           \
  template void flash_mma_attention_backward_as<O, G>(const float*, const float*, const O*, const float*, G*, void*, \
                                                      int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,          \
                                                      cudaStream_t);
LOOM_FLASH_MMA_BACKWARD_AS(uint16_t, float)
LOOM_FLASH_MMA_BACKWARD_AS(float, uint16_t)
LOOM_FLASH_MMA_BACKWARD_AS(uint16_t, uint16_t)
#undef LOOM_FLASH_MMA_BACKWARD_AS

}  // namespace loom::cuda
