// Mixture-of-experts kernels (cuda_moe.h): routing, capacity assignment, dispatch, combine and
// their backwards, the balance losses. Semantics are backend.h's moe_* and the CPU's
// (cpu/cpu_moe_ops.cpp), f32 data with the CPU's double sums. N tokens, E experts, G groups,
// k = top_k, R expert rows, C width, T = seq_len, B = N / T sequences, A = N k assignments.
//
// Kernel (launch shape)                 formula; device-memory bytes and FLOPs
//   moe_route_kernel                    s = softmax(u) (max-shifted, exp and sum in double) or
//     (warp per token, 8 warps/block,   sigmoid(u); sel = s + bias; groups: the topk_groups best
//      grid-stride, grid <= 8192)       groups by the sum of their two best sel; k warp argmaxes
//                                       (ties: lower index); gates = s / sum_sel (renorm) x scale.
//                                       Per token: 4E read + 4E written + 8k; ~E (exp) + 2kE compares.
//                                       sel and flags in shared memory (global scratch when 2E + 2G > 1024).
//   assign_keys_kernel (grid-stride)    key[p] = expert of assignment p = j N + t (priority
//                                       order), value p: 12 B and no FLOPs per assignment.
//   radix_sort_pairs (cuda_sort.h)      stable sort by expert (log2(E + 1) key bits): each
//                                       expert's assignments stay in priority order.
//   assign_counts_kernel (1 block)      start[e] = lower_bound(e) in the sorted keys; load, kept =
//                                       min(load, capacity), offsets = prefix sums (one thread over
//                                       E: a few hundred adds). O(E log A) reads.
//   assign_rows_kernel (grid-stride)    rank = position - start[e]; row = offsets[e] + rank when
//                                       rank < capacity, else -1; token[row] = t. 16 B per assignment.
//   dispatch_kernel<V> (grid-stride,    rows[r] = x[token[r]]: 8 B per element (read + write),
//     float4 when C % 4 == 0)           no FLOPs.
//   combine_kernel<V> (grid-stride)     out[t] += sum_j g_j rows[row_j] (j in order): per element
//                                       (k_kept + 2) x 4 B, 2 k FLOPs.
//   combine_backward_kernel<V>          drows[row_j] = g_j dout[t]: per element 4 B + 4 B per kept
//                                       choice, k FLOPs.
//   balance_chunk_kernel (block per     per token: S = sum_e s, entropy -sum q log q (q = s / S),
//     64-token chunk of a sequence,     lse^2 (double); per chunk and expert: sum_t q_te (token
//     256 threads)                      order) and the chunk's count of e. Reads 8 B (u, s) + 4k B
//                                       per token and expert, ~4E FLOPs + E exp + E log per token.
//   balance_finish_kernel (1 block)     P_e, per-sequence Pb_e / f_e, aux, seq_aux, z, entropy from
//                                       the chunk partials (fixed trees): (N / 64)(2E + 2) x 8 B.
//   sequence_counts_kernel              count[b, e] = assignments of e in sequence b (integer
//     (grid-stride)                     atomicAdd: an exact count in any order). 4 B per assignment.
//   router_backward_kernel (warp per    dg_j = dy_t . ye[row_j] (double); ds through the gates
//     token, 8 warps/block)             (renorm), the balance losses (q = s / S) and z-loss; dlogits
//                                       through softmax or sigmoid. Reads 4C (dy) + 4 k C (ye) + 8E,
//                                       writes 4E bytes per token; 2 k C + ~12 E FLOPs per token.
// The router-side ops are small next to the experts' GEMMs (N E vs N C F); dispatch and combine
// are the memory-bound part (rows of C floats, 16-byte accesses).
//
// Determinism: no floating-point atomics. Warp sums are fixed xor butterflies; block sums fixed
// trees; sums along tokens (q per chunk and expert, chunk partials) run in token order. The only
// atomics are integer: atomicMin on the bad-index slot and atomicAdd of whole counts.
#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)
#include "loom/backend/cuda/cuda_moe.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_launch.h"
#include "loom/backend/cuda/cuda_sort.h"

