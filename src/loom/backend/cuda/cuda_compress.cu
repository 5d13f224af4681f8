// CUDA kernels of the gradient compression ops (cuda_compress.h; contracts in backend.h, CPU twins
// in cpu/cpu_compress.cpp, the methods in parallel/compress.h). Every kernel computes its CPU
// twin's formula with the same IEEE operations in the same order, so every output is the CPU's
// bytes (the op tests compare bitwise). Where GCC contracts the CPU's a * b + c into an fma
// (-march=x86-64-v3, fp-contract=fast: DGC's momentum, Gram-Schmidt's dots and updates, the
// expansion's beta term) the kernels call fma explicitly; where the CPU rounds a product
// separately they use mul_rn (__fmul_rn / __dmul_rn), which nvcc never contracts.
//
// Roofline (H100 SXM: ~3.35 TB/s, 67 TFLOP/s f64; n elements, B bytes through device memory,
// F floating-point operations; "chain" marks a sequential dependency the contract imposes):
//   seq_sum        s = sum_i f(x_i) in double, in index order (f = x^2 for DGC's clip and QSGD's
//                  norm, |x| for 1-bit's scale), then the op's scalar (sqrt, clip / norm, s / n).
//                  4 B/elem read, 2 F/elem, one dependent f64 add (an fma for x^2, exact product)
//                  per element: a chain of ~n x 4-8 cycles in one thread, about 3-5 ms per 10^6
//                  elements (the contract's "in order" sum forbids a tree; the op tests compare
//                  bitwise, and the bits of a sequential sum need the sequence). One block of 256: warps 1-7
//                  stage 2048-element chunks into shared memory (double buffered, coalesced)
//                  while thread 0 adds the previous chunk (16-byte shared loads).
//   dgc_update     g *= scale (if clipped); u = fma(m, u, g); v += u.
//                  20 B/elem (g, u, v read; u, v written; g written when clipped), 3 F/elem.
//                  Grid-stride, 256 threads, <= 8192 blocks; float4 per thread when g, u, v are
//                  16-byte aligned (the n % 4 tail and unaligned views: scalar).
//   onebit_encode  bit = x < 0 (warp ballot = one word); x -= bit ? -s : s.
//                  8 B/elem + 1/8 B/elem (words), 1 F/elem. Warp per 32-element word, grid-stride.
//   onebit_decode  out += bit ? -s_r : s_r for r = 0 .. R-1.   8 B/elem + R/8 B/elem, R F/elem.
//                  Thread per 4 elements (float4 when out is 16-byte aligned; the word is a
//                  broadcast within 8 lanes), grid-stride.
//   qsgd_encode    x = |g| / norm * s; l = floor x; level = l + [u < x - l]; byte = sign(g) level.
//                  5 B/elem, ~6 F/elem + one Philox4x32-10 block (10 rounds, 2 mul.wide each) per
//                  4 elements. Thread per 4-element word (a float4 load when g is 16-byte
//                  aligned), grid-stride.
//   qsgd_decode    out = fma(norm_r / s, byte, out), r in order.  8 B/elem + R B/elem, 3R F/elem.
//                  Thread per 4-element word (one u32 per rank; float4 out when 16-byte
//                  aligned), grid-stride.
//   scatter_zero   x[idx[j]] = 0.  4 B read + 4 B written per index. Thread per index.
//   scatter_add    out[idx[j]] += val[j], j in order per index: keys kernel (8 B/index), CUB
//                  radix sort of (idx, j) (stable: equal indices keep j order; ~4 passes x 16 B
//                  per index), then one thread per run of equal indices adds its values in j
//                  order (12 B/index + 8 B per distinct index, 1 F/index).
//   topk           keys kernel (key = 0x7fffffff - |acc| bits: ascending key = descending |acc|,
//                  8 B/elem), CUB stable radix sort of (key, index) over 31 bits (ties keep the
//                  lower index first; ~4 passes x 16 B/elem), CUB sort of the first k indices
//                  (ascending order), gather kernel (idx, val written, acc[i] zeroed: 16 B per
//                  selected entry). Exact; NaN ranks above infinity.
//   project        out[o, j] = sum_t A[o, t] B[t, j] in double, t in order (A = m or m^T).
//                  Per output entry: 2 F per t (one f64 fma); bytes: m read once per j-tile of 8
//                  (4 B rows cols per tile) + q. Block of 256 = (32 x 8/JT) outputs x JT columns,
//                  32 x 32 tiles of m staged through shared memory (coalesced for both layouts,
//                  padded against bank conflicts); chain of length cols (rows) per thread.
//   orthonormalize modified Gram-Schmidt in double, twice: r (r + 1) / 2 dots of length rows per
//                  pass, each a chain of f64 fmas by thread 0 (the contract's order) fed from
//                  shared memory (warps 1-7 stage 1024-row chunks of both columns, double
//                  buffered), the column updates by the whole block. One block of 256; scratch:
//                  rows r doubles (column-major, L2-resident). ~2 r^2 rows F; r (r + 1) rows
//                  chained fmas in all: latency-bound, ~1 ms at rows = 50k, r = 4.
//   expand         out[i, c] = alpha f32(sum_j p[i, j] q[c, j]) (+ beta out), sum in double, j in
//                  order. 4 B (8 with beta) per out element + p, q tiles; 2r F per element.
//                  Block of (32 columns x 8 rows), p and q tiles of 32 ranks in shared memory.
//
// Determinism: no floating-point atomics. The only atomics are the integer atomicMin on the
// backend's "bad index" slot (order-independent) and those inside the library's radix sort
// (cuda_sort.h: CUB, or rocPRIM under HIP), whose result (a stable sort) is unique.
#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)
#include "loom/backend/cuda/cuda_compress.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_launch.h"
#include "loom/backend/cuda/cuda_philox.h"
#include "loom/backend/cuda/cuda_sort.h"
#include "loom/core/error.h"

