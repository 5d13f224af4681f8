// CUDA kernels of the model-parallel ops (vocabulary-parallel embedding and cross-entropy, ring
// attention's pieces, copy_block) and of per-head RMSNorm (Qwen3's q/k norm). Each computes the
// formula of its CPU twin (cpu/cpu_parallel_ops.cpp; cpu/cpu_kernels.h head_rmsnorm_*) in the
// same per-element order; only the order inside a dot product or a row sum differs (a fixed
// lane-strided partial plus a butterfly / fixed tree), which the op tests' tolerances cover.
// exp / log are libm's in T (expf / exp), as the CPU twins use std::exp / std::log.
//
// Roofline per kernel (E = 4 bytes for f32, 8 for f64; per element unless stated; N rows, C
// channels, V columns of a vocab slice, K visible keys per query row, G = H / KV, hd head dim):
//   vocab_embedding_forward   out[i] = w[tok - begin] or 0. 2E, 0 FLOPs. Warp per token (8 per
//                             block), float4 words when C % 4 = 0.
//   vocab_embedding_backward  dw[tok - begin] += dout[i]. 3E + the sort (~16 B per token), 1 FLOP.
//                             cuda::embedding_backward (cub radix sort, segment sums) on shifted ids.
//   add_positions             out += positions[first + t]. 3E, 1 FLOP. Grid-stride 256, float4.
//   positions_backward        dp[t] += dout[b, t] for b in order. (B + 2) E per (t, c), B FLOPs.
//                             Thread per (t, c), grid-stride 256.
//   vocab_ce_partials         max_v x[r, v]; x[r, tgt - begin]. E, 1 FLOP. Block of 256 per row.
//   vocab_ce_sums             sum_v exp(x - max). E, ~10 FLOPs (exp). Block of 256 per row.
//   vocab_ce_finish           lse = max + log s; loss = lse - target. 16 B per row. Grid-stride 256.
//   vocab_ce_backward         d = scale (exp(x - lse) - onehot), 0 padding. 2E (in place allowed),
//                             ~12 FLOPs. Block of 256 per row.
//   ring_attention_merge      online softmax of one K/V block. Per query row: 2E hd (q, out) +
//                             K E hd (v) + 2 K E hd (k, read twice; L1-shared by a group's heads);
//                             6 K hd + ~20 K FLOPs. Warp per query row, 8 per block.
//   ring_attention_finish     out /= l; lse += log l. 2E per out element, 1 FLOP. Grid-stride 256.
//   attention_row_dot         D = dout . out per row. 2E, 2 FLOPs. Warp per row, 8 per block.
//   block_backward, dq        dq += scale dS k. Per query row 4E hd + 2 K E hd; 6 K hd FLOPs.
//                             Warp per query row.
//   block_backward, dk / dv   dv += P dout; dk += scale dS q. Per key row 6E hd + 2 G K' E hd
//                             (K' queries seeing the key); 8 G K' hd FLOPs. Warp per key row.
//                             P and dS are recomputed in both kernels (4 dots per pair, no
//                             scratch, no atomics).
//   copy_block                dst block = src block. 2 bytes moved per byte, 0 FLOPs. Grid-stride
//                             256 in the widest aligned word (16, 8, 4, 2 or 1 bytes).
//   head_rmsnorm_forward      in = x; x = x rstd w. 3E, 4 FLOPs. Warp per (token, head) row.
//   head_rmsnorm_backward dw  dw += sum_r g in rstd, fixed chunks. 2E, 2 FLOPs. Blocks (32, 8) per
//                             32 columns x chunk of rows, then one thread per column.
//   head_rmsnorm_backward dx  g -> rstd (g w - in rstd mean(g w in rstd)) in place. 3E, 7 FLOPs.
//                             Warp per row.
// All but the ring attention kernels are memory-bound by their counts (under 3 FLOPs per byte,
// the H100 balance being ~20 FP32 FLOPs per byte). The ring kernels are a warp per row: each
// key costs one or two dot products reduced by a 5-step shuffle butterfly, so they are bound by
// shuffle and load latency rather than by bytes, and use no tensor cores. A tiled kernel
// (FlashAttention-2 style, a block of queries per CTA, K/V tiles in shared memory, mma) is the
// faster design for long shards; these keep the CPU's per-row order of operations.
//
// Determinism: no floating-point atomics. Row sums are lane-strided partials in index order plus
// an XOR butterfly (every lane gets the same bits) or a fixed tree over warps; the column sums
// of dweight and dpositions have one writer per element and a fixed order. The only atomic is
// embedding_backward's integer atomicMin on its private "bad id" slot (order-independent).
#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)
#include "loom/backend/cuda/cuda_parallel.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_kernels.h"
#include "loom/backend/cuda/cuda_launch.h"
#include "loom/core/targets.h"