namespace loom::cuda {
namespace {

constexpr int kBlock = 256;
constexpr int kWarps = kBlock / kWarp;  // warp-per-token kernels: 8 tokens per block at a time
constexpr int kRouteCap = 1024;      // shared floats per warp for the router's buffer (2E + 2G)
constexpr int kChunk = 64;           // tokens per block of the balance statistics
constexpr int kMaxTopK = 64;         // backend.h: top_k <= 64

// (grid_for, align256, thread_index / thread_count, warp_sum, warp_max, block_fold, shfl_xor,
// warp_sync: cuda_device.h.)
// Fixed-tree sum over the kBlock threads of a block (every thread calls it; all get the sum).
__device__ __forceinline__ double block_sum(double v, double* shared) {
  return block_fold<kBlock>(v, shared, [](double a, double b) { return a + b; });
}

// The best candidate of a warp: the largest value, ties to the lower index (idx -1: none). The
// order is total on (value, index), so every lane of the butterfly ends with the same winner.
__device__ __forceinline__ void best_of(float& v, int& idx, float ov, int oidx) {
  if (oidx < 0) return;
  if (idx < 0 || ov > v || (ov == v && oidx < idx)) v = ov, idx = oidx;
}
__device__ __forceinline__ int warp_argmax(float v, int idx) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    const float ov = shfl_xor(v, off);
    const int oidx = shfl_xor(idx, off);
    best_of(v, idx, ov, oidx);
  }
  return idx;
}

// ---------------------------------------------------------------- router
// Warp per token, tokens taken block by block (a block-uniform loop with a barrier per round, so
// the warps' buffers are reused only after every reader is done). The warp's buffer: sel (E) |
// group scores (G) | keep flags (G) | out flags (E), in shared memory, or in `gbuf` (global warp
// index x (2E + 2G) floats) when that does not fit. sel[e] and out[e] are written only by the
// lane that owns e (e = lane mod 32), group g's entries by lane g mod 32.
__global__ void __launch_bounds__(kBlock)
    moe_route_kernel(const float* __restrict__ u, const float* __restrict__ bias, float* __restrict__ scores,
                     int32_t* __restrict__ expert, float* __restrict__ gates, float* __restrict__ gbuf, int64_t n,
                     MoeRoute r) {
  __shared__ float sbuf[kWarps][kRouteCap];
  const int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const int E = static_cast<int>(r.experts), K = static_cast<int>(r.top_k), G = static_cast<int>(r.groups);
  const int per_group = E / G;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kWarps + w;
  float* sel = gbuf != nullptr ? gbuf + gw * (2 * E + 2 * G) : sbuf[w];
  float* group_score = sel + E;
  float* keep = group_score + G;
  float* out = keep + G;  // 1: dropped with its group, or already chosen
  const float kOut = -CUDART_INF_F;
  for (int64_t t0 = static_cast<int64_t>(blockIdx.x) * kWarps; t0 < n;
       t0 += static_cast<int64_t>(gridDim.x) * kWarps) {  // block-uniform
    __syncthreads();  // the previous round's readers of the buffers are done
    const int64_t t = t0 + w;
    if (t >= n) continue;  // warp-uniform
    const float* ut = u + t * E;
    float* st = scores + t * E;
    if (r.sigmoid) {
      for (int e = lane; e < E; e += kWarp) {
        const float s = 1.0f / (1.0f + expf(-ut[e]));
        st[e] = s;
        sel[e] = s + bias[e];
        out[e] = 0.0f;
      }
    } else {
      float m = kOut;
      for (int e = lane; e < E; e += kWarp) m = ut[e] > m ? ut[e] : m;
      m = warp_max(m);
      double sum = 0.0;
      for (int e = lane; e < E; e += kWarp) sum += ::exp(static_cast<double>(ut[e] - m));
      sum = warp_sum(sum);
      for (int e = lane; e < E; e += kWarp) {
        const float s = static_cast<float>(::exp(static_cast<double>(ut[e] - m)) / sum);
        st[e] = s;
        sel[e] = s + bias[e];
        out[e] = 0.0f;
      }
    }
    warp_sync();
    if (G > 1) {
      for (int g = lane; g < G; g += kWarp) {  // the sum of the group's two best selection scores
        float a = kOut, c = kOut;
        for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
          if (sel[e] > a) c = a, a = sel[e];
          else if (sel[e] > c) c = sel[e];
        }
        group_score[g] = per_group > 1 ? a + c : a;
        keep[g] = 0.0f;
      }
      warp_sync();
      for (int64_t k = 0; k < r.topk_groups; ++k) {  // ties: the lower group
        float v = 0.0f;
        int idx = -1;
        for (int g = lane; g < G; g += kWarp) {
          if (keep[g] == 0.0f && (idx < 0 || group_score[g] > v)) v = group_score[g], idx = g;
        }
        const int best = warp_argmax(v, idx);
        if (best >= 0 && lane == best % kWarp) keep[best] = 1.0f;
        warp_sync();
      }
      for (int e = lane; e < E; e += kWarp) {
        if (keep[e / per_group] == 0.0f) out[e] = 1.0f;
      }
      warp_sync();
    }
    // Top k of the selection scores, best first (ties: the lower index); gates from the unbiased s.
    double sum_sel = 0.0;
    float mine0 = 0.0f, mine1 = 0.0f;  // s of choices j = lane and j = lane + 32
    for (int j = 0; j < K; ++j) {
      float v = 0.0f;
      int idx = -1;
      for (int e = lane; e < E; e += kWarp) {
        if (out[e] == 0.0f && sel[e] != kOut && (idx < 0 || sel[e] > v)) v = sel[e], idx = e;
      }
      const int best = warp_argmax(v, idx);
      if (best >= 0 && lane == best % kWarp) out[best] = 1.0f;
      if (lane == 0) expert[t * K + j] = best;
      const float s = best >= 0 ? st[best] : 0.0f;
      sum_sel += s;
      if (j == lane) mine0 = s;
      if (j == lane + kWarp) mine1 = s;
      warp_sync();
    }
    for (int j = lane; j < K; j += kWarp) {
      const double g = (j < kWarp ? mine0 : mine1) / (r.renorm ? sum_sel : 1.0);
      gates[t * K + j] = static_cast<float>(g * r.route_scale);
    }
  }
}