namespace loom::cuda {
namespace {

// ---------------------------------------------------------------- launch shapes
constexpr int kBlock = 256;           // threads per block
constexpr int kSeqChunk = 2048;       // seq_sum: elements per staged chunk
constexpr int kTile = 32;             // project / expand: tile edge

// (kWarp, grid_for, thread_index / thread_count, min64, mul_rn / fma_rn, ballot: cuda_device.h.
// mul_rn: a product rounded once, never contracted into a following add; fma_rn: one rounding.)

// core/philox.h's philox_uniform: in (0, 1), the top 24 bits.
__device__ __forceinline__ float philox_uniform(uint32_t bits) {
  return (static_cast<float>(bits >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

// ---------------------------------------------------------------- sequential sums
enum SeqMode : int {
  kSeqDgcClip = 0,  // s = sum x^2; norm = sqrt s; flag = norm > clip; scalar = f32(clip / norm)
  kSeqL1Mean = 1,   // s = sum |x|; scalar = n > 0 ? f32(s / n) : 0
  kSeqNorm = 2,     // s = sum x^2; scalar = f32(sqrt s)
};

// One block of kBlock threads. The sum runs in index order in one thread (the contract's order:
// bitwise equal to the CPU's loop); warps 1 .. 7 stage the next chunk while thread 0 adds.
template <int Mode>
__global__ void __launch_bounds__(kBlock) seq_sum_kernel(const float* x, int64_t n, double clip, float* scalar,
                                                         int* flag) {
  __shared__ __align__(16) float buf[2][kSeqChunk];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t chunks = (n + kSeqChunk - 1) / kSeqChunk;
  if (tid >= kWarp && chunks > 0) {
    const int len = static_cast<int>(min64(kSeqChunk, n));
    for (int e = tid - kWarp; e < len; e += kBlock - kWarp) buf[0][e] = x[e];
  }
  __syncthreads();
  double s = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    if (tid >= kWarp) {
      if (c + 1 < chunks) {
        const int64_t base = (c + 1) * kSeqChunk;
        const int len = static_cast<int>(min64(kSeqChunk, n - base));
        float* b = buf[(c + 1) & 1];
        for (int e = tid - kWarp; e < len; e += kBlock - kWarp) b[e] = x[base + e];
      }
    } else if (tid == 0) {
      const float* b = buf[c & 1];
      const int len = static_cast<int>(min64(kSeqChunk, n - c * kSeqChunk));
      int e = 0;
#pragma unroll 2
      for (; e + 4 <= len; e += 4) {
        const float4 v = *reinterpret_cast<const float4*>(b + e);
        if constexpr (Mode == kSeqL1Mean) {
          s = s + fabs(static_cast<double>(v.x));
          s = s + fabs(static_cast<double>(v.y));
          s = s + fabs(static_cast<double>(v.z));
          s = s + fabs(static_cast<double>(v.w));
        } else {  // x^2 is exact in double: fma(x, x, s) = s + x^2 rounded once, the CPU's
          s = fma_rn(static_cast<double>(v.x), static_cast<double>(v.x), s);
          s = fma_rn(static_cast<double>(v.y), static_cast<double>(v.y), s);
          s = fma_rn(static_cast<double>(v.z), static_cast<double>(v.z), s);
          s = fma_rn(static_cast<double>(v.w), static_cast<double>(v.w), s);
        }
      }
      for (; e < len; ++e) {
        const double v = static_cast<double>(b[e]);
        if constexpr (Mode == kSeqL1Mean) s = s + fabs(v);
        else s = fma_rn(v, v, s);
      }
    }
    __syncthreads();
  }
  if (tid != 0) return;
  if constexpr (Mode == kSeqDgcClip) {
    const double norm = sqrt(s);
    const bool clipped = norm > clip;
    flag[0] = clipped ? 1 : 0;
    scalar[0] = clipped ? static_cast<float>(clip / norm) : 0.0f;
  } else if constexpr (Mode == kSeqL1Mean) {
    scalar[0] = n > 0 ? static_cast<float>(s / static_cast<double>(n)) : 0.0f;
  } else {
    scalar[0] = static_cast<float>(sqrt(s));
  }
}

// ---------------------------------------------------------------- DGC
// One element: g scaled (and written back) when clipped; u = fma(m, u, g) (the CPU's contracted
// m u + g); v += u.
__device__ __forceinline__ void dgc_element(float& g, float& u, float& v, bool scaled, float factor, float momentum) {
  if (scaled) g = mul_rn(g, factor);
  u = fma_rn(momentum, u, g);
  v = v + u;
}

// Clip: seq_sum's flag says whether g is scaled. Vec (g, u, v 16-byte aligned): float4 groups,
// then the n % 4 tail.
template <bool Clip, bool Vec>
__global__ void dgc_update_kernel(float* g, float* u, float* v, int64_t n, float momentum, const float* scale,
                                  const int* flag) {
  bool scaled = false;
  float factor = 1.0f;
  if constexpr (Clip) {
    scaled = flag[0] != 0;
    factor = scale[0];
  }
  int64_t first = 0;
  if constexpr (Vec) {
    const int64_t groups = n / 4;
    for (int64_t q = thread_index(); q < groups; q += thread_count()) {
      float4 g4 = reinterpret_cast<const float4*>(g)[q];
      float4 u4 = reinterpret_cast<const float4*>(u)[q];
      float4 v4 = reinterpret_cast<const float4*>(v)[q];
      dgc_element(g4.x, u4.x, v4.x, scaled, factor, momentum);
      dgc_element(g4.y, u4.y, v4.y, scaled, factor, momentum);
      dgc_element(g4.z, u4.z, v4.z, scaled, factor, momentum);
      dgc_element(g4.w, u4.w, v4.w, scaled, factor, momentum);
      if (scaled) reinterpret_cast<float4*>(g)[q] = g4;
      reinterpret_cast<float4*>(u)[q] = u4;
      reinterpret_cast<float4*>(v)[q] = v4;
    }
    first = groups * 4;
  }
  for (int64_t i = first + thread_index(); i < n; i += thread_count()) {
    float gi = g[i], ui = u[i], vi = v[i];
    dgc_element(gi, ui, vi, scaled, factor, momentum);
    if (scaled) g[i] = gi;
    u[i] = ui;
    v[i] = vi;
  }
}

// ---------------------------------------------------------------- 1-bit
// Warp per word (grid-stride over words): the sign bits are the warp's ballot; lanes past n give 0.
__global__ void onebit_encode_kernel(float* e, int64_t n, int64_t words, uint32_t* out_words, const float* scale) {
  const float s = scale[0];
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t warp = thread_index() / kWarp, warps = thread_count() / kWarp;
  for (int64_t q = warp; q < words; q += warps) {  // warp-uniform bound: every lane reaches the ballot
    const int64_t i = q * kWarp + lane;
    const bool valid = i < n;
    const float x = valid ? e[i] : 0.0f;
    const bool negative = valid && x < 0.0f;
    const uint32_t bits = ballot(negative);
    if (lane == 0) out_words[q] = bits;
    if (valid) e[i] = x - (negative ? -s : s);
  }
}

// Thread per 4 elements (one nibble of a word; the word is a broadcast within 8 lanes). Vec (out
// 16-byte aligned): float4 loads and stores for full groups.
template <bool Vec>
__global__ void onebit_decode_add_kernel(const uint32_t* words, const float* scales, int64_t ranks, int64_t w,
                                         float* out, int64_t n) {
  const int64_t groups = (n + 3) / 4;
  for (int64_t q = thread_index(); q < groups; q += thread_count()) {
    const int64_t base = 4 * q;
    const int shift = static_cast<int>(base % kWarp);
    if (Vec && base + 4 <= n) {
      float4 o = reinterpret_cast<const float4*>(out)[q];
      for (int64_t r = 0; r < ranks; ++r) {
        const uint32_t bits = words[r * w + base / kWarp] >> shift;
        const float s = scales[r];
        o.x = o.x + (bits & 1u ? -s : s);
        o.y = o.y + (bits & 2u ? -s : s);
        o.z = o.z + (bits & 4u ? -s : s);
        o.w = o.w + (bits & 8u ? -s : s);
      }
      reinterpret_cast<float4*>(out)[q] = o;
    } else {
      const int count = static_cast<int>(min64(4, n - base));
      for (int j = 0; j < count; ++j) {
        float acc = out[base + j];
        for (int64_t r = 0; r < ranks; ++r) {
          const uint32_t bit = (words[r * w + base / kWarp] >> (shift + j)) & 1u;
          const float s = scales[r];
          acc = acc + (bit ? -s : s);
        }
        out[base + j] = acc;
      }
    }
  }
}

// ---------------------------------------------------------------- QSGD
// The code of one element: sign(g) (l + [u < x - l]), x = |g| / norm * s, l = floor(x).
__device__ __forceinline__ uint32_t qsgd_code(float gi, float nrm, double s, uint32_t bits) {
  const double x = mul_rn(fabs(static_cast<double>(gi)) / static_cast<double>(nrm), s);
  const double l = floor(x);
  const int level = static_cast<int>(l) + (static_cast<double>(philox_uniform(bits)) < x - l ? 1 : 0);
  return static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(gi < 0.0f ? -level : level)));
}

// Thread per 4-element word q: one Philox block per word, as the CPU draws it. Vec (g 16-byte
// aligned): one float4 load per full word.
template <bool Vec>
__global__ void qsgd_encode_kernel(const float* g, int64_t n, int64_t words, uint32_t* codes, const float* norm,
                                   int levels, uint32_t key0, uint32_t key1, uint32_t stream_id, uint32_t draw,
                                   int64_t offset) {
  const float nrm = norm[0];
  const double s = static_cast<double>(levels);
  for (int64_t q = thread_index(); q < words; q += thread_count()) {
    uint32_t word = 0;
    if (nrm > 0.0f) {
      const Philox4 r =
          philox4x32_10(static_cast<uint32_t>(offset + 4 * q), stream_id, draw, 0x9597u, key0, key1);
      if (Vec && 4 * q + 4 <= n) {
        const float4 g4 = reinterpret_cast<const float4*>(g)[q];
        word = qsgd_code(g4.x, nrm, s, r.v[0]) | qsgd_code(g4.y, nrm, s, r.v[1]) << 8 |
               qsgd_code(g4.z, nrm, s, r.v[2]) << 16 | qsgd_code(g4.w, nrm, s, r.v[3]) << 24;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (4 * q + j < n) word |= qsgd_code(g[4 * q + j], nrm, s, r.v[j]) << (8 * j);
        }
      }
    }
    codes[q] = word;
  }
}

__device__ __forceinline__ float qsgd_byte(uint32_t word, int j) {
  return static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(word >> (8 * j))));
}

