// Decode attention over a KV cache's stored rows, as a Backend op (Backend::kv_attention): what
// a cache in device memory hands the backend for one layer's query rows. The cache keeps its
// bookkeeping on the host (sequences, block tables, copy-on-write, the quantization schedule:
// infer/kv_cache.h) and its bytes in a pool tensor; each query row comes with a description of
// where its visible positions live:
//   positions [0, stored[s]) of stream s (K or V) are in tiles of `block` rows in the pool, tile k
//     at byte offset tile_offsets[tiles + 2k + s], in the stream's format (backend/kv_format.h;
//     an offset of -1 marks a tile no row reads: forgotten positions),
//   positions [stored[s], n) are fp32 rows of the stream's ring in `rings`: position t at float
//     offset ring[s] + (t % window[s]) * width[s] (the cache's fp32 window, kv_cache.h).
// For query head h (kv head g = h / (n_head / n_kv_head)) over the visible positions [first, n):
//     s_t = (q_h . k_t[g]) / sqrt(head_dim),  p_t = exp(s_t - max s) / sum_t exp(s_t - max s),
//     out_h = sum_t p_t v_t[g];
// with attention sinks (plan.sinks, GPT-OSS: a logit s_h per query head whose value is zero) the
// normalizer takes exp(s_h - m) more (backend/attend_rows.h).
// The CPU backend runs backend/attend_rows.h over the dequantized rows, in the order and with the
// arithmetic of the host cache's attend, so its output is bitwise the host cache's. A GPU splits
// the positions over thread blocks (split-KV, "flash decoding") and merges the partial softmaxes,
// another summation order: within the f32 attention tolerance of the op tests.
#pragma once
#include <cstdint>
#include <vector>

#include "loom/backend/kv_format.h"
#include "loom/core/tensor.h"

namespace loom {

struct KvAttendRow {
  int64_t first = 0, n = 0;      // visible positions [first, n), n > first
  int64_t tiles = 0;             // index of the row's tile 0 (K) in KvAttendPlan::tile_offsets
  int64_t stored[2] = {0, 0};    // [K, V]: positions [0, stored) are in tiles, the rest in the ring
  int64_t ring[2] = {-1, -1};    // [K, V]: float offset of the row's ring in `rings` (-1: none)
};

struct KvAttendPlan {
  KvQuantSpec spec[2];           // [K, V] formats; width = n_kv_head * head_dim for both
  int64_t block = 16;            // rows per tile
  int64_t window[2] = {0, 0};    // [K, V] rows of each ring (0: the stream has none)
  int64_t n_head = 0, n_kv_head = 0, head_dim = 0;
  std::vector<KvAttendRow> rows;
  std::vector<int64_t> tile_offsets;  // byte offsets into the pool; (K, V) pairs per tile
  // (n_head) f32 attention-sink logits of the layer, in the backend's memory (the layer's parameter
  // itself: no copy to the host inside a decoding step), or undefined: none.
  Tensor sinks;

  int64_t tile_bytes(int stream) const { return kv_tile_bytes(spec[stream], block); }
  // The largest number of positions a row attends to.
  int64_t max_positions() const;
};

// Throws a one-line error naming the op and the first inconsistency: sizes, formats, dtypes, a
// row whose tiles or ring fall outside the pool or the rings, q / out shapes (rows.size(),
// n_head * head_dim). Every backend checks with it before running.
void check_kv_attention(const KvAttendPlan& plan, const Tensor& q, const Tensor& pool, const Tensor& rings,
                        const Tensor& out);

// The reference on host memory: q and out (rows, n_head * head_dim) fp32, pool bytes, rings fp32,
// sinks the plan's (n_head) sink logits or null.
void kv_attention_host(const KvAttendPlan& plan, const float* q, const uint8_t* pool, const float* rings,
                       const float* sinks, float* out);

}  // namespace loom