// ---------------------------------------------------------------- capacity
__global__ void assign_keys_kernel(const int32_t* __restrict__ expert, uint32_t* __restrict__ keys,
                                   uint32_t* __restrict__ values, int64_t n, int64_t k, int64_t experts,
                                   unsigned long long* bad) {
  const int64_t a_count = n * k;
  for (int64_t p = thread_index(); p < a_count; p += thread_count()) {
    const int64_t j = p / n, t = p % n;
    const int32_t e = expert[t * k + j];
    const bool ok = e >= 0 && e < experts;
    if (!ok) atomicMin(bad, static_cast<unsigned long long>(t * k + j));
    keys[p] = ok ? static_cast<uint32_t>(e) : static_cast<uint32_t>(experts);  // bad ids sort last
    values[p] = static_cast<uint32_t>(p);
  }
}

// One block: start[e] (e <= E) by binary search over the sorted keys, then the counts by thread 0.
__global__ void __launch_bounds__(1024)
    assign_counts_kernel(const uint32_t* __restrict__ keys, int64_t a_count, int64_t experts, int64_t capacity,
                         int64_t token_len, int64_t* __restrict__ start, int32_t* __restrict__ counts,
                         unsigned long long* bad) {
  for (int64_t e = threadIdx.x; e <= experts; e += blockDim.x) {
    int64_t lo = 0, hi = a_count;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (keys[mid] < static_cast<uint32_t>(e)) lo = mid + 1;
      else hi = mid;
    }
    start[e] = lo;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  // Sequential over the E experts (a few hundred adds at most).
  int32_t* load = counts;
  int32_t* kept = counts + experts;
  int32_t* offsets = kept + experts;
  int64_t offset = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t l = start[e + 1] - start[e];
    const int64_t kk = l < capacity ? l : capacity;
    load[e] = static_cast<int32_t>(l);
    kept[e] = static_cast<int32_t>(kk);
    offsets[e] = static_cast<int32_t>(offset);
    offset += kk;
  }
  offsets[experts] = static_cast<int32_t>(offset);
  if (offset > token_len) atomicMin(bad, static_cast<unsigned long long>(a_count + offset));
}

__global__ void assign_rows_kernel(const uint32_t* __restrict__ keys, const uint32_t* __restrict__ values,
                                   const int64_t* __restrict__ start, const int32_t* __restrict__ counts,
                                   int32_t* __restrict__ row, int32_t* __restrict__ token, int64_t n, int64_t k,
                                   int64_t experts, int64_t capacity, int64_t token_len) {
  const int64_t a_count = n * k;
  const int32_t* offsets = counts + 2 * experts;
  for (int64_t i = thread_index(); i < a_count; i += thread_count()) {
    const uint32_t e = keys[i];
    if (e >= static_cast<uint32_t>(experts)) continue;  // a bad id: the op throws
    const int64_t p = values[i], rank = i - start[e];
    const int64_t j = p / n, t = p % n;
    int32_t r = -1;
    if (rank < capacity) {
      r = static_cast<int32_t>(offsets[e] + rank);
      if (r < token_len) token[r] = static_cast<int32_t>(t);
    }
    row[t * k + j] = r;
  }
}