// Thread per 4-element word; the fma rounds once (the CPU's std::fma). Vec (out 16-byte aligned):
// float4 loads and stores for full words.
template <bool Vec>
__global__ void qsgd_decode_add_kernel(const uint32_t* codes, const float* norms, int64_t ranks, int64_t w,
                                       int levels, float* out, int64_t n) {
  const float s = static_cast<float>(levels);
  const int64_t words = (n + 3) / 4;
  for (int64_t q = thread_index(); q < words; q += thread_count()) {
    if (Vec && 4 * q + 4 <= n) {
      float4 o = reinterpret_cast<const float4*>(out)[q];
      for (int64_t r = 0; r < ranks; ++r) {
        const uint32_t word = codes[r * w + q];
        const float unit = norms[r] / s;
        o.x = fma_rn(unit, qsgd_byte(word, 0), o.x);
        o.y = fma_rn(unit, qsgd_byte(word, 1), o.y);
        o.z = fma_rn(unit, qsgd_byte(word, 2), o.z);
        o.w = fma_rn(unit, qsgd_byte(word, 3), o.w);
      }
      reinterpret_cast<float4*>(out)[q] = o;
    } else {
      const int count = static_cast<int>(min64(4, n - 4 * q));
      for (int j = 0; j < count; ++j) {
        float acc = out[4 * q + j];
        for (int64_t r = 0; r < ranks; ++r) acc = fma_rn(norms[r] / s, qsgd_byte(codes[r * w + q], j), acc);
        out[4 * q + j] = acc;
      }
    }
  }
}