namespace loom::cuda {
namespace {

// ---------------------------------------------------------------- launch shapes
// (kWarp, kMaxBlocks, grid_for, thread_index / thread_count, lane_id, exp_of / log_of / sqrt_of
// (libm, as the CPU twins), max_of (std::max's choice), warp_sum / warp_max: cuda_device.h)
constexpr int kBlock = 256;           // threads per block of the 1-D and row kernels
constexpr int kWarpsPerBlock = kBlock / kWarp;                  // warp-per-row kernels: 8 rows per block
constexpr int kLaneElems = static_cast<int>(kRingMaxHeadDim / kWarp);  // ring rows: elements per lane (8)

// The first warp-row of this warp and the stride over warp-rows (grid-stride loops of warps).
__device__ __forceinline__ int64_t warp_row() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + static_cast<int>(threadIdx.x) / kWarp;
}
__device__ __forceinline__ int64_t warp_rows() { return static_cast<int64_t>(gridDim.x) * kWarpsPerBlock; }

// ---------------------------------------------------------------- vocabulary-parallel embedding
// Warp per token row (grid-stride over rows); lanes stride the row in words of VT (float or float4).
template <typename VT>
__global__ void vocab_embedding_forward_kernel(const int32_t* tokens, const VT* weight, VT* out, int64_t n,
                                               int64_t words, int64_t begin, int64_t valid) {
  const int lane = lane_id();
  for (int64_t i = warp_row(); i < n; i += warp_rows()) {
    const int64_t row = static_cast<int64_t>(tokens[i]) - begin;
    VT* o = out + i * words;
    if (row >= 0 && row < valid) {
      const VT* w = weight + row * words;
      for (int64_t c = lane; c < words; c += kWarp) o[c] = w[c];
    } else {
      VT zero{};
      for (int64_t c = lane; c < words; c += kWarp) o[c] = zero;
    }
  }
}

// shifted[i] = tokens[i] - begin inside the slice, else -1 (embedding_backward skips it).
__global__ void vocab_shift_kernel(const int32_t* tokens, int32_t* shifted, int64_t n, int64_t begin, int64_t valid) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const int64_t row = static_cast<int64_t>(tokens[i]) - begin;
    shifted[i] = row >= 0 && row < valid ? static_cast<int32_t>(row) : -1;
  }
}

// Grid-stride over the (B T C) elements (or C / 4 float4 words per row): out[b, t] += p[t].
template <typename VT>
__global__ void add_positions_kernel(VT* out, const VT* positions, int64_t rows, int64_t seq_len, int64_t words) {
  const int64_t n = rows * words;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const int64_t c = i % words, t = (i / words) % seq_len;
    VT o = out[i];
    const VT p = positions[t * words + c];
    if constexpr (sizeof(VT) == 16) {
      o.x += p.x;
      o.y += p.y;
      o.z += p.z;
      o.w += p.w;
    } else {
      o += p;
    }
    out[i] = o;
  }
}

// One thread per (t, c): dp[t, c] += dout[0, t, c], += dout[1, t, c], ... (the CPU's order and bits).
__global__ void positions_backward_kernel(const float* dout, float* dp, int64_t batch, int64_t seq_len,
                                          int64_t channels) {
  const int64_t n = seq_len * channels;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    float acc = dp[i];
    for (int64_t b = 0; b < batch; ++b) acc += dout[b * n + i];
    dp[i] = acc;
  }
}

// ---------------------------------------------------------------- vocabulary-parallel cross-entropy
// Block-wide reductions of one value per thread: the 8 warp results combined in warp order by
// every thread (after a barrier), so the whole block holds the same bits.
template <bool Max>
__device__ __forceinline__ float block_reduce(float v, float* shared) {
  v = Max ? warp_max(v) : warp_sum(v);
  const int lane = lane_id(), warp = static_cast<int>(threadIdx.x) / kWarp;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float r = shared[0];
  for (int w = 1; w < kWarpsPerBlock; ++w) r = Max ? max_of(r, shared[w]) : r + shared[w];
  __syncthreads();  // shared is rewritten by the next row
  return r;
}

// Block of 256 per row (grid-stride over rows).
__global__ void __launch_bounds__(kBlock) vocab_ce_partials_kernel(const float* logits, const int32_t* targets,
                                                                   float* row_max, float* target, int64_t rows,
                                                                   int64_t V, int64_t begin, int64_t valid) {
  __shared__ float warp_vals[kWarpsPerBlock];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* x = logits + r * V;
    float mx = -INFINITY;
    for (int64_t v = threadIdx.x; v < valid; v += kBlock) mx = max_of(mx, x[v]);
    mx = block_reduce<true>(mx, warp_vals);
    if (threadIdx.x == 0) {
      row_max[r] = mx;
      const int64_t col = static_cast<int64_t>(targets[r]) - begin;
      target[r] = col >= 0 && col < valid ? x[col] : 0.0f;
    }
  }
}

__global__ void __launch_bounds__(kBlock) vocab_ce_sums_kernel(const float* logits, const float* row_max, float* sums,
                                                               int64_t rows, int64_t V, int64_t valid) {
  __shared__ float warp_vals[kWarpsPerBlock];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* x = logits + r * V;
    const float m = row_max[r];
    float s = 0.0f;
    for (int64_t v = threadIdx.x; v < valid; v += kBlock) s += exp_of(x[v] - m);
    s = block_reduce<false>(s, warp_vals);
    if (threadIdx.x == 0) sums[r] = s;
  }
}