// ---------------------------------------------------------------- dispatch / combine
// V = float4 (C % 4 == 0, 16-byte aligned rows) or float; widths in V.
__device__ __forceinline__ void axpy(float& acc, float g, float v) { acc += g * v; }
__device__ __forceinline__ void axpy(float4& acc, float g, const float4& v) {
  acc.x += g * v.x;
  acc.y += g * v.y;
  acc.z += g * v.z;
  acc.w += g * v.w;
}
__device__ __forceinline__ void add_to(float& acc, float v) { acc += v; }
__device__ __forceinline__ void add_to(float4& acc, const float4& v) {
  acc.x += v.x;
  acc.y += v.y;
  acc.z += v.z;
  acc.w += v.w;
}
__device__ __forceinline__ float scaled(float g, float v) { return g * v; }
__device__ __forceinline__ float4 scaled(float g, const float4& v) {
  return make_float4(g * v.x, g * v.y, g * v.z, g * v.w);
}

template <typename V>
__global__ void dispatch_kernel(const V* __restrict__ x, const int32_t* __restrict__ token, V* __restrict__ rows,
                                int64_t n_rows, int64_t tokens, int64_t width, unsigned long long* bad) {
  const int64_t total = n_rows * width;
  for (int64_t i = thread_index(); i < total; i += thread_count()) {
    const int64_t r = i / width, c = i % width;
    const int32_t t = token[r];
    if (t < 0 || t >= tokens) {
      if (c == 0) atomicMin(bad, static_cast<unsigned long long>(r));
      continue;
    }
    rows[i] = x[t * width + c];
  }
}

template <typename V>
__global__ void combine_kernel(const V* __restrict__ rows, const int32_t* __restrict__ row,
                               const float* __restrict__ gates, V* __restrict__ out, int64_t tokens, int64_t k,
                               int64_t n_rows, int64_t width) {
  const int64_t total = tokens * width;
  for (int64_t i = thread_index(); i < total; i += thread_count()) {
    const int64_t t = i / width, c = i % width;
    V acc = out[i];
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = row[t * k + j];
      if (r < 0 || r >= n_rows) continue;
      if (gates != nullptr) axpy(acc, gates[t * k + j], rows[r * width + c]);
      else add_to(acc, rows[r * width + c]);
    }
    out[i] = acc;
  }
}

template <typename V>
__global__ void combine_backward_kernel(const V* __restrict__ dout, const int32_t* __restrict__ row,
                                        const float* __restrict__ gates, V* __restrict__ drows, int64_t tokens,
                                        int64_t k, int64_t n_rows, int64_t width) {
  const int64_t total = tokens * width;
  for (int64_t i = thread_index(); i < total; i += thread_count()) {
    const int64_t t = i / width, c = i % width;
    const V d = dout[i];
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = row[t * k + j];
      if (r >= 0 && r < n_rows) drows[r * width + c] = scaled(gates[t * k + j], d);
    }
  }
}

bool vec4_ok(int64_t channels, std::initializer_list<const void*> ptrs) {
  if (channels % 4 != 0) return false;
  for (const void* p : ptrs) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// ---------------------------------------------------------------- balance statistics
struct ChunkGrid {
  int64_t per_seq, count;  // chunks per sequence, in all
};
ChunkGrid chunk_grid(int64_t tokens, int64_t seq_len) {
  const int64_t per_seq = (seq_len + kChunk - 1) / kChunk;
  return {per_seq, (tokens / seq_len) * per_seq};
}

// Block per chunk (kChunk tokens of one sequence). Outputs per chunk c: pq[c E + e] = sum_t q_te,
// fc[c E + e] = the chunk's assignments to e, zc[c] = sum_t lse_t^2, ec[c] = sum_t sum_e q log q.
__global__ void __launch_bounds__(kBlock)
    balance_chunk_kernel(const float* __restrict__ u, const float* __restrict__ scores,
                         const int32_t* __restrict__ expert, double* __restrict__ pq, double* __restrict__ fc,
                         double* __restrict__ zc, double* __restrict__ ec, int64_t chunks, int64_t per_seq,
                         MoeRoute r) {
  __shared__ double row_sum[kChunk], row_ent[kChunk], row_z[kChunk];
  const int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const int E = static_cast<int>(r.experts), K = static_cast<int>(r.top_k);
  const int64_t T = r.seq_len;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t b = c / per_seq, t0 = b * T + (c % per_seq) * kChunk;
    const int64_t t1 = t0 + kChunk < (b + 1) * T ? t0 + kChunk : (b + 1) * T;
    const int nt = static_cast<int>(t1 - t0);
    __syncthreads();  // the previous chunk's readers are done
    for (int tt = w; tt < nt; tt += kWarps) {  // warp per token
      const float* st = scores + (t0 + tt) * E;
      const float* ut = u + (t0 + tt) * E;
      double sum = 0.0;
      for (int e = lane; e < E; e += kWarp) sum += st[e];
      sum = warp_sum(sum);
      double ent = 0.0;
      for (int e = lane; e < E; e += kWarp) {
        const double q = st[e] / sum;
        if (q > 0.0) ent += q * ::log(q);
      }
      ent = warp_sum(ent);
      float m = -CUDART_INF_F;
      for (int e = lane; e < E; e += kWarp) m = ut[e] > m ? ut[e] : m;
      m = warp_max(m);
      double se = 0.0;
      for (int e = lane; e < E; e += kWarp) se += ::exp(static_cast<double>(ut[e] - m));
      se = warp_sum(se);
      const double lse = m + ::log(se);
      if (lane == 0) row_sum[tt] = sum, row_ent[tt] = ent, row_z[tt] = lse * lse;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // token order
      double z = 0.0, ent = 0.0;
      for (int tt = 0; tt < nt; ++tt) z += row_z[tt], ent += row_ent[tt];
      zc[c] = z;
      ec[c] = ent;
    }
    for (int e = threadIdx.x; e < E; e += kBlock) {  // token order
      double p = 0.0, f = 0.0;
      for (int tt = 0; tt < nt; ++tt) {
        p += scores[(t0 + tt) * E + e] / row_sum[tt];
        for (int j = 0; j < K; ++j) f += expert[(t0 + tt) * K + j] == e ? 1.0 : 0.0;
      }
      pq[c * E + e] = p;
      fc[c * E + e] = f;
    }
  }
}