// ---------------------------------------------------------------- scatter
// The sort key of an index outside [0, n): above every valid one (i32 indices are < 2^31).
uint32_t bad_key(int64_t n) { return static_cast<uint32_t>(std::min<int64_t>(n, int64_t{1} << 31)); }
// Radix-sort bits for keys 0 .. max_key.
int key_bits(uint64_t max_key) {
  int bits = 1;
  while (bits < 32 && (uint64_t{1} << bits) <= max_key) ++bits;
  return bits;
}
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

__global__ void scatter_zero_kernel(const int32_t* idx, int64_t m, float* x, int64_t n,
                                    unsigned long long* bad_position) {
  for (int64_t j = thread_index(); j < m; j += thread_count()) {
    const int32_t id = idx[j];
    if (id < 0 || id >= n) atomicMin(bad_position, static_cast<unsigned long long>(j));
    else x[id] = 0.0f;
  }
}

__global__ void scatter_keys_kernel(const int32_t* idx, int64_t m, int64_t n, uint32_t bad, uint32_t* keys,
                                    uint32_t* positions, unsigned long long* bad_position) {
  for (int64_t j = thread_index(); j < m; j += thread_count()) {
    const int32_t id = idx[j];
    if (id < 0 || id >= n) {
      keys[j] = bad;
      atomicMin(bad_position, static_cast<unsigned long long>(j));
    } else {
      keys[j] = static_cast<uint32_t>(id);
    }
    positions[j] = static_cast<uint32_t>(j);
  }
}

// Sorted (index, j) pairs: the first thread of each run of one index adds the run's values in j
// order (the sort is stable), which is the CPU's order for that element.
__global__ void scatter_runs_kernel(const uint32_t* keys, const uint32_t* positions, const float* val, int64_t m,
                                    float* out, uint32_t bad) {
  for (int64_t t = thread_index(); t < m; t += thread_count()) {
    const uint32_t key = keys[t];
    if (key == bad || (t > 0 && keys[t - 1] == key)) continue;
    float acc = out[key];
    for (int64_t s = t; s < m && keys[s] == key; ++s) acc = acc + val[positions[s]];
    out[key] = acc;
  }
}

// ---------------------------------------------------------------- Top-K
__global__ void topk_keys_kernel(const float* acc, int64_t n, uint32_t* keys, uint32_t* iota) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    keys[i] = 0x7fffffffu - (__float_as_uint(acc[i]) & 0x7fffffffu);
    iota[i] = static_cast<uint32_t>(i);
  }
}

