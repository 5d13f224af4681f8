// Launchers of the decode attention over a paged, quantized KV cache (cuda_decode.cu): the kernels
// of Backend::kv_attention (backend/kv_attention.h states the plan and the formula, backend/kv_format.h
// the storage formats). Plain device pointers and sizes in, work enqueued on `stream`, nothing
// synchronized. The op file (cuda_decode_ops.cpp) validates the plan with check_kv_attention, chooses
// the split size, packs the plan's rows and tile offsets into one table (the layout below) and copies
// it to the front of the workspace; the kernels read the table and write their partials behind it.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "loom/backend/kv_quantize.h"

namespace loom::cuda {

constexpr int64_t kKvMaxHeadDim = 256;  // a warp holds a head's row in registers: 8 channels per lane

// One stream's (K or V) storage as the kernels read it (kv_format.h's byte layout).
enum KvKind : int32_t { KV_KIND_F32 = 0, KV_KIND_BF16 = 1, KV_KIND_INT = 2 };
struct KvStreamLayout {
  int32_t kind = KV_KIND_F32;
  int32_t bits = 32;         // integer codes: 8, 4 or 2
  int32_t per_channel = 0;   // integer, one (scale, min) per channel of a tile
  int64_t group = 1;         // integer per token: channels per (scale, min) pair
  int64_t groups = 1;        // integer per token: pairs per row (width / group)
  int64_t row_bytes = 0;     // bytes of one stored row (kv_row_bytes)
  int64_t param_bytes = 0;   // bytes of a tile's (scale, min) pairs (kv_tile_param_bytes)
  int64_t window = 0;        // rows of the stream's fp32 ring
};

// A query row as the kernels read it: the plan's KvAttendRow plus its splits, items
// [item0, item0 + splits) of the split kernel's grid.
struct KvDecodeRow {
  int64_t first = 0, n = 0, tiles = 0;
  int64_t stored[2] = {0, 0};
  int64_t ring[2] = {-1, -1};
  int64_t item0 = 0, splits = 1;
};

struct KvDecodeShape {
  int64_t rows = 0;                          // query rows
  int64_t n_head = 0, n_kv_head = 0, head_dim = 0;
  int64_t width = 0;                         // channels of a K or V row: n_kv_head * head_dim
  int64_t block = 0;                         // rows per tile
  int64_t entries = 0;                       // tile_offsets entries
  int64_t split = 0;                         // positions per split (kv_decode_split)
  int64_t items = 0;                         // (row, split) pairs: sum over rows of splits
  int64_t merge_rows = 0;                    // rows with more than one split
  float scale = 1.0f;                        // 1 / sqrt(head_dim), in f32 as the CPU
  int64_t sinks = 0;                         // 1: the table ends with n_head attention-sink logits
  KvStreamLayout stream[2];
};

// Byte offsets in the workspace. The table (one host -> device copy of table_bytes):
//   [rows x KvDecodeRow][entries x int64 tile offset][items x int32 row of the item]
//   [merge_rows x int32 row][n_head x f32 sink logit, when s.sinks], then the partials of the split kernel, per (item, query head):
//   running max m, sum l (f32) and the unnormalized output acc (head_dim f32).
struct KvDecodeLayout {
  size_t rows_at = 0, offsets_at = 0, items_at = 0, merges_at = 0, sinks_at = 0, table_bytes = 0;
  size_t m_at = 0, l_at = 0, acc_at = 0, bytes = 0;
};
KvDecodeLayout kv_decode_layout(const KvDecodeShape& s);

// Blocks of the split kernel per split: one per kv head, times the chunks of at most 8 (4 when
// head_dim > 128) query heads its group is cut into.
int64_t kv_decode_blocks_per_split(int64_t n_head, int64_t n_kv_head, int64_t head_dim);
// Positions per split for rows of `lengths` visible positions: the largest of 256, 128, 64 that
// still gives the GPU about two blocks per SM, else 64.
int64_t kv_decode_split(const int64_t* lengths, int64_t rows, int64_t blocks_per_split);

// out (rows, n_head * head_dim) from q (same shape), the pool's tiles and the rings (null when no
// row reads one); `workspace` holds the table at its front (already copied there, on `stream`) and
// room for the partials (kv_decode_layout(s).bytes in all). head_dim <= kKvMaxHeadDim.
void kv_attention_decode(const KvDecodeShape& s, void* workspace, const float* q, const uint8_t* pool,
                         const float* rings, float* out, cudaStream_t stream);

}  // namespace loom::cuda

namespace loom::cuda {

// ---- Backend::kv_store's kernels (backend/kv_store.h states the plan; the arithmetic is
// backend/kv_quantize.h's, shared with the CPU). The op file packs the plan into one table
// (kv_store_layout) in the workspace:
//   [tiles x KvStoreTile][rows x KvStoreSource][rings x KvStoreRing][sources x const float*].
struct KvStoreSource {
  int64_t source = 0;  // index into the table's source pointers, or -1: the rings
  int64_t offset = 0;  // float offset
};
struct KvStoreTile {
  int64_t stream = 0, dst = 0, rows = 0, first = 0;
};
struct KvStoreRing {
  KvStoreSource row;
  int64_t dst = 0, width = 0;
};
struct KvStoreShape {
  int64_t tiles = 0, rows = 0, rings = 0, sources = 0;
  kvq::KvStoreFormat format[2];
};
struct KvStoreLayout {
  size_t tiles_at = 0, rows_at = 0, rings_at = 0, sources_at = 0, bytes = 0;
};
KvStoreLayout kv_store_layout(const KvStoreShape& s);

// Runs the tile jobs (a block each: threads over a fp32 / bf16 job's elements, a per-token
// job's rows or a per-channel tile's code bytes), then the ring jobs (a block each, threads over
// the row), on `stream`; `table` is the packed plan in device memory. A group that cannot be
// stored sets *status.
void kv_store_rows(const KvStoreShape& s, const void* table, uint8_t* pool, float* rings, int32_t* status,
                   cudaStream_t stream);

// Backend::argmax_rows: out[i] = the first index of the largest value of row i of x (rows, V); a
// block per row.
void argmax_rows(const float* x, int64_t rows, int64_t V, int32_t* out, cudaStream_t stream);

}  // namespace loom::cuda