// One block: the four statistics from the chunk partials.
__global__ void __launch_bounds__(kBlock)
    balance_finish_kernel(const double* __restrict__ pq, const double* __restrict__ fc, const double* __restrict__ zc,
                          const double* __restrict__ ec, const int32_t* __restrict__ load, double* __restrict__ stats,
                          int64_t n, int64_t per_seq, MoeRoute r) {
  __shared__ double red[kBlock];
  const int64_t E = r.experts, K = r.top_k, T = r.seq_len, B = n / T, chunks = B * per_seq;
  double aux = 0.0, seq = 0.0;
  for (int64_t e = threadIdx.x; e < E; e += kBlock) {
    double P = 0.0, lb = 0.0;
    for (int64_t b = 0; b < B; ++b) {
      double Pb = 0.0, f = 0.0;
      for (int64_t c = b * per_seq; c < (b + 1) * per_seq; ++c) Pb += pq[c * E + e], f += fc[c * E + e];
      P += Pb;
      lb += (static_cast<double>(E) / static_cast<double>(K * T) * f) * (Pb / static_cast<double>(T));
    }
    aux += static_cast<double>(load[e]) / static_cast<double>(K * n) * P / static_cast<double>(n);
    seq += lb;
  }
  double z = 0.0, ent = 0.0;
  for (int64_t c = threadIdx.x; c < chunks; c += kBlock) z += zc[c], ent += ec[c];
  aux = block_sum(aux, red);
  seq = block_sum(seq, red);
  z = block_sum(z, red);
  ent = block_sum(ent, red);
  if (threadIdx.x == 0) {
    stats[0] = r.aux_alpha * static_cast<double>(E) * aux;
    stats[1] = r.seq_aux_alpha * seq / static_cast<double>(B);
    stats[2] = r.z_alpha * z / static_cast<double>(n);
    stats[3] = -ent / static_cast<double>(n);
  }
}

// ---------------------------------------------------------------- router backward
__global__ void sequence_counts_kernel(const int32_t* __restrict__ expert, int32_t* __restrict__ count, int64_t n,
                                       int64_t k, int64_t experts, int64_t seq_len) {
  for (int64_t a = thread_index(); a < n * k; a += thread_count()) {
    const int32_t e = expert[a];
    if (e >= 0 && e < experts) atomicAdd(count + (a / k / seq_len) * experts + e, 1);
  }
}

__device__ __forceinline__ void dot_acc(double& acc, float a, float b) { acc += static_cast<double>(a) * b; }
__device__ __forceinline__ void dot_acc(double& acc, const float4& a, const float4& b) {
  acc += static_cast<double>(a.x) * b.x;
  acc += static_cast<double>(a.y) * b.y;
  acc += static_cast<double>(a.z) * b.z;
  acc += static_cast<double>(a.w) * b.w;
}

