// Decode attention over a paged, quantized KV cache (cuda_decode.h; Backend::kv_attention, the
// plan and formula of backend/kv_attention.h, the formats of backend/kv_format.h): split-KV "flash
// decoding" (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"; the
// online softmax of Milakov & Gimelshein 2018 and FlashAttention, Dao et al. 2022), the shape of
// FlashInfer's decode kernels (Ye et al. 2025) with the cache's tiles dequantized on the fly.
//
// For query row r, query head h (kv head g = h / P, P = n_head / n_kv_head) over the row's visible
// positions [first, n):
//     s_t = (q_h . k_t[g]) / sqrt(hd),   out_h = sum_t exp(s_t - max s) v_t[g] / sum_t exp(s_t - max s).
// k_t / v_t come from the pool's tiles (positions < stored[K|V]) or the stream's fp32 ring. A
// stored element decodes as kv_dequantize_tile does, element for element: fp32 as is, bf16 by a
// shift, integer codes as q * scale + min in f32 with the (scale, min) fp16 pair decoded exactly.
// q * scale is exact in f32 (a code of at most 8 bits times an 11-bit fp16 significand), so the
// one rounding of the add is the result whether or not a compiler fuses the pair (GCC does in the
// CPU's vectorized loops); the product is cuda_device.h's mul_rn (__fmul_rn on nvcc) all the same.
//
// Kernel (launch shape)                      what it does; bytes and FLOPs
//   kv_split_kernel<kMaxHd, kHeads>          Block (128 threads = 4 warps) per (item, kv head g,
//     grid (items, n_kv_head x chunks),      chunk of <= kHeads query heads of g); an item is one
//     128 threads; kMaxHd = 64 / 128 / 256,  split of S positions of one row (S = 64, 128 or 256
//     kHeads = 4 or 8 (4 when hd > 128)      chosen per call so that the grid has ~2 blocks per
//                                            SM; a row of <= S positions is one item). A warp per
//                                            position: the warps take 4 (2 for hd > 128) positions
//                                            at a time in turn; lane i holds channels [i c, (i+1) c)
//                                            of the head (c = kMaxHd / 32 <= 8; those below hd), its
//                                            q slices of the chunk's heads and their accumulators in
//                                            registers.
//                                            Per position: dequantize the lane's K and V channels
//                                            once for all the group's heads (GQA: K/V read once
//                                            per group when P <= kHeads), per head a partial dot,
//                                            an xor butterfly (5 shuffles; every lane gets the same
//                                            bits), online softmax in f32 (m, l rescaled when the
//                                            max grows), acc += p v. The 4 warps' (m, l, acc) are
//                                            merged through shared memory in warp order; a row of
//                                            one item writes out = acc / l (with_sink first when
//                                            the plan has sinks), else (m, l, acc) go to the
//                                            workspace per (item, head).
//                                            Device bytes per position and kv head: the K and V
//                                            slices once (hd x 4 / 2 / bits/8, + 4 B per (scale,
//                                            min) pair of the slice, per-channel pairs once per
//                                            tile from L1/L2), one tile offset (8 B).
//                                            FLOPs per position and query head: 4 hd (dot, p v)
//                                            + ~6 (softmax), + 2 per dequantized element.
//   kv_merge_kernel                          Block per (row of several items, query head), a thread
//     grid (merge rows, n_head),             per channel: M = max_i m_i, out = sum_i acc_i
//     32..256 threads                        exp(m_i - M) / sum_i l_i exp(m_i - M), i = 0, 1, ...
//                                            in order, the head's sink (if any) taken in last as a
//                                            position of zero value (with_sink). Reads splits x
//                                            (hd + 2) x 4 B, writes hd x 4 B.
//
// Determinism: no atomics; every sum has a fixed order (the lane's channels, the butterfly, the
// positions in each warp's turn, the warps 0..3, the splits in order), and the split size depends
// only on the plan, so two runs give the same bytes. The order differs from the CPU's (attend_rows:
// one pass over all positions): the op tests allow 1e-5 of the largest output.
//
// Expected time (a roofline: bytes / 3.35 TB/s, H100 SXM; nothing measured yet). Llama-3-8B's
// layer (32 query heads, 8 kv heads, hd 128, rows of 1024 channels), 4096 positions per sequence.
// K + V bytes per position: fp32 8192, bf16 4096, int8 per token (group 0) 2056, int4 per token
// group 32 (or KIVI-4: keys per channel over 16-row tiles) ~1280, int2 group 32 768. Total and time:
//                      batch 1 (S = 64: 512 blocks)     batch 16 (S = 256: 2048 blocks)
//   fp32               33.6 MB   10.0 us                537 MB   160 us
//   bf16               16.8 MB    5.0 us                268 MB    80 us
//   int8 per token      8.4 MB    2.5 us                135 MB    40 us
//   int4 (g32 / KIVI)   5.2 MB    1.6 us                 84 MB    25 us
//   int2 g32            3.1 MB    0.9 us                 50 MB    15 us
// q and out add 32 KB per row; the partials (m, l, acc per item and head: 64 x 32 x 520 B = 1.1 MB
// at batch 1, 4.3 MB at batch 16) are written and read once, mostly in L2. FLOPs: ~20 kFLOP per
// position (16 k for the dots and p v, 4 k dequantizing), 84 MFLOP at batch 1: 1.3 us at the fp32
// peak (66.9 TFLOP/s). Instructions, not bytes, bound the 4- and 2-bit formats: per (position, kv
// head) 20 shuffles (5 per head), 4-8 exps per lane and ~6 integer ops per dequantized element,
// about 2.5-3 us at batch 1 before any latency; the fp32 and bf16 caches should be near their
// bandwidth bound. Not yet done: 16-byte loads of K/V rows (each lane loads its channels one by
// one, coalesced across the warp), a multi-row butterfly that shares shuffles between heads.
#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)
#include "loom/backend/cuda/cuda_decode.h"