// Grid-stride over rows.
__global__ void vocab_ce_finish_kernel(const int32_t* targets, float* lse, const float* sums, float* losses,
                                       int64_t rows) {
  for (int64_t r = thread_index(); r < rows; r += thread_count()) {
    const float l = lse[r] + log_of(sums[r]);
    lse[r] = l;
    losses[r] = targets[r] == kIgnoreTarget ? 0.0f : l - losses[r];
  }
}

// Block of 256 per row; each element is read and written by one thread (dlogits may alias logits).
__global__ void __launch_bounds__(kBlock) vocab_ce_backward_kernel(const float* logits, const int32_t* targets,
                                                                   const float* lse, float* dlogits, int64_t rows,
                                                                   int64_t V, int64_t begin, int64_t valid,
                                                                   float scale) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t tgt = targets[r];
    const float* x = logits + r * V;
    float* d = dlogits + r * V;
    if (tgt == kIgnoreTarget) {  // block-uniform: a loss mask, no gradient
      for (int64_t v = threadIdx.x; v < V; v += kBlock) d[v] = 0.0f;
      continue;
    }
    const float l = lse[r];
    const int64_t col = static_cast<int64_t>(tgt) - begin;
    for (int64_t v = threadIdx.x; v < V; v += kBlock) {
      float value = v < valid ? scale * exp_of(x[v] - l) : 0.0f;
      if (v == col && col < valid) value -= scale;
      d[v] = value;
    }
  }
}

// ---------------------------------------------------------------- ring attention
// Zig-zag positions (nn/context_parallel.h): local row t < C of rank r is at r C + t, the others
// at (2 N - 1 - r) C + t - C.
__device__ __forceinline__ int64_t zigzag(int64_t t, int64_t C, int r, int N) {
  return t < C ? r * C + t : (2 * static_cast<int64_t>(N) - 1 - r) * C + (t - C);
}
// Keys of the chunk starting at global position `start` that a query at pq sees.
__device__ __forceinline__ int64_t visible_keys(int64_t pq, int64_t start, int64_t C) {
  const int64_t n = pq - start + 1;
  return n < 0 ? 0 : (n > C ? C : n);
}

// The lane's elements e = lane + 32 u (u < kLaneElems, e < hd) of a row: loaded, zero past hd.
template <typename T>
__device__ __forceinline__ void load_lane(const T* row, int64_t hd, int lane, T (&r)[kLaneElems]) {
#pragma unroll
  for (int u = 0; u < kLaneElems; ++u) {
    const int64_t e = lane + static_cast<int64_t>(u) * kWarp;
    r[u] = e < hd ? row[e] : T(0);
  }
}
template <typename T>
__device__ __forceinline__ void store_lane(T* row, int64_t hd, int lane, const T (&r)[kLaneElems]) {
#pragma unroll
  for (int u = 0; u < kLaneElems; ++u) {
    const int64_t e = lane + static_cast<int64_t>(u) * kWarp;
    if (e < hd) row[e] = r[u];
  }
}
// a . row over the lane's elements, then the butterfly: the whole dot on every lane.
template <typename T>
__device__ __forceinline__ T warp_dot(const T (&a)[kLaneElems], const T* row, int64_t hd, int lane) {
  T s = T(0);
#pragma unroll
  for (int u = 0; u < kLaneElems; ++u) {
    const int64_t e = lane + static_cast<int64_t>(u) * kWarp;
    if (e < hd) s += a[u] * row[e];
  }
  return warp_sum(s);
}
template <typename T>
__device__ __forceinline__ T warp_dot_regs(const T (&a)[kLaneElems], const T (&b)[kLaneElems]) {
  T s = T(0);
#pragma unroll
  for (int u = 0; u < kLaneElems; ++u) s += a[u] * b[u];
  return warp_sum(s);
}
// acc[u] += alpha row[e] (the CPU's axpy, per element).
template <typename T>
__device__ __forceinline__ void axpy_lane(T alpha, const T* row, int64_t hd, int lane, T (&acc)[kLaneElems]) {
#pragma unroll
  for (int u = 0; u < kLaneElems; ++u) {
    const int64_t e = lane + static_cast<int64_t>(u) * kWarp;
    if (e < hd) acc[u] += alpha * row[e];
  }
}