// Warp per token; V = float4 when C % 4 == 0 (width in V). count: per sequence and expert (null
// without the sequence-wise loss).
template <typename V>
__global__ void __launch_bounds__(kBlock)
    router_backward_kernel(const float* __restrict__ u, const float* __restrict__ scores,
                           const int32_t* __restrict__ expert, const int32_t* __restrict__ row,
                           const V* __restrict__ ye, const V* __restrict__ dy, const int32_t* __restrict__ load,
                           const int32_t* __restrict__ count, float* __restrict__ dlogits, int64_t n, int64_t width,
                           MoeRoute r) {
  __shared__ double dg_sh[kWarps][kMaxTopK];
  __shared__ int32_t e_sh[kWarps][kMaxTopK];
  const int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const int E = static_cast<int>(r.experts), K = static_cast<int>(r.top_k);
  const int64_t T = r.seq_len, B = n / T;
  const bool any_aux = r.aux_alpha > 0.0f || r.seq_aux_alpha > 0.0f;
  const double z_coeff = r.loss_weight * r.z_alpha * 2.0 / static_cast<double>(n);
  double* dg = dg_sh[w];
  int32_t* ex = e_sh[w];
  for (int64_t t0 = static_cast<int64_t>(blockIdx.x) * kWarps; t0 < n;
       t0 += static_cast<int64_t>(gridDim.x) * kWarps) {  // block-uniform
    __syncthreads();  // the previous round's readers of dg and ex are done
    const int64_t t = t0 + w;
    if (t >= n) continue;  // warp-uniform
    const float* st = scores + t * E;
    // Gates: dg_j = dy_t . ye[row_j] (double); S = sum of the selected s; dgs = sum_j dg_j s_j.
    double S = 0.0, dgs = 0.0;
    for (int j = 0; j < K; ++j) {
      const int32_t rr = row[t * K + j];
      double d = 0.0;
      if (rr >= 0) {
        for (int64_t i = lane; i < width; i += kWarp) dot_acc(d, dy[t * width + i], ye[rr * width + i]);
        d = warp_sum(d);
      }
      const int32_t e = expert[t * K + j];
      if (lane == 0) dg[j] = d, ex[j] = e;
      S += st[e];
      dgs += d * st[e];
    }
    warp_sync();
    // The balance losses' coefficient of q_te: Switch's and the sequence's (DeepSeek-V3).
    const auto coeff = [&](int e) {
      const double f = static_cast<double>(load[e]) / static_cast<double>(K * n);
      double c = r.loss_weight * r.aux_alpha * static_cast<double>(E) * f / static_cast<double>(n);
      if (count != nullptr) {
        const double v = count[(t / T) * E + e];
        c += r.loss_weight * r.seq_aux_alpha * static_cast<double>(E) / static_cast<double>(K * T) * v /
             static_cast<double>(T * B);
      }
      return c;
    };
    double sum = 0.0, cq = 0.0;
    if (any_aux) {
      for (int e = lane; e < E; e += kWarp) sum += st[e];
      sum = warp_sum(sum);
      for (int e = lane; e < E; e += kWarp) cq += coeff(e) * st[e] / sum;
      cq = warp_sum(cq);
    }
    const auto ds_of = [&](int e) {
      double ds = 0.0;
      for (int j = 0; j < K; ++j) {
        if (ex[j] == e) ds += r.renorm ? r.route_scale * (dg[j] / S - dgs / (S * S)) : r.route_scale * dg[j];
      }
      if (any_aux) ds += (coeff(e) - cq) / sum;
      return ds;
    };
    double dot = 0.0;
    if (!r.sigmoid) {
      for (int e = lane; e < E; e += kWarp) dot += ds_of(e) * st[e];
      dot = warp_sum(dot);
    }
    double lse = 0.0;
    const float* ut = u + t * E;
    if (r.z_alpha > 0.0f) {
      float m = -CUDART_INF_F;
      for (int e = lane; e < E; e += kWarp) m = ut[e] > m ? ut[e] : m;
      m = warp_max(m);
      double se = 0.0;
      for (int e = lane; e < E; e += kWarp) se += ::exp(static_cast<double>(ut[e] - m));
      se = warp_sum(se);
      lse = m + ::log(se);
    }
    float* dut = dlogits + t * E;
    for (int e = lane; e < E; e += kWarp) {
      const double ds = ds_of(e);
      float d = r.sigmoid ? static_cast<float>(ds * st[e] * (1.0 - st[e])) : static_cast<float>(st[e] * (ds - dot));
      if (r.z_alpha > 0.0f) d += static_cast<float>(z_coeff * lse * ::exp(static_cast<double>(ut[e]) - lse));
      dut[e] = d;
    }
  }
}

}  // namespace

// ---------------------------------------------------------------- launchers
size_t moe_route_scratch_bytes(int64_t tokens, const MoeRoute& r) {
  const int64_t per_warp = 2 * r.experts + 2 * r.groups;
  if (per_warp <= kRouteCap) return 0;
  return static_cast<size_t>(grid_for(tokens, kWarps)) * kWarps * static_cast<size_t>(per_warp) * sizeof(float);
}