#include <algorithm>
#include <cstdint>

#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_launch.h"
#include "loom/core/error.h"

namespace loom::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarp;
constexpr int64_t kSplitSizes[] = {256, 128, 64};  // positions per split, largest first
constexpr int64_t kTargetBlocks = 2 * 132;          // two blocks per SM of an H100 SXM

size_t align_up(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }

// The kernels' template arguments for a head size and group.
int max_hd_of(int64_t head_dim) { return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256; }
int heads_of(int64_t per_group, int max_hd) { return max_hd > 128 || per_group <= 4 ? 4 : 8; }

// ---------------------------------------------------------------------------- element reads
__device__ __forceinline__ uint32_t load_u16(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8;
}
__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) { return load_u16(p) | load_u16(p + 2) << 16; }

// fp16 bits -> f32, exactly (every half is a float).
__device__ __forceinline__ float half_value(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m 2^-24 (both factors exact, so is the product)
    return __uint_as_float(__float_as_uint(static_cast<float>(m) * 5.9604644775390625e-8f) | sign);
  }
  if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | m << 13);  // inf / NaN
  return __uint_as_float(sign | (e + 112u) << 23 | m << 13);
}

// q * scale + min as kv_dequantize_tile computes it: q as f32 (2^23 + q - 2^23, exact), one
// rounded product (mul_rn: never contracted into the add; exact here anyway, see the file
// comment) and one rounded add.
__device__ __forceinline__ float dequant(uint32_t code, float scale, float lowest) {
  const float q = __uint_as_float(0x4b000000u | code) - 8388608.0f;
  return mul_rn(q, scale) + lowest;
}

// Where a position's row of one stream lives: row `row` of the tile at `tile`, or the ring's f32
// row at `ring`.
struct Source {
  const uint8_t* tile;
  int64_t row;
  const float* ring;
};

// Position t, in tile k at row j (t = k block + j), of stream `stream`. Positions, blocks and
// windows are below 2^31 (the op file checks), so the one division here is 32-bit.
__device__ __forceinline__ Source source_of(const KvDecodeShape& s, const KvDecodeRow& r,
                                            const int64_t* __restrict__ offsets, const uint8_t* pool,
                                            const float* rings, int stream, int64_t t, int64_t k, int64_t j) {
  if (t < r.stored[stream]) return {pool + offsets[r.tiles + 2 * k + stream], j, nullptr};
  const uint32_t ring_row = static_cast<uint32_t>(t) % static_cast<uint32_t>(s.stream[stream].window);
  return {nullptr, 0, rings + r.ring[stream] + static_cast<int64_t>(ring_row) * s.width};
}