// Warp per query row (b, i, h), h fastest so a group's heads share the K/V rows in L1. Pass 1:
// the visible scores and their max; pass 2 recomputes each score, adds p = exp(s - m') to l and
// p v to the rescaled out. A row that sees no key of the block is left alone (warp-uniform).
template <typename T>
__global__ void __launch_bounds__(kBlock) ring_merge_kernel(const T* q, const T* k, const T* v, T* out, T* m, T* l,
                                                            RingShape s) {
  const int lane = lane_id();
  const int64_t C = s.Tl / 2, group = s.H / s.KV, QW = s.H * s.hd, KW = s.KV * s.hd, hd = s.hd;
  const int64_t kstart0 = s.owner * C, kstart1 = (2 * static_cast<int64_t>(s.world) - 1 - s.owner) * C;
  const T scale = T(1) / sqrt_of(static_cast<T>(hd));
  const int64_t rows = s.B * s.Tl * s.H;
  for (int64_t row = warp_row(); row < rows; row += warp_rows()) {
    const int64_t h = row % s.H, i = (row / s.H) % s.Tl, b = row / (s.H * s.Tl), g = h / group;
    const int64_t pq = zigzag(i, C, s.rank, s.world);
    // The visible keys: rows [0, cnt0) of the block's first chunk, then [C, C + n - cnt0) of its second.
    const int64_t cnt0 = visible_keys(pq, kstart0, C), n = cnt0 + visible_keys(pq, kstart1, C);
    if (n == 0) continue;
    T qr[kLaneElems];
    load_lane(q + (b * s.Tl + i) * QW + h * hd, hd, lane, qr);
    const T* kb = k + b * s.Tl * KW + g * hd;
    const T* vb = v + b * s.Tl * KW + g * hd;
    T block_max = -INFINITY;
    for (int64_t x = 0; x < n; ++x) {
      const int64_t j = x < cnt0 ? x : C + (x - cnt0);
      block_max = max_of(block_max, scale * warp_dot(qr, kb + j * KW, hd, lane));
    }
    const int64_t st = (b * s.H + h) * s.Tl + i;
    const T m_old = m[st];
    const T m_new = max_of(m_old, block_max);
    const T alpha = exp_of(m_old - m_new);  // 0 while m is -inf
    T* oi = out + (b * s.Tl + i) * QW + h * hd;
    T acc[kLaneElems];
    load_lane(oi, hd, lane, acc);
#pragma unroll
    for (int u = 0; u < kLaneElems; ++u) acc[u] *= alpha;
    T sum = l[st] * alpha;
    for (int64_t x = 0; x < n; ++x) {
      const int64_t j = x < cnt0 ? x : C + (x - cnt0);
      const T p = exp_of(scale * warp_dot(qr, kb + j * KW, hd, lane) - m_new);
      sum += p;
      axpy_lane(p, vb + j * KW, hd, lane, acc);
    }
    store_lane(oi, hd, lane, acc);
    if (lane == 0) {
      l[st] = sum;
      m[st] = m_new;
    }
  }
}

// Grid-stride over out's elements (b, t, h, e): out *= 1 / l; the e = 0 thread adds log l to lse.
template <typename T>
__global__ void ring_finish_kernel(T* out, T* lse, const T* l, int64_t B, int64_t Tl, int64_t H, int64_t hd) {
  const int64_t n = B * Tl * H * hd;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const int64_t e = i % hd, h = (i / hd) % H, t = (i / (hd * H)) % Tl, b = i / (hd * H * Tl);
    const int64_t st = (b * H + h) * Tl + t;
    const T lv = l[st];
    out[i] *= T(1) / lv;
    if (e == 0) lse[st] += log_of(lv);
  }
}

// Warp per (b, t, h) row: D = dout . out.
template <typename T>
__global__ void __launch_bounds__(kBlock) row_dot_kernel(const T* dout, const T* out, T* D, int64_t B, int64_t Tl,
                                                         int64_t H, int64_t hd) {
  const int lane = lane_id();
  const int64_t rows = B * Tl * H;
  for (int64_t row = warp_row(); row < rows; row += warp_rows()) {
    const int64_t h = row % H, t = (row / H) % Tl, b = row / (H * Tl);
    const T* a = dout + row * hd;  // (b, t, h) rows are contiguous, hd apart
    const T* c = out + row * hd;
    T sum = T(0);
    for (int64_t e = lane; e < hd; e += kWarp) sum += a[e] * c[e];
    sum = warp_sum(sum);
    if (lane == 0) D[(b * H + h) * Tl + t] = sum;
  }
}

// dq: warp per query row (b, i, h). For each visible key j in order: p = exp(scale q.k - lse),
// dS = p (dout.v - D), dq += (scale dS) k, accumulated from dq's value in the CPU's order.
template <typename T>
__global__ void __launch_bounds__(kBlock) ring_backward_dq_kernel(const T* q, const T* dout, const T* lse, const T* D,
                                                                  const T* k, const T* v, T* dq, RingShape s) {
  const int lane = lane_id();
  const int64_t C = s.Tl / 2, group = s.H / s.KV, QW = s.H * s.hd, KW = s.KV * s.hd, hd = s.hd;
  const int64_t kstart0 = s.owner * C, kstart1 = (2 * static_cast<int64_t>(s.world) - 1 - s.owner) * C;
  const T scale = T(1) / sqrt_of(static_cast<T>(hd));
  const int64_t rows = s.B * s.Tl * s.H;
  for (int64_t row = warp_row(); row < rows; row += warp_rows()) {
    const int64_t h = row % s.H, i = (row / s.H) % s.Tl, b = row / (s.H * s.Tl), g = h / group;
    const int64_t pq = zigzag(i, C, s.rank, s.world);
    // The visible keys: rows [0, cnt0) of the block's first chunk, then [C, C + n - cnt0) of its second.
    const int64_t cnt0 = visible_keys(pq, kstart0, C), n = cnt0 + visible_keys(pq, kstart1, C);
    if (n == 0) continue;
    const int64_t qoff = (b * s.Tl + i) * QW + h * hd, st = (b * s.H + h) * s.Tl + i;
    T qr[kLaneElems], dor[kLaneElems], acc[kLaneElems];
    load_lane(q + qoff, hd, lane, qr);
    load_lane(dout + qoff, hd, lane, dor);
    load_lane(dq + qoff, hd, lane, acc);
    const T lse_i = lse[st], D_i = D[st];
    const T* kb = k + b * s.Tl * KW + g * hd;
    const T* vb = v + b * s.Tl * KW + g * hd;
    for (int64_t x = 0; x < n; ++x) {
      const int64_t j = x < cnt0 ? x : C + (x - cnt0);
      const T p = exp_of(scale * warp_dot(qr, kb + j * KW, hd, lane) - lse_i);
      const T ds = p * (warp_dot(dor, vb + j * KW, hd, lane) - D_i);
      axpy_lane(scale * ds, kb + j * KW, hd, lane, acc);
    }
    store_lane(dq + qoff, hd, lane, acc);
  }
}