__global__ void topk_gather_kernel(const uint32_t* sorted, int64_t k, float* acc, int32_t* idx, float* val) {
  for (int64_t j = thread_index(); j < k; j += thread_count()) {
    const uint32_t i = sorted[j];
    idx[j] = static_cast<int32_t>(i);
    val[j] = acc[i];
    acc[i] = 0.0f;  // sent: the accumulator keeps the rest
  }
}

// ---------------------------------------------------------------- PowerSGD
// out[o, j] = sum_t A[o, t] B[t, j], A = m (rows, cols) or its transpose, B = q (inner, r).
// Block of 256: thread (x = tid % 32, y = tid / 32) owns o = o0 + x + 32 (y / JT), j = j0 + y % JT.
template <int JT, bool Transposed>
__global__ void __launch_bounds__(kBlock) lowrank_project_kernel(const float* m, const float* q, float* out,
                                                                 int64_t outer, int64_t inner, int64_t r,
                                                                 int64_t cols) {
  constexpr int kOuter = kTile * (8 / JT);
  __shared__ float a_s[kTile][kOuter + 1];  // [t][o], padded: conflict-free stores in both layouts
  __shared__ float b_s[kTile][JT];
  const int tid = static_cast<int>(threadIdx.x);
  const int o_l = tid % kTile + kTile * ((tid / kTile) / JT), j_l = (tid / kTile) % JT;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x) * kOuter, j0 = static_cast<int64_t>(blockIdx.y) * JT;
  double acc = 0.0;
  for (int64_t t0 = 0; t0 < inner; t0 += kTile) {
    for (int e = tid; e < kOuter * kTile; e += kBlock) {
      const int t_l = Transposed ? e / kOuter : e % kTile;  // coalesced along m's rows either way
      const int oo = Transposed ? e % kOuter : e / kTile;
      const int64_t o = o0 + oo, t = t0 + t_l;
      float v = 0.0f;
      if (o < outer && t < inner) v = Transposed ? m[t * cols + o] : m[o * cols + t];
      a_s[t_l][oo] = v;
    }
    for (int e = tid; e < kTile * JT; e += kBlock) {
      const int t_l = e / JT, jj = e % JT;
      const int64_t t = t0 + t_l, j = j0 + jj;
      b_s[t_l][jj] = t < inner && j < r ? q[t * r + j] : 0.0f;
    }
    __syncthreads();
    const int len = static_cast<int>(min64(kTile, inner - t0));
    for (int tt = 0; tt < len; ++tt) {  // the product of two floats is exact in double
      acc = fma_rn(static_cast<double>(a_s[tt][o_l]), static_cast<double>(b_s[tt][j_l]), acc);
    }
    __syncthreads();
  }
  const int64_t o = o0 + o_l, j = j0 + j_l;
  if (o < outer && j < r) out[o * r + j] = static_cast<float>(acc);
}

// One block: p (rows, r) -> d (column-major doubles) -> MGS twice -> p. Each dot and norm is a
// chain of fmas by thread 0 in row order (the CPU's contracted `dot += a * b`), fed from shared
// memory by warps 1 .. 7, which stage the next chunk of both columns meanwhile (double buffered);
// the updates d_j = fma(-dot, d_k, d_j) (the CPU's contracted `d_j -= dot * d_k`) and the scalings
// run on the whole block.
constexpr int kDotChunk = 1024;  // rows per staged chunk of each column

// Called by every thread of the block; thread 0 leaves sum_i a_i b_i (in order) in `result`,
// which the caller reads after a __syncthreads.
__device__ void block_dot(const double* a, const double* b, int64_t rows, double (&sa)[2][kDotChunk],
                          double (&sb)[2][kDotChunk], double& result) {
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t chunks = (rows + kDotChunk - 1) / kDotChunk;
  if (tid >= kWarp && chunks > 0) {
    const int len = static_cast<int>(min64(kDotChunk, rows));
    for (int e = tid - kWarp; e < len; e += kBlock - kWarp) sa[0][e] = a[e], sb[0][e] = b[e];
  }
  __syncthreads();
  double s = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    if (tid >= kWarp) {
      if (c + 1 < chunks) {
        const int64_t base = (c + 1) * kDotChunk;
        const int len = static_cast<int>(min64(kDotChunk, rows - base));
        const int buf = static_cast<int>((c + 1) & 1);
        for (int e = tid - kWarp; e < len; e += kBlock - kWarp) sa[buf][e] = a[base + e], sb[buf][e] = b[base + e];
      }
    } else if (tid == 0) {
      const int buf = static_cast<int>(c & 1);
      const int len = static_cast<int>(min64(kDotChunk, rows - c * kDotChunk));
      int e = 0;
#pragma unroll 4
      for (; e + 2 <= len; e += 2) {
        const double2 x = *reinterpret_cast<const double2*>(&sa[buf][e]);
        const double2 y = *reinterpret_cast<const double2*>(&sb[buf][e]);
        s = fma_rn(x.x, y.x, s);
        s = fma_rn(x.y, y.y, s);
      }
      if (e < len) s = fma_rn(sa[buf][e], sb[buf][e], s);
    }
    __syncthreads();
  }
  if (tid == 0) result = s;
}