// The lane's kPer channels [c0, c0 + kPer) of a position's row (the first `valid` of them; 0 for
// the others). pofs: each channel's (scale, min) byte offset (from the row for per-token tiles,
// from the tile for per-channel ones).
template <int kPer>
__device__ __forceinline__ void load_channels(const KvStreamLayout& f, const Source& src, int64_t width, int64_t c0,
                                              int valid, const int (&pofs)[kPer], float (&x)[kPer]) {
  if (src.ring != nullptr) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) x[j] = j < valid ? src.ring[c0 + j] : 0.0f;
    return;
  }
  if (f.kind == KV_KIND_F32) {
    const uint8_t* p = src.tile + (src.row * width + c0) * 4;
    const bool aligned = (reinterpret_cast<uintptr_t>(src.tile) & 3u) == 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      x[j] = j >= valid ? 0.0f
             : aligned  ? reinterpret_cast<const float*>(p)[j]
                        : __uint_as_float(load_u32(p + 4 * j));
    }
    return;
  }
  if (f.kind == KV_KIND_BF16) {
    const uint8_t* p = src.tile + (src.row * width + c0) * 2;
    const bool aligned = (reinterpret_cast<uintptr_t>(src.tile) & 1u) == 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const uint32_t bits = j >= valid ? 0u : aligned ? reinterpret_cast<const uint16_t*>(p)[j] : load_u16(p + 2 * j);
      x[j] = __uint_as_float(bits << 16);
    }
    return;
  }
  const uint8_t* params;
  const uint8_t* codes;
  if (f.per_channel) {
    params = src.tile;
    codes = src.tile + f.param_bytes + src.row * f.row_bytes;
  } else {
    params = src.tile + src.row * f.row_bytes;
    codes = params + 4 * f.groups;
  }
  const uint32_t mask = (1u << f.bits) - 1u;
  int last = -1;
  float scale = 0.0f, lowest = 0.0f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    x[j] = 0.0f;
    if (j < valid) {
      if (pofs[j] != last) {  // a new (scale, min) pair (per token: once per group)
        last = pofs[j];
        scale = half_value(load_u16(params + last));
        lowest = half_value(load_u16(params + last + 2));
      }
      const int64_t bit = (c0 + j) * f.bits;
      const uint32_t code = (static_cast<uint32_t>(codes[bit >> 3]) >> (bit & 7)) & mask;
      x[j] = dequant(code, scale, lowest);
    }
  }
}

// An attention sink s (GPT-OSS: a logit of zero value) into a head's merged (M, L): M' = max(M, s),
// L' = L e^(M - M') + e^(s - M'); returns e^(M - M'), the factor on the head's accumulator.
__device__ __forceinline__ float with_sink(float s, float& M, float& L) {
  const float top = s > M ? s : M, a = exp_of(M - top);
  L = L * a + exp_of(s - top);
  M = top;
  return a;
}

// ---------------------------------------------------------------------------- the split kernel
template <int kMaxHd, int kHeads>
__global__ void __launch_bounds__(kThreads)
    kv_split_kernel(const KvDecodeShape s, const KvDecodeRow* __restrict__ rows, const int64_t* __restrict__ offsets,
                    const int32_t* __restrict__ item_row, const float* __restrict__ q, const uint8_t* __restrict__ pool,
                    const float* __restrict__ rings, const float* __restrict__ sinks, float* __restrict__ out,
                    float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc) {
  constexpr int kPer = kMaxHd / kWarp;             // channels per lane
  constexpr int kUnroll = kPer >= 8 ? 2 : 4;       // positions a warp loads before it computes
  __shared__ float w_acc[kWarps][kHeads][kMaxHd];  // the warps' states, merged at the end
  __shared__ float w_m[kWarps][kHeads];
  __shared__ float w_l[kWarps][kHeads];

  const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t item = blockIdx.x;
  const int64_t row_index = item_row[item];
  const KvDecodeRow r = rows[row_index];
  const int64_t H = s.n_head, per_group = s.n_head / s.n_kv_head, chunks = (per_group + kHeads - 1) / kHeads;
  const int64_t g = blockIdx.y / chunks, p0 = blockIdx.y % chunks * kHeads;
  const int np = static_cast<int>(per_group - p0 < kHeads ? per_group - p0 : kHeads);  // heads of this block
  const int hd = static_cast<int>(s.head_dim);
  const int64_t h0 = g * per_group + p0;  // the block's first query head
  const int64_t begin = r.first + (item - r.item0) * s.split;
  const int64_t end = r.n < begin + s.split ? r.n : begin + s.split;
  const int d0 = lane * kPer;                                   // the lane's first channel of the head
  const int valid = hd - d0 < 0 ? 0 : hd - d0 < kPer ? hd - d0 : kPer;  // of its kPer channels
  const int64_t c0 = g * hd + d0;                               // ... in a row of width channels

  float qr[kHeads][kPer];
#pragma unroll
  for (int p = 0; p < kHeads; ++p) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      qr[p][j] = p < np && j < valid ? q[(row_index * H + h0 + p) * hd + d0 + j] : 0.0f;
    }
  }
  int pofs[2][kPer];  // per stream and channel: the byte offset of its (scale, min) pair