void moe_route(const float* logits, const float* bias, float* scores, int32_t* expert, float* gates, void* scratch,
               int64_t tokens, const MoeRoute& r, cudaStream_t stream) {
  if (tokens <= 0) return;
  float* gbuf = moe_route_scratch_bytes(tokens, r) > 0 ? static_cast<float*>(scratch) : nullptr;
  launch<moe_route_kernel>(grid_for(tokens, kWarps), kBlock, 0, stream, logits, bias, scores, expert, gates, gbuf,
                           tokens, r);
  LOOM_CUDA_CHECK_LAUNCH();
}

namespace {
// moe_assign's scratch: keys and values in and out (A u32 each), start (E + 1 i64), the sort's temp.
struct AssignLayout {
  size_t keys_in, keys_out, values_in, values_out, start, cub, cub_bytes, total;
};
int key_bits(int64_t experts) {  // ids 0 .. E (E: a bad id)
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) <= experts) ++bits;
  return bits;
}
AssignLayout assign_layout(int64_t a_count, int64_t experts) {
  AssignLayout l{};
  const size_t ids = align256(static_cast<size_t>(a_count) * sizeof(uint32_t));
  l.keys_in = 0;
  l.keys_out = l.keys_in + ids;
  l.values_in = l.keys_out + ids;
  l.values_out = l.values_in + ids;
  l.start = l.values_out + ids;
  l.cub = l.start + align256(static_cast<size_t>(experts + 1) * sizeof(int64_t));
  l.cub_bytes = radix_sort_pairs_bytes(a_count, key_bits(experts));
  l.total = l.cub + align256(l.cub_bytes);
  return l;
}
}  // namespace

size_t moe_assign_scratch_bytes(int64_t tokens, int64_t top_k, int64_t experts) {
  return assign_layout(tokens * top_k, experts).total;
}

void moe_assign(const int32_t* expert, int64_t tokens, int64_t top_k, int64_t experts, int64_t capacity, int32_t* row,
                int32_t* token, int64_t token_len, int32_t* counts, void* scratch, unsigned long long* bad,
                cudaStream_t stream) {
  const int64_t a_count = tokens * top_k;
  if (a_count == 0) {
    LOOM_CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<size_t>(3 * experts + 1) * sizeof(int32_t), stream));
    return;
  }
  const AssignLayout l = assign_layout(a_count, experts);
  char* base = static_cast<char*>(scratch);
  auto* keys_in = reinterpret_cast<uint32_t*>(base + l.keys_in);
  auto* keys_out = reinterpret_cast<uint32_t*>(base + l.keys_out);
  auto* values_in = reinterpret_cast<uint32_t*>(base + l.values_in);
  auto* values_out = reinterpret_cast<uint32_t*>(base + l.values_out);
  auto* start = reinterpret_cast<int64_t*>(base + l.start);
  launch<assign_keys_kernel>(grid_for(a_count, kBlock), kBlock, 0, stream, expert, keys_in, values_in, tokens, top_k,
                             experts, bad);
  LOOM_CUDA_CHECK_LAUNCH();
  radix_sort_pairs(base + l.cub, l.cub_bytes, keys_in, keys_out, values_in, values_out, a_count, key_bits(experts),
                   stream);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<assign_counts_kernel>(dim3(1), dim3(1024), 0, stream, static_cast<const uint32_t*>(keys_out), a_count,
                               experts, capacity, token_len, start, counts, bad);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<assign_rows_kernel>(grid_for(a_count, kBlock), kBlock, 0, stream, static_cast<const uint32_t*>(keys_out),
                             static_cast<const uint32_t*>(values_out), static_cast<const int64_t*>(start),
                             static_cast<const int32_t*>(counts), row, token, tokens, top_k, experts, capacity,
                             token_len);
  LOOM_CUDA_CHECK_LAUNCH();
}