// dk, dv: warp per key row (b, j, g). For each query head h of group g in order and each local
// query i (in order) that sees key j: dv += p dout_i, dk += (scale dS) q_i (the CPU's order).
template <typename T>
__global__ void __launch_bounds__(kBlock) ring_backward_dkv_kernel(const T* q, const T* dout, const T* lse,
                                                                   const T* D, const T* k, const T* v, T* dk, T* dv,
                                                                   RingShape s) {
  const int lane = lane_id();
  const int64_t C = s.Tl / 2, group = s.H / s.KV, QW = s.H * s.hd, KW = s.KV * s.hd, hd = s.hd;
  const T scale = T(1) / sqrt_of(static_cast<T>(hd));
  const int64_t rows = s.B * s.Tl * s.KV;
  for (int64_t row = warp_row(); row < rows; row += warp_rows()) {
    const int64_t g = row % s.KV, j = (row / s.KV) % s.Tl, b = row / (s.KV * s.Tl);
    const int64_t pk = zigzag(j, C, s.owner, s.world);  // the key's global position
    const int64_t koff = (b * s.Tl + j) * KW + g * hd;
    T kr[kLaneElems], vr[kLaneElems], dk_acc[kLaneElems], dv_acc[kLaneElems];
    load_lane(k + koff, hd, lane, kr);
    load_lane(v + koff, hd, lane, vr);
    load_lane(dk + koff, hd, lane, dk_acc);
    load_lane(dv + koff, hd, lane, dv_acc);
    bool any = false;
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      for (int64_t i = 0; i < s.Tl; ++i) {
        if (zigzag(i, C, s.rank, s.world) < pk) continue;  // warp-uniform
        any = true;
        const int64_t qoff = (b * s.Tl + i) * QW + h * hd, st = (b * s.H + h) * s.Tl + i;
        T qr[kLaneElems], dor[kLaneElems];
        load_lane(q + qoff, hd, lane, qr);
        load_lane(dout + qoff, hd, lane, dor);
        const T p = exp_of(scale * warp_dot_regs(qr, kr) - lse[st]);
        const T ds = p * (warp_dot_regs(dor, vr) - D[st]);
        const T a = scale * ds;
#pragma unroll
        for (int u = 0; u < kLaneElems; ++u) {
          dv_acc[u] += p * dor[u];
          dk_acc[u] += a * qr[u];
        }
      }
    }
    if (any) {
      store_lane(dk + koff, hd, lane, dk_acc);
      store_lane(dv + koff, hd, lane, dv_acc);
    }
  }
}

// ---------------------------------------------------------------- copy_block
// Grid-stride over rows x words words of W: dst[r ds + c] = src[r ss + c] (strides in words).
template <typename W>
__global__ void copy_block_kernel(const W* src, W* dst, int64_t rows, int64_t words, int64_t ss, int64_t ds) {
  const int64_t n = rows * words;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const int64_t r = i / words, c = i % words;
    dst[r * ds + c] = src[r * ss + c];
  }
}

// ---------------------------------------------------------------- per-head RMSNorm
// Row r = (token r / n, head first + r % n): x + (r / n) width + (first + r % n) hd.
template <typename T>
__device__ __forceinline__ T* head_row(T* x, int64_t r, int64_t width, int64_t first, int64_t n, int64_t hd) {
  return x + (r / n) * width + (first + r % n) * hd;
}

// Warp per row; lanes stride the hd elements.
template <typename T>
__global__ void __launch_bounds__(kBlock) head_rmsnorm_forward_kernel(T* x, const T* w, T* in, T* rstd, int64_t rows,
                                                                      int64_t width, int64_t first, int64_t n,
                                                                      int64_t hd, T eps) {
  const int lane = lane_id();
  for (int64_t r = warp_row(); r < rows; r += warp_rows()) {
    T* xr = head_row(x, r, width, first, n, hd);
    T* ir = in + r * hd;
    T ss = T(0);
    for (int64_t c = lane; c < hd; c += kWarp) {
      const T xv = xr[c];
      ir[c] = xv;
      ss += xv * xv;
    }
    const T s = T(1) / sqrt_of(warp_sum(ss) / static_cast<T>(hd) + eps);
    for (int64_t c = lane; c < hd; c += kWarp) xr[c] = xr[c] * s * w[c];
    if (lane == 0) rstd[r] = s;
  }
}