#pragma unroll
  for (int st = 0; st < 2; ++st) {
    const KvStreamLayout& f = s.stream[st];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int64_t c = c0 + j;
      pofs[st][j] = f.kind != KV_KIND_INT ? 0 : static_cast<int>(f.per_channel ? 4 * c : 4 * (c / f.group));
    }
  }
  float m[kHeads], l[kHeads], acc[kHeads][kPer];
#pragma unroll
  for (int p = 0; p < kHeads; ++p) {
    m[p] = -CUDART_INF_F;
    l[p] = 0.0f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) acc[p][j] = 0.0f;
  }

  // Each warp: kUnroll consecutive positions per turn, the warps' turns interleaved (warp-uniform).
  const uint32_t block = static_cast<uint32_t>(s.block);
  for (int64_t t0 = begin + warp * kUnroll; t0 < end; t0 += kWarps * kUnroll) {
    float kx[kUnroll][kPer], vx[kUnroll][kPer];
    const uint32_t k0 = static_cast<uint32_t>(t0) / block, j0 = static_cast<uint32_t>(t0) - k0 * block;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t t = t0 + u;
      if (t < end) {
        uint32_t k = k0, j = j0 + u;  // t's tile and row: past a tile edge at most kUnroll / block times
        while (j >= block) {
          j -= block;
          ++k;
        }
        load_channels<kPer>(s.stream[0], source_of(s, r, offsets, pool, rings, 0, t, k, j), s.width, c0, valid, pofs[0],
                            kx[u]);
        load_channels<kPer>(s.stream[1], source_of(s, r, offsets, pool, rings, 1, t, k, j), s.width, c0, valid, pofs[1],
                            vx[u]);
      } else {
#pragma unroll
        for (int j = 0; j < kPer; ++j) kx[u][j] = vx[u][j] = 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (t0 + u < end) {
#pragma unroll
        for (int p = 0; p < kHeads; ++p) {
          if (p < np) {
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < kPer; ++j) dot += qr[p][j] * kx[u][j];
            const float score = warp_sum(dot) * s.scale;  // cuda_device.h's butterfly: the same bits in every lane
            if (score > m[p]) {  // a new max: rescale what the warp has summed so far
              const float a = exp_of(m[p] - score);
              l[p] *= a;
#pragma unroll
              for (int j = 0; j < kPer; ++j) acc[p][j] *= a;
              m[p] = score;
            }
            const float e = exp_of(score - m[p]);
            l[p] += e;
#pragma unroll
            for (int j = 0; j < kPer; ++j) acc[p][j] += e * vx[u][j];
          }
        }
      }
    }
  }

  // The warps' states, merged in warp order. A warp that saw no position has m = -inf, l = 0,
  // acc = 0 and weight 0; warp 0 always sees one (a split is never empty), so M is finite.
#pragma unroll
  for (int p = 0; p < kHeads; ++p) {
    if (p < np) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (j < valid) w_acc[warp][p][d0 + j] = acc[p][j];
      }
      if (lane == 0) {
        w_m[warp][p] = m[p];
        w_l[warp][p] = l[p];
      }
    }
  }
  __syncthreads();
  for (int e = static_cast<int>(threadIdx.x); e < np * hd; e += kThreads) {
    const int p = e / hd, d = e % hd;
    float M = w_m[0][p];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) M = w_m[w][p] > M ? w_m[w][p] : M;
    float L = 0.0f, A = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = exp_of(w_m[w][p] - M);
      L += w_l[w][p] * weight;
      A += w_acc[w][p][d] * weight;
    }
    const int64_t h = h0 + p;
    if (r.splits == 1) {
      if (sinks != nullptr) A *= with_sink(sinks[h], M, L);
      out[(row_index * H + h) * hd + d] = A / L;
    } else {
      const int64_t slot = item * H + h;
      part_acc[slot * hd + d] = A;
      if (d == 0) {
        part_m[slot] = M;
        part_l[slot] = L;
      }
    }
  }
}