__global__ void __launch_bounds__(kBlock) orthonormalize_kernel(float* p, double* d, int64_t rows, int64_t r) {
  __shared__ __align__(16) double sa[2][kDotChunk];
  __shared__ __align__(16) double sb[2][kDotChunk];
  __shared__ double shared_scalar;
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t n = rows * r;
  for (int64_t e = tid; e < n; e += kBlock) d[(e % r) * rows + e / r] = static_cast<double>(p[e]);
  __syncthreads();
  for (int pass = 0; pass < 2; ++pass) {  // "twice is enough"
    for (int64_t j = 0; j < r; ++j) {
      double* dj = d + j * rows;
      for (int64_t k = 0; k < j; ++k) {
        const double* dk = d + k * rows;
        block_dot(dj, dk, rows, sa, sb, shared_scalar);
        __syncthreads();
        const double dot = shared_scalar;
        for (int64_t i = tid; i < rows; i += kBlock) dj[i] = fma_rn(-dot, dk[i], dj[i]);
        __syncthreads();
      }
      block_dot(dj, dj, rows, sa, sb, shared_scalar);
      __syncthreads();
      const double norm = shared_scalar;
      const double inv = norm > 1e-30 ? 1.0 / sqrt(norm) : 0.0;
      for (int64_t i = tid; i < rows; i += kBlock) dj[i] = mul_rn(dj[i], inv);
      __syncthreads();
    }
  }
  for (int64_t e = tid; e < n; e += kBlock) p[e] = static_cast<float>(d[(e % r) * rows + e / r]);
}

// out[i, c] = alpha f32(sum_j p[i, j] q[c, j]) (+ beta out). Block (32 columns x 8 rows): thread
// (c = tid % 32, i = tid / 32); p and q tiles of up to 32 ranks in shared memory.
__global__ void __launch_bounds__(kBlock) lowrank_expand_kernel(const float* p, const float* q, float* out,
                                                                int64_t rows, int64_t cols, int64_t r, float alpha,
                                                                float beta) {
  constexpr int kRows = kBlock / kTile;
  __shared__ float p_s[kRows][kTile + 1];
  __shared__ float q_s[kTile][kTile + 1];
  const int tid = static_cast<int>(threadIdx.x);
  const int c_l = tid % kTile, i_l = tid / kTile;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kRows, c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  double acc = 0.0;
  for (int64_t j0 = 0; j0 < r; j0 += kTile) {
    const int jc = static_cast<int>(min64(kTile, r - j0));
    for (int e = tid; e < kRows * jc; e += kBlock) {  // contiguous in p when r <= 32
      const int il = e / jc, jj = e % jc;
      const int64_t i = i0 + il;
      p_s[il][jj] = i < rows ? p[i * r + j0 + jj] : 0.0f;
    }
    for (int e = tid; e < kTile * jc; e += kBlock) {
      const int cl = e / jc, jj = e % jc;
      const int64_t c = c0 + cl;
      q_s[cl][jj] = c < cols ? q[c * r + j0 + jj] : 0.0f;
    }
    __syncthreads();
    for (int jj = 0; jj < jc; ++jj) {
      acc = fma_rn(static_cast<double>(p_s[i_l][jj]), static_cast<double>(q_s[c_l][jj]), acc);
    }
    __syncthreads();
  }
  const int64_t i = i0 + i_l, c = c0 + c_l;
  if (i >= rows || c >= cols) return;
  float* o = out + i * cols + c;
  const float x = mul_rn(alpha, static_cast<float>(acc));
  *o = beta == 0.0f ? x : fma_rn(beta, *o, x);  // the CPU's contracted alpha x + beta o
}

