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
// the streamed operand tiles are read in 16-byte chunks of 8 elements (f32 or bf16 inputs, a
// thread's chunks in batches of 64 bytes in flight before their stores) and stored into shared memory in bf16, one
// bf16 pair per 32-bit word, rows padded by 4 words (16 bytes) so that the eight 16-byte rows of
// an ldmatrix phase hit distinct banks. Fragments come out of the tiles by ldmatrix.x4 (cuda_mma.h:
// two B fragments, or an A fragment, per instruction; .trans for the operands stored k-major: V in
// P V, dO in dV, Q in dK, K in dQ) instead of one 32-bit load per register (two 16-bit ones and a
// merge for the k-major operands). A product's C fragments, rounded to bf16 pairwise, are the next
// product's A fragment (cuda_mma.h: acc_to_a), so P and dS never leave registers.
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
#include <type_traits>

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
// The inputs (qkv, dO) are f32, or bf16 (the bits, as uint16_t) where the producing GEMM wrote
// them so (precision.outputs = bf16): either way the products read them rounded to bf16, so a bf16
// input gives the same bits as its f32 source. Rows are read in chunks of 8 elements (32 or 16
// bytes: every row and head offset is a multiple of 8 elements, the launchers check the bases'
// 16-byte alignment), a thread's chunks in batches of 64 bytes in flight before their stores.
__device__ __forceinline__ uint4 load_chunk(const float* __restrict__ p) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  return make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y), pack_bf16x2(b.z, b.w));
}
__device__ __forceinline__ uint4 load_chunk(const uint16_t* __restrict__ p) { return *reinterpret_cast<const uint4*>(p); }
// Elements c, c + 1 of a row as one bf16 pair (c even).
__device__ __forceinline__ uint32_t load_pair(const float* __restrict__ p) {
  const float2 v = *reinterpret_cast<const float2*>(p);
  return pack_bf16x2(v.x, v.y);
}
__device__ __forceinline__ uint32_t load_pair(const uint16_t* __restrict__ p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// Rows [r0, r0 + kRows) of a row-major matrix (leading dimension ld, kHd columns from src) into
// a shared bf16 tile, a chunk of 8 columns (one 16-byte shared store) per thread and step; rows
// >= r_end are 0.
template <int kRows, int kHd, typename In>
__device__ __forceinline__ void load_tile(uint32_t (*tile)[words<kHd>()], const In* __restrict__ src, int64_t ld,
                                          int r0, int r_end) {
  constexpr int kChunks = kHd / 8;
  constexpr int kSteps = kRows * kChunks / kThreads;
  // Chunks in flight per thread: 4 of bf16 (64 bytes) or 2 of f32 (also 64 bytes; 4 spilled the
  // hd-128 forward's registers).
  constexpr int kMax = sizeof(In) == 2 ? 4 : 2;
  constexpr int kBatch = kSteps < kMax ? kSteps : kMax;
  static_assert(kRows * kChunks % kThreads == 0 && kSteps % kBatch == 0, "a tile's chunks divide among the threads");
#pragma unroll
  for (int s0 = 0; s0 < kSteps; s0 += kBatch) {
    uint4 v[kBatch];
#pragma unroll
    for (int s = 0; s < kBatch; ++s) {
      const int idx = static_cast<int>(threadIdx.x) + (s0 + s) * kThreads, rr = idx / kChunks, c = idx % kChunks;
      const int r = r0 + rr;
      v[s] = r < r_end ? load_chunk(src + static_cast<int64_t>(r) * ld + 8 * c) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int s = 0; s < kBatch; ++s) {
      const int idx = static_cast<int>(threadIdx.x) + (s0 + s) * kThreads, rr = idx / kChunks, c = idx % kChunks;
      *reinterpret_cast<uint4*>(&tile[rr][4 * c]) = v[s];
    }
  }
}

// The same rows of a bf16 matrix by cp.async (16 bytes a copy, no register), uncommitted; rows
// >= r_end are 0 (plain stores).
template <int kRows, int kHd>
__device__ __forceinline__ void load_tile_async(uint32_t (*tile)[words<kHd>()], const uint16_t* __restrict__ src,
                                                int64_t ld, int r0, int r_end) {
  constexpr int kChunks = kHd / 8;
  constexpr int kSteps = kRows * kChunks / kThreads;
  static_assert(kRows * kChunks % kThreads == 0, "a tile's chunks divide among the block's threads");
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int idx = static_cast<int>(threadIdx.x) + s * kThreads, rr = idx / kChunks, c = idx % kChunks;
    const int r = r0 + rr;
    if (r < r_end) cp_async<16>(&tile[rr][4 * c], src + static_cast<int64_t>(r) * ld + 8 * c);
    else *reinterpret_cast<uint4*>(&tile[rr][4 * c]) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Whether a kernel streams its tiles (two of kRows rows each, beside kOther bytes of its own shared
// memory) through two shared buffers, the next tile's cp.async copies in flight while the current
// one is multiplied: bf16 inputs (copied as they are) where two buffers fit the 48 KB of static
// shared memory a block may have (hd 64; at hd 128 dQ's 32-row key tiles, not the forward's 64
// nor dK/dV's beside the block's keys and values). f32 inputs are rounded on the way (through
// registers); those, and the tiles that do not fit twice, load between two barriers.
template <typename In, int kHd, int kRows, int kOther = 0>
__host__ __device__ constexpr bool pipelined() {
  return sizeof(In) == 2 && 2 * 2 * kRows * words<kHd>() * 4 + kOther <= 48 * 1024;
}

// The key and value tiles of keys [j, j + kRows) (rows >= hi zero) into one buffer's kt and vt:
// cp.async copies committed as one group (pipelined), else rounded through registers.
template <bool kPipe, int kRows, int kHd, typename In>
__device__ __forceinline__ void fetch_kv(uint32_t (*kt)[words<kHd>()], uint32_t (*vt)[words<kHd>()],
                                         const In* __restrict__ kbase, const In* __restrict__ vbase, int64_t ld, int j,
                                         int hi) {
  if constexpr (kPipe) {
    load_tile_async<kRows, kHd>(kt, kbase, ld, j, hi);
    load_tile_async<kRows, kHd>(vt, vbase, ld, j, hi);
    cp_async_commit();
  } else {
    load_tile<kRows, kHd>(kt, kbase, ld, j, hi);
    load_tile<kRows, kHd>(vt, vbase, ld, j, hi);
  }
}

// Before multiplying the tile from j0 (of a sequence of tiles kStep apart, up to hi) held in
// buffer buf: pipelined, the next tile's copies are issued into the other buffer and this one's
// waited for, then a barrier makes every thread's copies visible (the loop's end has another
// barrier before that buffer is refilled); otherwise a barrier (the previous tile is no longer
// read), the tile's loads, and a barrier.
template <bool kPipe, typename Fetch>
__device__ __forceinline__ void tile_barrier(const Fetch& fetch, int j0, int kStep, int hi, int buf) {
  if constexpr (kPipe) {
    if (j0 + kStep < hi) {
      fetch(j0 + kStep, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
  } else {
    __syncthreads();
    fetch(j0, buf);
    __syncthreads();
  }
}

// The A fragments (16 rows from r0, all kHd columns: kHd / 16 k-steps) of a row-major matrix,
// straight from global memory, rounded to bf16; rows >= r_end are 0.
template <int kHd, typename In>
__device__ __forceinline__ void load_a_frags(uint32_t (&a)[kHd / 16][4], const In* __restrict__ src, int64_t ld,
                                             int r0, int r_end, int g, int t) {
#pragma unroll
  for (int ks = 0; ks < kHd / 16; ++ks) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = r0 + g + (j & 1) * 8;           // a[1], a[3]: row g + 8
      const int c = ks * 16 + 2 * t + (j >> 1) * 8;  // a[2], a[3]: columns + 8
      a[ks][j] = r < r_end ? load_pair(src + static_cast<int64_t>(r) * ld + c) : 0u;
    }
  }
}

// Fragments from the shared tiles, by ldmatrix (cuda_mma.h; a tile row is kW words, 16-byte
// aligned, padded by 16 bytes so that the eight rows of a matrix fall in distinct banks).
// The A fragment (16 x 16) with A(m, k) = tile[m0 + m][k0 + k].
template <int kW>
__device__ __forceinline__ void a_from_rows(uint32_t (&a)[4], const uint32_t (*tile)[kW], int m0, int k0, int lane) {
  mma::ldmatrix_x4<false>(a, mma::quad_row(tile, kW * 4, m0, k0, lane));
}
// B (16 x 8) with B(k, n) = tile[n0 + n][k0 + k] for the k-steps k0 (b[0], b[1]) and k0 + 16
// (b[2], b[3]): a tile row is a B column.
template <int kW>
__device__ __forceinline__ void b_pair_from_rows(uint32_t (&b)[4], const uint32_t (*tile)[kW], int n0, int k0,
                                                 int lane) {
  mma::ldmatrix_x4<false>(b, mma::strip_row(tile, kW * 4, n0, k0, lane));
}
// B (16 x 8) with B(k, n) = tile[k0 + k][n0 + n] for the n-tiles n0 (b[0], b[1]) and n0 + 8
// (b[2], b[3]): a register pairs two tile rows, which ldmatrix's .trans gathers.
template <int kW>
__device__ __forceinline__ void b_pair_from_cols(uint32_t (&b)[4], const uint32_t (*tile)[kW], int k0, int n0,
                                                 int lane) {
  mma::ldmatrix_x4<true>(b, mma::quad_row(tile, kW * 4, k0, n0, lane));
}
// d += a B, B registers 0-1 (kHalf 0) or 2-3 (kHalf 1) of such a pair.
template <int kHalf>
__device__ __forceinline__ void mma_b(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  const uint32_t bb[2] = {b[2 * kHalf], b[2 * kHalf + 1]};
  mma_m16n8k16_bf16(d, a, bb, d);
}

// acc (the warp's 16 rows x kHd) += A B, A the warp's 16 x kBc products c (C fragments of kBc / 8
// n-tiles, rounded pairwise into A fragments: acc_to_a) and B (kBc x kHd) the tile's rows by
// columns: the forward's O += P V and dQ's dQ += dS K. A k-step of 16 keys that no row of the warp
// sees (past hi, or after its last row under the causal mask) is skipped: A is 0 there.
template <int kBc, int kHd, bool kCausal>
__device__ __forceinline__ void rows_times_tile(float (&acc)[kHd / 8][4], const float (&c)[kBc / 8][4],
                                                const uint32_t (*tile)[words<kHd>()], bool warp_live, int j0, int hi,
                                                int r_last, int lane) {
#pragma unroll
  for (int kk = 0; kk < kBc / 16; ++kk) {
    if (!warp_live || j0 + kk * 16 >= hi || (kCausal && j0 + kk * 16 > r_last)) continue;  // warp-uniform
    uint32_t a[4];
    acc_to_a(a, c[2 * kk], c[2 * kk + 1]);
#pragma unroll
    for (int dt = 0; dt < kHd / 8; dt += 2) {
      uint32_t b[4];
      b_pair_from_cols<words<kHd>()>(b, tile, kk * 16, dt * 8, lane);
      mma_b<0>(acc[dt], a, b);
      mma_b<1>(acc[dt + 1], a, b);
    }
  }
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
template <int kHd, bool kCausal, typename In, typename O>
__global__ void __launch_bounds__(kThreads, (pipelined<In, kHd, 64>() ? 3 : 1))
    flash_mma_forward_kernel(const In* __restrict__ qkv, O* __restrict__ out, float* __restrict__ lse,
                             int seq_len, int n_head, int n_kv_head, float scale) {
  constexpr int kW = words<kHd>();
  constexpr int kBc = 64;        // keys per tile
  constexpr int kKs = kHd / 16;  // k-steps of S = Q K^T
  constexpr int kNt = kBc / 8;   // key n-tiles of S
  constexpr int kDt = kHd / 8;   // dim n-tiles of O
  constexpr bool kPipe = pipelined<In, kHd, kBc>();
  __shared__ __align__(16) uint32_t ks[kPipe ? 2 : 1][kBc][kW];
  __shared__ __align__(16) uint32_t vs[kPipe ? 2 : 1][kBc][kW];

  const int n_tiles = (seq_len + kBlockRows - 1) / kBlockRows;
  const int i0 = (n_tiles - 1 - static_cast<int>(blockIdx.x)) * kBlockRows;
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int kvh = h / (n_head / n_kv_head);
  const int64_t width = static_cast<int64_t>(n_head + 2 * n_kv_head) * kHd;
  const int64_t out_width = static_cast<int64_t>(n_head) * kHd;
  const In* base = qkv + static_cast<int64_t>(b) * seq_len * width;
  const In* kbase = base + static_cast<int64_t>(n_head + kvh) * kHd;
  const In* vbase = base + static_cast<int64_t>(n_head + n_kv_head + kvh) * kHd;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = mma::group_id(lane), t = mma::thread_in_group(lane);
  const int r0 = i0 + warp * kWarpRows;  // the warp's rows r0 + g and r0 + g + 8
  const int r_last = r0 + kWarpRows - 1;
  const bool warp_live = r0 < seq_len;  // the last block's warps past T only load tiles
  const int hi = kCausal ? min(seq_len, i0 + kBlockRows) : seq_len;
  const auto fetch = [&](int j, int buf) { fetch_kv<kPipe, kBc, kHd>(ks[buf], vs[buf], kbase, vbase, width, j, hi); };
  if constexpr (kPipe) fetch(0, 0);  // in flight while Q is read

  uint32_t qa[kKs][4];
  load_a_frags<kHd>(qa, base + static_cast<int64_t>(h) * kHd, width, r0, seq_len, g, t);
  float o[kDt][4];
#pragma unroll
  for (int dt = 0; dt < kDt; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  float m[2] = {-CUDART_INF_F, -CUDART_INF_F}, l[2] = {0.0f, 0.0f};  // l: this lane's part of the row sum

  for (int j0 = 0, it = 0; j0 < hi; j0 += kBc, ++it) {
    const int buf = kPipe ? it & 1 : 0;
    tile_barrier<kPipe>(fetch, j0, kBc, hi, buf);
    const uint32_t(*kt)[kW] = ks[buf];
    const uint32_t(*vt)[kW] = vs[buf];

    float s[kNt][4];
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      if (!warp_live || j0 + nt * 8 >= hi || (kCausal && j0 + nt * 8 > r_last)) continue;  // warp-uniform: masked
#pragma unroll
      for (int kk = 0; kk < kKs; kk += 2) {
        uint32_t bk[4];
        b_pair_from_rows<kW>(bk, kt, nt * 8, kk * 16, lane);
        mma_b<0>(s[nt], qa[kk], bk);
        mma_b<1>(s[nt], qa[kk + 1], bk);
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
    rows_times_tile<kBc, kHd, kCausal>(o, s, vt, warp_live, j0, hi, r_last, lane);
    if constexpr (kPipe) __syncthreads();  // buffer buf is the next fetch's
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
template <typename In, typename O>
__global__ void __launch_bounds__(kDsumWarps* kWarpSize)
    flash_mma_dsum_kernel(const In* __restrict__ dout, const O* __restrict__ out, float* __restrict__ dsum,
                          int64_t rows, int seq_len, int n_head, int head_dim) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kDsumWarps + threadIdx.x / kWarpSize;
  if (r >= rows) return;  // warp-uniform
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const In* x = dout + r * head_dim;
  const O* y = out + r * head_dim;
  float acc = 0.0f;
  for (int d = lane; d < head_dim; d += kWarpSize) acc += load_o(x + d) * load_o(y + d);
  acc = warp_sum(acc);
  const int64_t bt = r / n_head, h = r % n_head, b = bt / seq_len, i = bt % seq_len;
  if (lane == 0) dsum[(b * n_head + h) * seq_len + i] = acc;
}

template <int kHd, bool kCausal, typename In, typename G>
__global__ void __launch_bounds__(kThreads, 1)
    flash_mma_dkdv_kernel(const In* __restrict__ dout, const In* __restrict__ qkv,
                          const float* __restrict__ lse, const float* __restrict__ dsum, G* __restrict__ dqkv,
                          int seq_len, int n_head, int n_kv_head, float scale) {
  constexpr int kW = words<kHd>();
  constexpr int kBq = dkdv_rows<kHd>();  // queries per tile
  constexpr int kKs = kHd / 16;
  constexpr int kQt = kBq / 8;  // query n-tiles of S^T
  constexpr int kDt = kHd / 8;
  constexpr bool kKvShared = dkdv_kv_shared<kHd>();
  constexpr int kKvBytes = 2 * (kKvShared ? kBlockRows : 1) * kW * 4;  // kts and vts below
  constexpr bool kPipe = pipelined<In, kHd, kBq, kKvBytes + 2 * 2 * kBq * 4>();
  __shared__ __align__(16) uint32_t qs[kPipe ? 2 : 1][kBq][kW];
  __shared__ __align__(16) uint32_t dos[kPipe ? 2 : 1][kBq][kW];
  __shared__ __align__(16) float lses[kPipe ? 2 : 1][kBq];
  __shared__ __align__(16) float dsums[kPipe ? 2 : 1][kBq];
  __shared__ __align__(16) uint32_t kts[kKvShared ? kBlockRows : 1][kW];  // the block's keys and values
  __shared__ __align__(16) uint32_t vts[kKvShared ? kBlockRows : 1][kW];

  const int j0 = static_cast<int>(blockIdx.x) * kBlockRows;
  const int kvh = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int group = n_head / n_kv_head;
  const int64_t width = static_cast<int64_t>(n_head + 2 * n_kv_head) * kHd;
  const int64_t out_width = static_cast<int64_t>(n_head) * kHd;
  const In* base = qkv + static_cast<int64_t>(b) * seq_len * width;
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

  // The query tiles, the group's heads in order and each head's tiles from qlo on, as one
  // sequence: tile n is head r = n / per_head's from i0 = qlo + (n % per_head) kBq.
  const int qlo = kCausal ? j0 : 0;
  const int per_head = (seq_len - qlo + kBq - 1) / kBq;
  const auto fetch = [&](int n, int buf) {
    const int h = kvh * group + n / per_head, i0 = qlo + (n % per_head) * kBq;
    const In* qsrc = base + static_cast<int64_t>(i0) * width + static_cast<int64_t>(h) * kHd;
    const In* dosrc = dout + (static_cast<int64_t>(b) * seq_len + i0) * out_width + static_cast<int64_t>(h) * kHd;
    const float* lse_h = lse + (static_cast<int64_t>(b) * n_head + h) * seq_len;
    const float* dsum_h = dsum + (static_cast<int64_t>(b) * n_head + h) * seq_len;
    const int q = static_cast<int>(threadIdx.x), i = i0 + q;
    if constexpr (kPipe) {
      load_tile_async<kBq, kHd>(qs[buf], qsrc, width, 0, seq_len - i0);
      load_tile_async<kBq, kHd>(dos[buf], dosrc, out_width, 0, seq_len - i0);
      if (q < kBq && i < seq_len) {
        cp_async<4>(&lses[buf][q], lse_h + i);
        cp_async<4>(&dsums[buf][q], dsum_h + i);
      } else if (q < kBq) {
        lses[buf][q] = dsums[buf][q] = 0.0f;
      }
      cp_async_commit();
    } else {
      load_tile<kBq, kHd>(qs[buf], qsrc, width, 0, seq_len - i0);
      load_tile<kBq, kHd>(dos[buf], dosrc, out_width, 0, seq_len - i0);
      if (q < kBq) {
        lses[buf][q] = i < seq_len ? lse_h[i] : 0.0f;
        dsums[buf][q] = i < seq_len ? dsum_h[i] : 0.0f;
      }
    }
  };
  if constexpr (kPipe) fetch(0, 0);
  for (int n = 0; n < group * per_head; ++n) {
    const int buf = kPipe ? n & 1 : 0;
    const int i0 = qlo + (n % per_head) * kBq;
    tile_barrier<kPipe>(fetch, n, 1, group * per_head, buf);
    const uint32_t(*qt)[kW] = qs[buf];
    const uint32_t(*dot)[kW] = dos[buf];
    const float* lq = lses[buf];
    const float* dq_sum = dsums[buf];

    // S^T (16 keys x kBq queries) = K Q^T, dP^T = V dO^T.
    float st[kQt][4], dpt[kQt][4];
#pragma unroll
    for (int nt = 0; nt < kQt; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
      // warp-uniform: no key of the warp, no query of the n-tile, or every query before every key
      if (!warp_live || i0 + nt * 8 >= seq_len || (kCausal && i0 + nt * 8 + 7 < k0)) continue;
#pragma unroll
      for (int kk = 0; kk < kKs; kk += 2) {
        uint32_t bq[4], bo[4];
        b_pair_from_rows<kW>(bq, qt, nt * 8, kk * 16, lane);
        b_pair_from_rows<kW>(bo, dot, nt * 8, kk * 16, lane);
        if constexpr (kKvShared) {
          uint32_t a[4];
          a_from_rows<kW>(a, kts, warp * kWarpRows, kk * 16, lane);
          mma_b<0>(st[nt], a, bq);
          a_from_rows<kW>(a, vts, warp * kWarpRows, kk * 16, lane);
          mma_b<0>(dpt[nt], a, bo);
          a_from_rows<kW>(a, kts, warp * kWarpRows, kk * 16 + 16, lane);
          mma_b<1>(st[nt], a, bq);
          a_from_rows<kW>(a, vts, warp * kWarpRows, kk * 16 + 16, lane);
          mma_b<1>(dpt[nt], a, bo);
        } else {
          mma_b<0>(st[nt], ka[kk], bq);
          mma_b<0>(dpt[nt], va[kk], bo);
          mma_b<1>(st[nt], ka[kk + 1], bq);
          mma_b<1>(dpt[nt], va[kk + 1], bo);
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
        const float p = ok ? expf(st[nt][e] * scale - lq[qq]) : 0.0f;
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - dq_sum[qq]);
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
      for (int dt = 0; dt < kDt; dt += 2) {
        uint32_t bo[4], bq[4];
        b_pair_from_cols<kW>(bo, dot, kk * 16, dt * 8, lane);
        b_pair_from_cols<kW>(bq, qt, kk * 16, dt * 8, lane);
        mma_b<0>(dv[dt], pa, bo);
        mma_b<0>(dk[dt], dsa, bq);
        mma_b<1>(dv[dt + 1], pa, bo);
        mma_b<1>(dk[dt + 1], dsa, bq);
      }
    }
    if constexpr (kPipe) __syncthreads();  // buffer buf is the next fetch's
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

template <int kHd, bool kCausal, typename In, typename G>
__global__ void __launch_bounds__(kThreads, 1)
    flash_mma_dq_kernel(const In* __restrict__ dout, const In* __restrict__ qkv, const float* __restrict__ lse,
                        const float* __restrict__ dsum, G* __restrict__ dqkv, int seq_len, int n_head,
                        int n_kv_head, float scale) {
  constexpr int kW = words<kHd>();
  constexpr int kBc = stream_rows<kHd>();  // keys per tile
  constexpr int kKs = kHd / 16;
  constexpr int kNt = kBc / 8;
  constexpr int kDt = kHd / 8;
  constexpr bool kPipe = pipelined<In, kHd, kBc>();
  __shared__ __align__(16) uint32_t ks[kPipe ? 2 : 1][kBc][kW];
  __shared__ __align__(16) uint32_t vs[kPipe ? 2 : 1][kBc][kW];

  const int n_tiles = (seq_len + kBlockRows - 1) / kBlockRows;
  const int i0 = (n_tiles - 1 - static_cast<int>(blockIdx.x)) * kBlockRows;
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int kvh = h / (n_head / n_kv_head);
  const int64_t width = static_cast<int64_t>(n_head + 2 * n_kv_head) * kHd;
  const int64_t out_width = static_cast<int64_t>(n_head) * kHd;
  const In* base = qkv + static_cast<int64_t>(b) * seq_len * width;
  const In* kbase = base + static_cast<int64_t>(n_head + kvh) * kHd;
  const In* vbase = base + static_cast<int64_t>(n_head + n_kv_head + kvh) * kHd;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = mma::group_id(lane), t = mma::thread_in_group(lane);
  const int r0 = i0 + warp * kWarpRows;
  const int r_last = r0 + kWarpRows - 1;
  const bool warp_live = r0 < seq_len;  // the last block's warps past T only load tiles

  const int hi = kCausal ? min(seq_len, i0 + kBlockRows) : seq_len;
  const auto fetch = [&](int j, int buf) { fetch_kv<kPipe, kBc, kHd>(ks[buf], vs[buf], kbase, vbase, width, j, hi); };
  if constexpr (kPipe) fetch(0, 0);

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

  for (int j0 = 0, it = 0; j0 < hi; j0 += kBc, ++it) {
    const int buf = kPipe ? it & 1 : 0;
    tile_barrier<kPipe>(fetch, j0, kBc, hi, buf);
    const uint32_t(*kt)[kW] = ks[buf];
    const uint32_t(*vt)[kW] = vs[buf];

    // S = Q K^T, dP = dO V^T (16 queries x kBc keys).
    float s[kNt][4], dp[kNt][4];
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
      if (!warp_live || j0 + nt * 8 >= hi || (kCausal && j0 + nt * 8 > r_last)) continue;  // warp-uniform: masked
#pragma unroll
      for (int kk = 0; kk < kKs; kk += 2) {
        uint32_t bk[4], bv[4];
        b_pair_from_rows<kW>(bk, kt, nt * 8, kk * 16, lane);
        b_pair_from_rows<kW>(bv, vt, nt * 8, kk * 16, lane);
        mma_b<0>(s[nt], qa[kk], bk);
        mma_b<0>(dp[nt], doa[kk], bv);
        mma_b<1>(s[nt], qa[kk + 1], bk);
        mma_b<1>(dp[nt], doa[kk + 1], bv);
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
    rows_times_tile<kBc, kHd, kCausal>(dq, s, kt, warp_live, j0, hi, r_last, lane);
    if constexpr (kPipe) __syncthreads();  // buffer buf is the next fetch's
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

template <int kHd, bool kCausal, typename In, typename O>
void forward_hd(const In* qkv, O* out, float* lse, int64_t batch, const Dims& d, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((d.T + kBlockRows - 1) / kBlockRows), static_cast<unsigned>(d.H),
                  static_cast<unsigned>(batch));
  launch<flash_mma_forward_kernel<kHd, kCausal, In, O>>(grid, kThreads, 0, stream, qkv, out, lse, d.T, d.H, d.KV,
                                                        attention_scale(kHd));
  LOOM_CUDA_CHECK_LAUNCH();
}

template <int kHd, bool kCausal, typename In, typename G>
void backward_hd(const In* dout, const In* qkv, const float* dsum, const float* lse, G* dqkv, int64_t batch,
                 const Dims& d, cudaStream_t stream) {
  const unsigned tiles = static_cast<unsigned>((d.T + kBlockRows - 1) / kBlockRows);
  const float scale = attention_scale(kHd);
  launch<flash_mma_dkdv_kernel<kHd, kCausal, In, G>>(
      dim3(tiles, static_cast<unsigned>(d.KV), static_cast<unsigned>(batch)), kThreads, 0, stream, dout, qkv, lse,
      dsum, dqkv, d.T, d.H, d.KV, scale);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<flash_mma_dq_kernel<kHd, kCausal, In, G>>(
      dim3(tiles, static_cast<unsigned>(d.H), static_cast<unsigned>(batch)), kThreads, 0, stream, dout, qkv, lse,
      dsum, dqkv, d.T, d.H, d.KV, scale);
  LOOM_CUDA_CHECK_LAUNCH();
}

// The kernels read their inputs in 16-byte chunks.
void check_aligned(const char* op, const void* p, const char* what) {
  LOOM_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, op, ": ", what, " must be 16-byte aligned for the tensor-core "
             "kernels");
}

// The kernels for (head_dim, causal); the full (non-causal) form only for f32 inputs (the tests'
// reference runs: every model's attention is causal).
template <typename In, typename Run>
void dispatch_kernels(const Dims& d, bool causal, const char* op, Run run) {
  constexpr bool kF32 = std::is_same_v<In, float>;
  LOOM_CHECK(causal || kF32, op, ": the tensor-core kernels' bf16 inputs are causal only");
  if (d.hd == 64) {
    if (causal) run.template operator()<64, true>();
    else if constexpr (kF32) run.template operator()<64, false>();
  } else {
    if (causal) run.template operator()<128, true>();
    else if constexpr (kF32) run.template operator()<128, false>();
  }
}

}  // namespace

template <typename In, typename O>
void flash_mma_attention_forward_as(const In* qkv, O* out, float* lse, int64_t batch, int64_t seq_len, int64_t n_head,
                                    int64_t n_kv_head, int64_t head_dim, int64_t window, cudaStream_t stream,
                                    bool causal) {
  const char* op = "flash_mma_attention_forward";
  const Dims d = check_dims(op, batch, seq_len, n_head, n_kv_head, head_dim, window);
  if (d.empty) return;
  check_aligned(op, qkv, "qkv");
  dispatch_kernels<In>(d, causal, op, [&]<int kHd, bool kCausal>() {
    forward_hd<kHd, kCausal, In, O>(qkv, out, lse, batch, d, stream);
  });
}

template <typename In, typename O, typename G>
void flash_mma_attention_backward_as(const In* dout, const In* qkv, const O* out, const float* lse, G* dqkv,
                                     void* scratch, int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                                     int64_t head_dim, int64_t window, cudaStream_t stream, bool causal) {
  const char* op = "flash_mma_attention_backward";
  const Dims d = check_dims(op, batch, seq_len, n_head, n_kv_head, head_dim, window);
  if (d.empty) return;
  check_aligned(op, qkv, "qkv");
  check_aligned(op, dout, "dout");
  float* dsum = static_cast<float*>(scratch);  // (B, H, T)
  const int64_t rows = batch * seq_len * n_head;
  launch<flash_mma_dsum_kernel<In, O>>(static_cast<unsigned>((rows + kDsumWarps - 1) / kDsumWarps),
                                       kDsumWarps * kWarpSize, 0, stream, dout, out, dsum, rows, d.T, d.H, d.hd);
  LOOM_CUDA_CHECK_LAUNCH();
  dispatch_kernels<In>(d, causal, op, [&]<int kHd, bool kCausal>() {
    backward_hd<kHd, kCausal, In, G>(dout, qkv, dsum, lse, dqkv, batch, d, stream);
  });
}

void flash_mma_attention_forward(const float* qkv, float* out, float* lse, int64_t batch, int64_t seq_len,
                                 int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t window,
                                 cudaStream_t stream, bool causal) {
  flash_mma_attention_forward_as(qkv, out, lse, batch, seq_len, n_head, n_kv_head, head_dim, window, stream, causal);
}

size_t flash_mma_attention_backward_scratch_bytes(int64_t batch, int64_t seq_len, int64_t n_head,
                                                  int64_t /*n_kv_head*/, int64_t /*head_dim*/) {
  return static_cast<size_t>(batch) * static_cast<size_t>(n_head) * static_cast<size_t>(seq_len) * sizeof(float);
}

void flash_mma_attention_backward(const float* dout, const float* qkv, const float* out, const float* lse,
                                  float* dqkv, void* scratch, int64_t batch, int64_t seq_len, int64_t n_head,
                                  int64_t n_kv_head, int64_t head_dim, int64_t window, cudaStream_t stream,
                                  bool causal) {
  flash_mma_attention_backward_as(dout, qkv, out, lse, dqkv, scratch, batch, seq_len, n_head, n_kv_head, head_dim,
                                  window, stream, causal);
}

#define LOOM_FLASH_MMA_FORWARD_AS(In, O)                                                                        \
  template void flash_mma_attention_forward_as<In, O>(const In*, O*, float*, int64_t, int64_t, int64_t, int64_t, \
                                                      int64_t, int64_t, cudaStream_t, bool);
LOOM_FLASH_MMA_FORWARD_AS(float, float)
LOOM_FLASH_MMA_FORWARD_AS(float, uint16_t)
LOOM_FLASH_MMA_FORWARD_AS(uint16_t, float)
LOOM_FLASH_MMA_FORWARD_AS(uint16_t, uint16_t)
#undef LOOM_FLASH_MMA_FORWARD_AS
#define LOOM_FLASH_MMA_BACKWARD_AS(In, O, G)                                                                     \
  template void flash_mma_attention_backward_as<In, O, G>(const In*, const In*, const O*, const float*, G*, void*, \
                                                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,    \
                                                          cudaStream_t, bool);
LOOM_FLASH_MMA_BACKWARD_AS(float, float, float)
LOOM_FLASH_MMA_BACKWARD_AS(float, uint16_t, float)
LOOM_FLASH_MMA_BACKWARD_AS(float, float, uint16_t)
LOOM_FLASH_MMA_BACKWARD_AS(float, uint16_t, uint16_t)
LOOM_FLASH_MMA_BACKWARD_AS(uint16_t, float, float)
LOOM_FLASH_MMA_BACKWARD_AS(uint16_t, uint16_t, float)
LOOM_FLASH_MMA_BACKWARD_AS(uint16_t, float, uint16_t)
LOOM_FLASH_MMA_BACKWARD_AS(uint16_t, uint16_t, uint16_t)
#undef LOOM_FLASH_MMA_BACKWARD_AS

}  // namespace loom::cuda