// ---------------------------------------------------------------------------- the merge kernel
__global__ void kv_merge_kernel(const KvDecodeShape s, const KvDecodeRow* __restrict__ rows,
                                const int32_t* __restrict__ merge_row, const float* __restrict__ part_m,
                                const float* __restrict__ part_l, const float* __restrict__ part_acc,
                                const float* __restrict__ sinks, float* __restrict__ out) {
  const int64_t row_index = merge_row[blockIdx.x];
  const KvDecodeRow r = rows[row_index];
  const int64_t H = s.n_head, hd = s.head_dim, h = blockIdx.y;
  float M = -CUDART_INF_F;
  for (int64_t i = 0; i < r.splits; ++i) {
    const float mi = part_m[(r.item0 + i) * H + h];
    M = mi > M ? mi : M;
  }
  float L = 0.0f;
  for (int64_t i = 0; i < r.splits; ++i) {
    const int64_t slot = (r.item0 + i) * H + h;
    L += part_l[slot] * exp_of(part_m[slot] - M);
  }
  float sink_factor = 1.0f;  // the accumulators below stay relative to M: the sink moves only L
  if (sinks != nullptr) {
    float top = M;
    sink_factor = with_sink(sinks[h], top, L);
  }
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float o = 0.0f;
    for (int64_t i = 0; i < r.splits; ++i) {
      const int64_t slot = (r.item0 + i) * H + h;
      o += part_acc[slot * hd + d] * exp_of(part_m[slot] - M);
    }
    out[(row_index * H + h) * hd + d] = o * sink_factor / L;
  }
}

// The table's sink logits, or null when the plan has none.
const float* sinks_of(const KvDecodeShape& s, const KvDecodeLayout& at, const char* ws) {
  return s.sinks ? reinterpret_cast<const float*>(ws + at.sinks_at) : nullptr;
}