void moe_dispatch(const float* x, const int32_t* token, float* rows, int64_t n_rows, int64_t tokens, int64_t channels,
                  unsigned long long* bad, cudaStream_t stream) {
  if (n_rows <= 0 || channels <= 0) return;
  if (vec4_ok(channels, {x, rows})) {
    const int64_t width = channels / 4;
    launch<dispatch_kernel<float4>>(grid_for(n_rows * width, kBlock), kBlock, 0, stream,
                                    reinterpret_cast<const float4*>(x), token, reinterpret_cast<float4*>(rows), n_rows,
                                    tokens, width, bad);
  } else {
    launch<dispatch_kernel<float>>(grid_for(n_rows * channels, kBlock), kBlock, 0, stream, x, token, rows, n_rows,
                                   tokens, channels, bad);
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

void moe_combine(const float* rows, const int32_t* row, const float* gates, float* out, int64_t tokens, int64_t top_k,
                 int64_t n_rows, int64_t channels, cudaStream_t stream) {
  if (tokens <= 0 || channels <= 0) return;
  if (vec4_ok(channels, {rows, out})) {
    const int64_t width = channels / 4;
    launch<combine_kernel<float4>>(grid_for(tokens * width, kBlock), kBlock, 0, stream,
                                   reinterpret_cast<const float4*>(rows), row, gates, reinterpret_cast<float4*>(out),
                                   tokens, top_k, n_rows, width);
  } else {
    launch<combine_kernel<float>>(grid_for(tokens * channels, kBlock), kBlock, 0, stream, rows, row, gates, out, tokens,
                                  top_k, n_rows, channels);
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

void moe_combine_backward(const float* dout, const int32_t* row, const float* gates, float* drows, int64_t tokens,
                          int64_t top_k, int64_t n_rows, int64_t channels, cudaStream_t stream) {
  if (tokens <= 0 || channels <= 0) return;
  if (vec4_ok(channels, {dout, drows})) {
    const int64_t width = channels / 4;
    launch<combine_backward_kernel<float4>>(grid_for(tokens * width, kBlock), kBlock, 0, stream,
                                            reinterpret_cast<const float4*>(dout), row, gates,
                                            reinterpret_cast<float4*>(drows), tokens, top_k, n_rows, width);
  } else {
    launch<combine_backward_kernel<float>>(grid_for(tokens * channels, kBlock), kBlock, 0, stream, dout, row, gates,
                                           drows, tokens, top_k, n_rows, channels);
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

size_t moe_balance_stats_scratch_bytes(int64_t tokens, const MoeRoute& r) {
  const ChunkGrid g = chunk_grid(tokens, r.seq_len);
  return static_cast<size_t>(g.count * (2 * r.experts + 2)) * sizeof(double);
}

void moe_balance_stats(const float* logits, const float* scores, const int32_t* expert, const int32_t* counts,
                       double* stats, void* scratch, int64_t tokens, const MoeRoute& r, cudaStream_t stream) {
  const ChunkGrid g = chunk_grid(tokens, r.seq_len);
  double* pq = static_cast<double*>(scratch);
  double* fc = pq + g.count * r.experts;
  double* zc = fc + g.count * r.experts;
  double* ec = zc + g.count;
  if (g.count > 0) {
    launch<balance_chunk_kernel>(grid_for(g.count, 1), kBlock, 0, stream, logits, scores, expert, pq, fc, zc, ec,
                                 g.count, g.per_seq, r);
    LOOM_CUDA_CHECK_LAUNCH();
  }
  launch<balance_finish_kernel>(dim3(1), dim3(kBlock), 0, stream, static_cast<const double*>(pq),
                                static_cast<const double*>(fc), static_cast<const double*>(zc),
                                static_cast<const double*>(ec), counts, stats, tokens, g.per_seq, r);
  LOOM_CUDA_CHECK_LAUNCH();
}

size_t moe_router_backward_scratch_bytes(int64_t tokens, const MoeRoute& r) {
  return static_cast<size_t>((tokens / r.seq_len) * r.experts) * sizeof(int32_t);
}

void moe_router_backward(const float* logits, const float* scores, const int32_t* expert, const int32_t* row,
                         const float* ye, const float* dy, const int32_t* counts, float* dlogits, void* scratch,
                         int64_t tokens, int64_t channels, const MoeRoute& r, cudaStream_t stream) {
  if (tokens <= 0) return;
  int32_t* count = nullptr;
  if (r.seq_aux_alpha > 0.0f) {
    count = static_cast<int32_t*>(scratch);
    LOOM_CUDA_CHECK(cudaMemsetAsync(count, 0, moe_router_backward_scratch_bytes(tokens, r), stream));
    launch<sequence_counts_kernel>(grid_for(tokens * r.top_k, kBlock), kBlock, 0, stream, expert, count, tokens,
                                   r.top_k, r.experts, r.seq_len);
    LOOM_CUDA_CHECK_LAUNCH();
  }
  const unsigned grid = grid_for(tokens, kWarps);
  if (vec4_ok(channels, {ye, dy})) {
    launch<router_backward_kernel<float4>>(grid, kBlock, 0, stream, logits, scores, expert, row,
                                           reinterpret_cast<const float4*>(ye), reinterpret_cast<const float4*>(dy),
                                           counts, static_cast<const int32_t*>(count), dlogits, tokens, channels / 4, r);
  } else {
    launch<router_backward_kernel<float>>(grid, kBlock, 0, stream, logits, scores, expert, row, ye, dy, counts,
                                          static_cast<const int32_t*>(count), dlogits, tokens, channels, r);
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace loom::cuda