template <int JT>
void launch_project(const float* m, const float* q, float* out, int64_t outer, int64_t inner, int64_t r,
                    int64_t cols, bool transpose, cudaStream_t stream) {
  constexpr int64_t kOuter = kTile * (8 / JT);
  const int64_t jt = (r + JT - 1) / JT;
  LOOM_CHECK(jt <= 65535, "lowrank_project: rank ", r, " is too large");
  const dim3 grid(static_cast<unsigned>((outer + kOuter - 1) / kOuter), static_cast<unsigned>(jt));
  if (transpose) launch<lowrank_project_kernel<JT, true>>(grid, kBlock, 0, stream, m, q, out, outer, inner, r, cols);
  else launch<lowrank_project_kernel<JT, false>>(grid, kBlock, 0, stream, m, q, out, outer, inner, r, cols);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <int Mode>
void launch_seq_sum(const float* x, int64_t n, double clip, float* scalar, int* flag, cudaStream_t stream) {
  launch<seq_sum_kernel<Mode>>(1, kBlock, 0, stream, x, n, clip, scalar, flag);
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace

// ---------------------------------------------------------------- launchers
// Top-K scratch: keys (n uint32), sorted keys (n), sorted indices (n), each 256-aligned, then
// the sort's temporary storage for the larger of the two sorts. The first sort's input indices are
// the op's own scratch operand (iota).
size_t topk_scratch_bytes(int64_t n, int64_t k) {
  const size_t sort_n = radix_sort_pairs_bytes(n, 31);
  const size_t sort_k = radix_sort_pairs_bytes(k, key_bits(static_cast<uint64_t>(n - 1)));
  return 3 * align256(static_cast<size_t>(n) * sizeof(uint32_t)) + std::max(sort_n, sort_k);
}

void topk_extract(float* acc, int64_t n, int32_t* idx, float* val, int64_t k, uint32_t* iota, void* scratch,
                  cudaStream_t stream) {
  if (n <= 0 || k <= 0) return;
  LOOM_CHECK(n <= INT32_MAX, "topk_extract: ", n, " elements, at most ", INT32_MAX, " supported");
  const size_t array = align256(static_cast<size_t>(n) * sizeof(uint32_t));
  char* base = static_cast<char*>(scratch);
  uint32_t* keys = reinterpret_cast<uint32_t*>(base);
  uint32_t* keys_sorted = reinterpret_cast<uint32_t*>(base + array);
  uint32_t* order = reinterpret_cast<uint32_t*>(base + 2 * array);
  void* cub_temp = base + 3 * array;
  const size_t cub_bytes = topk_scratch_bytes(n, k) - 3 * array;

  launch<topk_keys_kernel>(grid_for(n, kBlock), kBlock, 0, stream, acc, n, keys, iota);
  LOOM_CUDA_CHECK_LAUNCH();
  // Ascending keys = descending |acc|; stable, so equal magnitudes keep the lower index first.
  radix_sort_pairs(cub_temp, cub_bytes, keys, keys_sorted, iota, order, n, 31, stream);
  LOOM_CUDA_CHECK_LAUNCH();
  // The k selected indices in ascending order (keys and values both the indices; the outputs
  // reuse the first sort's key arrays).
  radix_sort_pairs(cub_temp, cub_bytes, order, keys, order, keys_sorted, k, key_bits(static_cast<uint64_t>(n - 1)),
                   stream);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<topk_gather_kernel>(grid_for(k, kBlock), kBlock, 0, stream, keys, k, acc, idx, val);
  LOOM_CUDA_CHECK_LAUNCH();
}

// Scatter-add scratch: keys and positions, in and out (m uint32 each, 256-aligned), then the sort's
// temporary storage for m pairs of key_bits(bad_key(n)) bits.
size_t scatter_add_scratch_bytes(int64_t m, int64_t n) {
  if (m <= 0) return 0;
  const size_t cub_bytes = radix_sort_pairs_bytes(m, key_bits(bad_key(n)));
  return 4 * align256(static_cast<size_t>(m) * sizeof(uint32_t)) + cub_bytes;
}

void scatter_add(const int32_t* idx, const float* val, int64_t m, float* out, int64_t n, void* scratch,
                 unsigned long long* bad_position, cudaStream_t stream) {
  if (m <= 0) return;
  LOOM_CHECK(m <= INT32_MAX, "scatter_add: ", m, " indices, at most ", INT32_MAX, " supported");
  const size_t array = align256(static_cast<size_t>(m) * sizeof(uint32_t));
  char* base = static_cast<char*>(scratch);
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(base);
  uint32_t* keys_out = reinterpret_cast<uint32_t*>(base + array);
  uint32_t* pos_in = reinterpret_cast<uint32_t*>(base + 2 * array);
  uint32_t* pos_out = reinterpret_cast<uint32_t*>(base + 3 * array);
  void* cub_temp = base + 4 * array;
  const size_t cub_bytes = scatter_add_scratch_bytes(m, n) - 4 * array;
  const uint32_t bad = bad_key(n);
  launch<scatter_keys_kernel>(grid_for(m, kBlock), kBlock, 0, stream, idx, m, n, bad, keys_in, pos_in, bad_position);
  LOOM_CUDA_CHECK_LAUNCH();
  radix_sort_pairs(cub_temp, cub_bytes, keys_in, keys_out, pos_in, pos_out, m, key_bits(bad), stream);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<scatter_runs_kernel>(grid_for(m, kBlock), kBlock, 0, stream, keys_out, pos_out, val, m, out, bad);
  LOOM_CUDA_CHECK_LAUNCH();
}

void scatter_zero(const int32_t* idx, int64_t m, float* x, int64_t n, unsigned long long* bad_position,
                  cudaStream_t stream) {
  if (m <= 0) return;
  launch<scatter_zero_kernel>(grid_for(m, kBlock), kBlock, 0, stream, idx, m, x, n, bad_position);
  LOOM_CUDA_CHECK_LAUNCH();
}

// DGC scratch: the clip factor (f32) and whether it applies (i32).
size_t dgc_scratch_bytes() { return 2 * sizeof(int32_t); }

void dgc_accumulate(float* g, float* u, float* v, int64_t n, float momentum, double clip, void* scratch,
                    cudaStream_t stream) {
  if (n <= 0) return;
  const bool vec = aligned16(g) && aligned16(u) && aligned16(v);
  const unsigned grid = grid_for(vec ? (n + 3) / 4 : n, kBlock);
  if (clip > 0.0) {
    float* factor = static_cast<float*>(scratch);
    const int* flag = reinterpret_cast<const int*>(factor + 1);
    launch_seq_sum<kSeqDgcClip>(g, n, clip, factor, reinterpret_cast<int*>(factor + 1), stream);
    if (vec) launch<dgc_update_kernel<true, true>>(grid, kBlock, 0, stream, g, u, v, n, momentum, static_cast<const float*>(factor), flag);
    else launch<dgc_update_kernel<true, false>>(grid, kBlock, 0, stream, g, u, v, n, momentum, static_cast<const float*>(factor), flag);
  } else {
    const float* none = nullptr;
    const int* no_flag = nullptr;
    if (vec) launch<dgc_update_kernel<false, true>>(grid, kBlock, 0, stream, g, u, v, n, momentum, none, no_flag);
    else launch<dgc_update_kernel<false, false>>(grid, kBlock, 0, stream, g, u, v, n, momentum, none, no_flag);
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

void onebit_encode(float* acc, int64_t n, uint32_t* words, float* scale, cudaStream_t stream) {
  launch_seq_sum<kSeqL1Mean>(acc, n, 0.0, scale, nullptr, stream);
  const int64_t w = (n + kWarp - 1) / kWarp;
  if (w <= 0) return;
  launch<onebit_encode_kernel>(grid_for(w * kWarp, kBlock), kBlock, 0, stream, acc, n, w, words,
                               static_cast<const float*>(scale));
  LOOM_CUDA_CHECK_LAUNCH();
}

void onebit_decode_add(const uint32_t* words, const float* scales, int64_t ranks, int64_t w, float* out, int64_t n,
                       cudaStream_t stream) {
  if (n <= 0) return;
  const unsigned grid = grid_for((n + 3) / 4, kBlock);
  if (aligned16(out)) launch<onebit_decode_add_kernel<true>>(grid, kBlock, 0, stream, words, scales, ranks, w, out, n);
  else launch<onebit_decode_add_kernel<false>>(grid, kBlock, 0, stream, words, scales, ranks, w, out, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

void qsgd_encode(const float* g, int64_t n, uint32_t* codes, float* norm, int levels, uint64_t seed,
                 uint32_t stream_id, uint32_t draw, int64_t offset, cudaStream_t stream) {
  launch_seq_sum<kSeqNorm>(g, n, 0.0, norm, nullptr, stream);
  const int64_t w = (n + 3) / 4;
  if (w <= 0) return;
  const float* nrm = norm;
  const uint32_t key0 = static_cast<uint32_t>(seed), key1 = static_cast<uint32_t>(seed >> 32);
  if (aligned16(g)) {
    launch<qsgd_encode_kernel<true>>(grid_for(w, kBlock), kBlock, 0, stream, g, n, w, codes, nrm, levels, key0, key1,
                                     stream_id, draw, offset);
  } else {
    launch<qsgd_encode_kernel<false>>(grid_for(w, kBlock), kBlock, 0, stream, g, n, w, codes, nrm, levels, key0, key1,
                                      stream_id, draw, offset);
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

void qsgd_decode_add(const uint32_t* codes, const float* norms, int64_t ranks, int64_t w, int levels, float* out,
                     int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const unsigned grid = grid_for((n + 3) / 4, kBlock);
  if (aligned16(out)) launch<qsgd_decode_add_kernel<true>>(grid, kBlock, 0, stream, codes, norms, ranks, w, levels, out, n);
  else launch<qsgd_decode_add_kernel<false>>(grid, kBlock, 0, stream, codes, norms, ranks, w, levels, out, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

void lowrank_project(const float* m, const float* q, float* out, int64_t rows, int64_t cols, int64_t r,
                     bool transpose, cudaStream_t stream) {
  const int64_t outer = transpose ? cols : rows, inner = transpose ? rows : cols;
  if (outer <= 0 || r <= 0) return;
  if (r == 1) launch_project<1>(m, q, out, outer, inner, r, cols, transpose, stream);
  else if (r == 2) launch_project<2>(m, q, out, outer, inner, r, cols, transpose, stream);
  else if (r <= 4) launch_project<4>(m, q, out, outer, inner, r, cols, transpose, stream);
  else launch_project<8>(m, q, out, outer, inner, r, cols, transpose, stream);
}

size_t orthonormalize_scratch_bytes(int64_t rows, int64_t r) { return static_cast<size_t>(rows * r) * sizeof(double); }

void orthonormalize_columns(float* p, int64_t rows, int64_t r, void* scratch, cudaStream_t stream) {
  if (rows <= 0 || r <= 0) return;
  launch<orthonormalize_kernel>(1, kBlock, 0, stream, p, static_cast<double*>(scratch), rows, r);
  LOOM_CUDA_CHECK_LAUNCH();
}

void lowrank_expand(const float* p, const float* q, float* out, int64_t rows, int64_t cols, int64_t r, float alpha,
                    float beta, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  constexpr int64_t kRows = kBlock / kTile;
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  LOOM_CHECK(col_tiles <= 65535, "lowrank_expand: ", cols, " columns, at most ", 65535 * kTile, " supported");
  const dim3 grid(static_cast<unsigned>((rows + kRows - 1) / kRows), static_cast<unsigned>(col_tiles));
  launch<lowrank_expand_kernel>(grid, kBlock, 0, stream, p, q, out, rows, cols, r, alpha, beta);
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace loom::cuda