template <int kMaxHd, int kHeads>
void launch_split(const KvDecodeShape& s, const KvDecodeLayout& at, char* ws, const float* q, const uint8_t* pool,
                  const float* rings, float* out, cudaStream_t stream) {
  const int64_t chunks = (s.n_head / s.n_kv_head + kHeads - 1) / kHeads;
  const dim3 grid(static_cast<unsigned>(s.items), static_cast<unsigned>(s.n_kv_head * chunks));
  launch<kv_split_kernel<kMaxHd, kHeads>>(
      grid, kThreads, 0, stream, s, reinterpret_cast<const KvDecodeRow*>(ws + at.rows_at),
      reinterpret_cast<const int64_t*>(ws + at.offsets_at), reinterpret_cast<const int32_t*>(ws + at.items_at), q,
      pool, rings, sinks_of(s, at, ws), out, reinterpret_cast<float*>(ws + at.m_at), reinterpret_cast<float*>(ws + at.l_at),
      reinterpret_cast<float*>(ws + at.acc_at));
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace

KvDecodeLayout kv_decode_layout(const KvDecodeShape& s) {
  KvDecodeLayout at;
  const size_t slots = static_cast<size_t>(s.items * s.n_head);
  at.rows_at = 0;
  at.offsets_at = align_up(at.rows_at + static_cast<size_t>(s.rows) * sizeof(KvDecodeRow), 8);
  at.items_at = align_up(at.offsets_at + static_cast<size_t>(s.entries) * sizeof(int64_t), 8);
  at.merges_at = align_up(at.items_at + static_cast<size_t>(s.items) * sizeof(int32_t), 4);
  at.sinks_at = align_up(at.merges_at + static_cast<size_t>(s.merge_rows) * sizeof(int32_t), 4);
  at.table_bytes = at.sinks_at + static_cast<size_t>(s.sinks ? s.n_head : 0) * sizeof(float);
  at.m_at = align_up(at.table_bytes, 256);
  at.l_at = align_up(at.m_at + slots * sizeof(float), 16);
  at.acc_at = align_up(at.l_at + slots * sizeof(float), 16);
  at.bytes = at.acc_at + slots * static_cast<size_t>(s.head_dim) * sizeof(float);
  return at;
}

int64_t kv_decode_blocks_per_split(int64_t n_head, int64_t n_kv_head, int64_t head_dim) {
  const int64_t per_group = n_head / n_kv_head, heads = heads_of(per_group, max_hd_of(head_dim));
  return n_kv_head * ((per_group + heads - 1) / heads);
}

int64_t kv_decode_split(const int64_t* lengths, int64_t rows, int64_t blocks_per_split) {
  for (const int64_t split : kSplitSizes) {
    int64_t blocks = 0;
    for (int64_t i = 0; i < rows; ++i) blocks += (lengths[i] + split - 1) / split * blocks_per_split;
    if (blocks >= kTargetBlocks) return split;
  }
  return kSplitSizes[sizeof(kSplitSizes) / sizeof(kSplitSizes[0]) - 1];
}

void kv_attention_decode(const KvDecodeShape& s, void* workspace, const float* q, const uint8_t* pool,
                         const float* rings, float* out, cudaStream_t stream) {
  LOOM_CHECK(s.head_dim > 0 && s.head_dim <= kKvMaxHeadDim, "kv_attention: head_dim ", s.head_dim,
             " exceeds the CUDA kernel's ", kKvMaxHeadDim);
  if (s.items == 0) return;
  const KvDecodeLayout at = kv_decode_layout(s);
  char* ws = static_cast<char*>(workspace);
  const int max_hd = max_hd_of(s.head_dim), heads = heads_of(s.n_head / s.n_kv_head, max_hd);
  if (max_hd == 64) {
    if (heads == 4) launch_split<64, 4>(s, at, ws, q, pool, rings, out, stream);
    else launch_split<64, 8>(s, at, ws, q, pool, rings, out, stream);
  } else if (max_hd == 128) {
    if (heads == 4) launch_split<128, 4>(s, at, ws, q, pool, rings, out, stream);
    else launch_split<128, 8>(s, at, ws, q, pool, rings, out, stream);
  } else {
    launch_split<256, 4>(s, at, ws, q, pool, rings, out, stream);
  }
  if (s.merge_rows == 0) return;
  const int64_t threads = std::min<int64_t>(256, (s.head_dim + kWarp - 1) / kWarp * kWarp);
  launch<kv_merge_kernel>(dim3(static_cast<unsigned>(s.merge_rows), static_cast<unsigned>(s.n_head)),
                          static_cast<unsigned>(threads), 0, stream, s,
                          reinterpret_cast<const KvDecodeRow*>(ws + at.rows_at),
                          reinterpret_cast<const int32_t*>(ws + at.merges_at),
                          reinterpret_cast<const float*>(ws + at.m_at), reinterpret_cast<const float*>(ws + at.l_at),
                          reinterpret_cast<const float*>(ws + at.acc_at), sinks_of(s, at, ws), out);
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace loom::cuda

// ---------------------------------------------------------------------------- kv_store
// Backend::kv_store (backend/kv_store.h): the tile kernel, a block per tile job, then the ring
// kernel, a block per ring job. A tile job's threads own disjoint bytes: elements (fp32, bf16),
// rows (per-token integer: a row's groups and codes, serially) or code bytes (per-channel: the
// byte's channels' (scale, min) pairs and that byte of each row), so no byte has two writers.
// Bytes: each job reads its rows once (rows x width x 4) and writes its slots; one pass.
namespace loom::cuda {
namespace {

constexpr int kStoreThreads = 128;

__device__ __forceinline__ const float* store_row(const KvStoreSource& r, const float* const* sources,
                                                  const float* rings) {
  return (r.source < 0 ? rings : sources[r.source]) + r.offset;
}

__global__ void kv_store_tile_kernel(const KvStoreShape s, const KvStoreTile* __restrict__ tiles,
                                     const KvStoreSource* __restrict__ rows, const float* const* sources,
                                     const float* rings, uint8_t* __restrict__ pool, int32_t* status) {
  const KvStoreTile job = tiles[blockIdx.x];
  const kvq::KvStoreFormat f = s.format[job.stream];
  const KvStoreSource* own = rows + job.first;
  const auto row = [&](int64_t t) { return store_row(own[t], sources, rings); };
  const int32_t failed = kvq::store_rows(f, row, job.rows, pool + job.dst, threadIdx.x, blockDim.x);
  if (failed != kvq::KV_FIT_OK) *status = failed;
}

__global__ void kv_store_ring_kernel(const KvStoreRing* __restrict__ jobs, const float* const* sources,
                                     float* __restrict__ rings) {
  const KvStoreRing job = jobs[blockIdx.x];
  const float* from = store_row(job.row, sources, rings);
  for (int64_t c = threadIdx.x; c < job.width; c += blockDim.x) rings[job.dst + c] = from[c];
}

size_t store_align(size_t bytes) { return (bytes + 15) / 16 * 16; }

}  // namespace

KvStoreLayout kv_store_layout(const KvStoreShape& s) {
  KvStoreLayout at;
  at.tiles_at = 0;
  at.rows_at = store_align(at.tiles_at + static_cast<size_t>(s.tiles) * sizeof(KvStoreTile));
  at.rings_at = store_align(at.rows_at + static_cast<size_t>(s.rows) * sizeof(KvStoreSource));
  at.sources_at = store_align(at.rings_at + static_cast<size_t>(s.rings) * sizeof(KvStoreRing));
  at.bytes = at.sources_at + static_cast<size_t>(s.sources) * sizeof(const float*);
  return at;
}

void kv_store_rows(const KvStoreShape& s, const void* table, uint8_t* pool, float* rings, int32_t* status,
                   cudaStream_t stream) {
  const KvStoreLayout at = kv_store_layout(s);
  const char* t = static_cast<const char*>(table);
  const auto* sources = reinterpret_cast<const float* const*>(t + at.sources_at);
  if (s.tiles > 0) {
    launch<kv_store_tile_kernel>(dim3(static_cast<unsigned>(s.tiles)), kStoreThreads, 0, stream, s,
                                 reinterpret_cast<const KvStoreTile*>(t + at.tiles_at),
                                 reinterpret_cast<const KvStoreSource*>(t + at.rows_at), sources,
                                 static_cast<const float*>(rings), pool, status);
    LOOM_CUDA_CHECK_LAUNCH();
  }
  if (s.rings > 0) {
    launch<kv_store_ring_kernel>(dim3(static_cast<unsigned>(s.rings)), kStoreThreads, 0, stream,
                                 reinterpret_cast<const KvStoreRing*>(t + at.rings_at), sources, rings);
    LOOM_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace loom::cuda

// ---------------------------------------------------------------------------- argmax_rows
// Backend::argmax_rows: a block of 256 threads per row; thread t scans elements t, t + 256, ...
// keeping the first largest it sees, then a shared-memory tree keeps the larger value and, on a
// tie, the smaller index: the row's first largest value, as std::max_element. Reads the row once
// (V x 4 bytes: 0.5 MB for a 128k vocabulary, 0.15 us at 3.35 TB/s), writes 4 bytes.
namespace loom::cuda {
namespace {

constexpr int kArgmaxThreads = 256;

__global__ void __launch_bounds__(kArgmaxThreads) argmax_rows_kernel(const float* __restrict__ x, int64_t V,
                                                                     int32_t* __restrict__ out) {
  __shared__ float best[kArgmaxThreads];
  __shared__ int32_t where[kArgmaxThreads];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * V;
  float b = -CUDART_INF_F;
  int32_t w = static_cast<int32_t>(V);  // none yet
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    if (row[i] > b || w == V) b = row[i], w = static_cast<int32_t>(i);
  }
  best[threadIdx.x] = b, where[threadIdx.x] = w;
  __syncthreads();
  for (int half = kArgmaxThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) {
      const float v = best[threadIdx.x + half];
      const int32_t j = where[threadIdx.x + half];
      if (j < V && (where[threadIdx.x] == V || v > best[threadIdx.x] || (v == best[threadIdx.x] && j < where[threadIdx.x]))) {
        best[threadIdx.x] = v, where[threadIdx.x] = j;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = where[0];
}

}  // namespace

void argmax_rows(const float* x, int64_t rows, int64_t V, int32_t* out, cudaStream_t stream) {
  launch<argmax_rows_kernel>(dim3(static_cast<unsigned>(rows)), kArgmaxThreads, 0, stream, x, V, out);
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace loom::cuda