// dw partials: grid (ceil(hd / 32), chunks), block (32, 8). Lane = column, warp w sums the
// chunk's rows r0 + w, r0 + w + 8, ... in order; warp 0 adds the 8 sums in order.
constexpr int kColTile = 32;
constexpr int kRowLanes = 8;
constexpr int64_t kChunkRows = 256;
constexpr int64_t kMaxChunks = 1024;
int64_t chunk_rows_for(int64_t rows) { return std::max<int64_t>(kChunkRows, (rows + kMaxChunks - 1) / kMaxChunks); }
int64_t chunks_for(int64_t rows) { return (rows + chunk_rows_for(rows) - 1) / chunk_rows_for(rows); }

template <typename T>
__global__ void __launch_bounds__(kColTile * kRowLanes) head_dw_partials_kernel(const T* dx, const T* in,
                                                                                const T* rstd, T* partials,
                                                                                int64_t rows, int64_t width,
                                                                                int64_t first, int64_t n, int64_t hd,
                                                                                int64_t chunk_rows) {
  __shared__ T sums[kRowLanes][kColTile];
  const int lane = static_cast<int>(threadIdx.x), w = static_cast<int>(threadIdx.y);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColTile + lane, chunk = blockIdx.y;
  const int64_t r0 = chunk * chunk_rows, r1 = rows < r0 + chunk_rows ? rows : r0 + chunk_rows;
  T acc = T(0);
  if (c < hd) {
    for (int64_t r = r0 + w; r < r1; r += kRowLanes) {
      acc += head_row(dx, r, width, first, n, hd)[c] * in[r * hd + c] * rstd[r];
    }
  }
  sums[w][lane] = acc;
  __syncthreads();
  if (w == 0 && c < hd) {
    T total = sums[0][lane];
    for (int k = 1; k < kRowLanes; ++k) total += sums[k][lane];
    partials[chunk * hd + c] = total;
  }
}

// One thread per column: dw[c] += the chunk partials in chunk order.
template <typename T>
__global__ void head_dw_finalize_kernel(const T* partials, int64_t chunks, int64_t hd, T* dw) {
  for (int64_t c = thread_index(); c < hd; c += thread_count()) {
    T s = partials[c];
    for (int64_t k = 1; k < chunks; ++k) s += partials[k * hd + c];
    dw[c] += s;
  }
}

// Warp per row, in place: d = s (g w - x s mean(g w x s)), rmsnorm_row_dx's formula.
template <typename T>
__global__ void __launch_bounds__(kBlock) head_rmsnorm_dx_kernel(T* dx, const T* in, const T* w, const T* rstd,
                                                                 int64_t rows, int64_t width, int64_t first,
                                                                 int64_t n, int64_t hd) {
  const int lane = lane_id();
  for (int64_t r = warp_row(); r < rows; r += warp_rows()) {
    T* gr = head_row(dx, r, width, first, n, hd);
    const T* xr = in + r * hd;
    const T s = rstd[r];
    T sum_gx = T(0);
    for (int64_t c = lane; c < hd; c += kWarp) sum_gx += gr[c] * w[c] * xr[c] * s;
    const T mean_gx = warp_sum(sum_gx) / static_cast<T>(hd);
    for (int64_t c = lane; c < hd; c += kWarp) gr[c] = s * (gr[c] * w[c] - xr[c] * s * mean_gx);
  }
}

size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

// ================================================================ launchers

void vocab_embedding_forward(const int32_t* tokens, const float* weight, float* out, int64_t n, int64_t channels,
                             int64_t begin, int64_t valid, cudaStream_t stream) {
  if (n <= 0 || channels <= 0) return;
  const unsigned grid = grid_for(n, kWarpsPerBlock);
  if (channels % 4 == 0) {  // rows 16-byte aligned (tensors are 256-byte aligned)
    launch<vocab_embedding_forward_kernel<float4>>(grid, kBlock, 0, stream, tokens,
                                                   reinterpret_cast<const float4*>(weight),
                                                   reinterpret_cast<float4*>(out), n, channels / 4, begin, valid);
  } else {
    launch<vocab_embedding_forward_kernel<float>>(grid, kBlock, 0, stream, tokens, weight, out, n, channels, begin,
                                                  valid);
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

// [bad-id slot: 256 B][shifted ids: n int32, rounded up to 256 B][embedding_backward's scratch]
size_t vocab_embedding_backward_scratch_bytes(int64_t n, int64_t channels, int64_t valid) {
  if (n <= 0) return 0;
  return 256 + align_up(static_cast<size_t>(n) * sizeof(int32_t)) +
         embedding_backward_scratch_bytes(n, 1, channels, valid, sizeof(float));
}

void vocab_embedding_backward(const int32_t* tokens, const float* dout, float* dweight, int64_t n, int64_t channels,
                              int64_t begin, int64_t valid, void* scratch, cudaStream_t stream) {
  if (n <= 0 || channels <= 0 || valid <= 0) return;
  char* base = static_cast<char*>(scratch);
  auto* slot = reinterpret_cast<unsigned long long*>(base);
  auto* shifted = reinterpret_cast<int32_t*>(base + 256);
  void* rest = base + 256 + align_up(static_cast<size_t>(n) * sizeof(int32_t));
  LOOM_CUDA_CHECK(cudaMemsetAsync(slot, 0xff, sizeof(unsigned long long), stream));
  launch<vocab_shift_kernel>(grid_for(n, kBlock), kBlock, 0, stream, tokens, shifted, n, begin, valid);
  LOOM_CUDA_CHECK_LAUNCH();
  // Ids outside the slice are -1: embedding_backward skips them (and notes them in `slot`, unread).
  embedding_backward<float>(shifted, dout, dweight, nullptr, n, 1, channels, valid, rest, slot, stream);
}

void add_positions(float* out, const float* positions, int64_t batch, int64_t seq_len, int64_t channels,
                   cudaStream_t stream) {
  const int64_t rows = batch * seq_len;
  if (rows <= 0 || channels <= 0) return;
  if (channels % 4 == 0) {
    const int64_t words = channels / 4;
    launch<add_positions_kernel<float4>>(grid_for(rows * words, kBlock), kBlock, 0, stream,
                                         reinterpret_cast<float4*>(out), reinterpret_cast<const float4*>(positions),
                                         rows, seq_len, words);
  } else {
    launch<add_positions_kernel<float>>(grid_for(rows * channels, kBlock), kBlock, 0, stream, out, positions, rows,
                                        seq_len, channels);
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

void positions_backward(const float* dout, float* dpositions, int64_t batch, int64_t seq_len, int64_t channels,
                        cudaStream_t stream) {
  if (seq_len <= 0 || channels <= 0 || batch <= 0) return;
  launch<positions_backward_kernel>(grid_for(seq_len * channels, kBlock), kBlock, 0, stream, dout, dpositions, batch,
                                    seq_len, channels);
  LOOM_CUDA_CHECK_LAUNCH();
}

void vocab_ce_partials(const float* logits, const int32_t* targets, float* max, float* target, int64_t rows, int64_t V,
                       int64_t begin, int64_t valid, cudaStream_t stream) {
  if (rows <= 0) return;
  launch<vocab_ce_partials_kernel>(grid_for(rows, 1), kBlock, 0, stream, logits, targets, max, target, rows, V, begin,
                                   valid);
  LOOM_CUDA_CHECK_LAUNCH();
}

void vocab_ce_sums(const float* logits, const float* max, float* sums, int64_t rows, int64_t V, int64_t valid,
                   cudaStream_t stream) {
  if (rows <= 0) return;
  launch<vocab_ce_sums_kernel>(grid_for(rows, 1), kBlock, 0, stream, logits, max, sums, rows, V, valid);
  LOOM_CUDA_CHECK_LAUNCH();
}

void vocab_ce_finish(const int32_t* targets, float* lse, const float* sums, float* losses, int64_t rows,
                     cudaStream_t stream) {
  if (rows <= 0) return;
  launch<vocab_ce_finish_kernel>(grid_for(rows, kBlock), kBlock, 0, stream, targets, lse, sums, losses, rows);
  LOOM_CUDA_CHECK_LAUNCH();
}

void vocab_ce_backward(const float* logits, const int32_t* targets, const float* lse, float* dlogits, int64_t rows,
                       int64_t V, int64_t begin, int64_t valid, float scale, cudaStream_t stream) {
  if (rows <= 0 || V <= 0) return;
  launch<vocab_ce_backward_kernel>(grid_for(rows, 1), kBlock, 0, stream, logits, targets, lse, dlogits, rows, V, begin,
                                   valid, scale);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void ring_attention_merge(const T* q, const T* k, const T* v, T* out, T* m, T* l, const RingShape& s,
                          cudaStream_t stream) {
  const int64_t rows = s.B * s.Tl * s.H;
  if (rows <= 0 || s.hd <= 0) return;
  launch<ring_merge_kernel<T>>(grid_for(rows, kWarpsPerBlock), kBlock, 0, stream, q, k, v, out, m, l, s);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void ring_attention_finish(T* out, T* lse, const T* l, int64_t B, int64_t Tl, int64_t H, int64_t hd,
                           cudaStream_t stream) {
  const int64_t n = B * Tl * H * hd;
  if (n <= 0) return;
  launch<ring_finish_kernel<T>>(grid_for(n, kBlock), kBlock, 0, stream, out, lse, l, B, Tl, H, hd);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void attention_row_dot(const T* dout, const T* out, T* D, int64_t B, int64_t Tl, int64_t H, int64_t hd,
                       cudaStream_t stream) {
  const int64_t rows = B * Tl * H;
  if (rows <= 0) return;
  launch<row_dot_kernel<T>>(grid_for(rows, kWarpsPerBlock), kBlock, 0, stream, dout, out, D, B, Tl, H, hd);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void ring_attention_block_backward(const T* q, const T* dout, const T* lse, const T* D, const T* k, const T* v, T* dq,
                                   T* dk, T* dv, const RingShape& s, cudaStream_t stream) {
  if (s.B * s.Tl <= 0 || s.hd <= 0) return;
  launch<ring_backward_dq_kernel<T>>(grid_for(s.B * s.Tl * s.H, kWarpsPerBlock), kBlock, 0, stream, q, dout, lse, D, k,
                                     v, dq, s);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<ring_backward_dkv_kernel<T>>(grid_for(s.B * s.Tl * s.KV, kWarpsPerBlock), kBlock, 0, stream, q, dout, lse, D,
                                      k, v, dk, dv, s);
  LOOM_CUDA_CHECK_LAUNCH();
}

void copy_block(const void* src, void* dst, int64_t rows, int64_t row_bytes, int64_t src_stride_bytes,
                int64_t dst_stride_bytes, cudaStream_t stream) {
  if (rows <= 0 || row_bytes <= 0) return;
  const uint64_t bits = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                        static_cast<uint64_t>(row_bytes) | static_cast<uint64_t>(src_stride_bytes) |
                        static_cast<uint64_t>(dst_stride_bytes);
  const int64_t word = (bits & 15) == 0 ? 16 : (bits & 7) == 0 ? 8 : (bits & 3) == 0 ? 4 : (bits & 1) == 0 ? 2 : 1;
  const int64_t words = row_bytes / word, ss = src_stride_bytes / word, ds = dst_stride_bytes / word;
  const unsigned grid = grid_for(rows * words, kBlock);
  switch (word) {
    case 16:
      launch<copy_block_kernel<int4>>(grid, kBlock, 0, stream, static_cast<const int4*>(src), static_cast<int4*>(dst),
                                      rows, words, ss, ds);
      break;
    case 8:
      launch<copy_block_kernel<int2>>(grid, kBlock, 0, stream, static_cast<const int2*>(src), static_cast<int2*>(dst),
                                      rows, words, ss, ds);
      break;
    case 4:
      launch<copy_block_kernel<uint32_t>>(grid, kBlock, 0, stream, static_cast<const uint32_t*>(src),
                                          static_cast<uint32_t*>(dst), rows, words, ss, ds);
      break;
    case 2:
      launch<copy_block_kernel<uint16_t>>(grid, kBlock, 0, stream, static_cast<const uint16_t*>(src),
                                          static_cast<uint16_t*>(dst), rows, words, ss, ds);
      break;
    default:
      launch<copy_block_kernel<uint8_t>>(grid, kBlock, 0, stream, static_cast<const uint8_t*>(src),
                                         static_cast<uint8_t*>(dst), rows, words, ss, ds);
      break;
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void head_rmsnorm_forward(T* x, const T* w, T* in, T* rstd, int64_t tokens, int64_t width, int64_t first, int64_t n,
                          int64_t hd, double eps, cudaStream_t stream) {
  const int64_t rows = tokens * n;
  if (rows <= 0 || hd <= 0) return;
  launch<head_rmsnorm_forward_kernel<T>>(grid_for(rows, kWarpsPerBlock), kBlock, 0, stream, x, w, in, rstd, rows, width,
                                         first, n, hd, static_cast<T>(eps));
  LOOM_CUDA_CHECK_LAUNCH();
}

size_t head_rmsnorm_backward_scratch_bytes(int64_t tokens, int64_t n, int64_t hd, size_t elem_bytes) {
  const int64_t rows = tokens * n;
  if (rows <= 0 || hd <= 0) return 0;
  return static_cast<size_t>(chunks_for(rows)) * static_cast<size_t>(hd) * elem_bytes;
}

// dw first (it reads d(out)), then d(out) is replaced by d(in) in place, as the CPU.
template <typename T>
void head_rmsnorm_backward(T* dx, const T* in, const T* w, const T* rstd, T* dw, int64_t tokens, int64_t width,
                           int64_t first, int64_t n, int64_t hd, void* scratch, cudaStream_t stream) {
  const int64_t rows = tokens * n;
  if (rows <= 0 || hd <= 0) return;
  const int64_t chunk_rows = chunk_rows_for(rows), chunks = chunks_for(rows);
  T* partials = static_cast<T*>(scratch);
  const dim3 grid(static_cast<unsigned>((hd + kColTile - 1) / kColTile), static_cast<unsigned>(chunks));
  launch<head_dw_partials_kernel<T>>(grid, dim3(kColTile, kRowLanes), 0, stream, dx, in, rstd, partials, rows, width,
                                     first, n, hd, chunk_rows);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<head_dw_finalize_kernel<T>>(grid_for(hd, kBlock), kBlock, 0, stream, partials, chunks, hd, dw);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<head_rmsnorm_dx_kernel<T>>(grid_for(rows, kWarpsPerBlock), kBlock, 0, stream, dx, in, w, rstd, rows, width,
                                    first, n, hd);
  LOOM_CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------- explicit instantiations
#define LOOM_CUDA_PARALLEL_INSTANTIATE(T)                                                                          \
  template void ring_attention_merge<T>(const T*, const T*, const T*, T*, T*, T*, const RingShape&, cudaStream_t); \
  template void ring_attention_finish<T>(T*, T*, const T*, int64_t, int64_t, int64_t, int64_t, cudaStream_t);      \
  template void attention_row_dot<T>(const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t, cudaStream_t);    \
  template void ring_attention_block_backward<T>(const T*, const T*, const T*, const T*, const T*, const T*, T*,   \
                                                 T*, T*, const RingShape&, cudaStream_t);                          \
  template void head_rmsnorm_forward<T>(T*, const T*, T*, T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, \
                                        cudaStream_t);                                                             \
  template void head_rmsnorm_backward<T>(T*, const T*, const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t, \
                                         int64_t, void*, cudaStream_t);

LOOM_CUDA_PARALLEL_INSTANTIATE(float)
LOOM_CUDA_PARALLEL_INSTANTIATE(double)

#undef LOOM_CUDA_PARALLEL_INSTANTIATE

}  // namespace loom::cuda
