// Storing rows into a KV cache in a backend's memory, as a Backend op (Backend::kv_store): the
// writing side of what backend/kv_attention.h reads. A cache keeps its bookkeeping on the host
// (infer/kv_cache.h: which position goes to which tile, when a row leaves the fp32 window) and
// hands the backend, per flush, a plan of
//   tile jobs: `rows` fp32 rows quantized together into stream s's format (backend/kv_format.h;
//     kv_quantize_tile's bytes: one per-token row or bf16/fp32 row at its slot, or a whole
//     per-channel tile of `block` rows) at byte offset `dst` of the pool;
//   ring jobs: one fp32 row copied to float offset `dst` of the rings (the cache's fp32 windows).
// A row comes from `sources[source]` (f32 tensors: the step's q/k/v rows) at a float offset, or,
// for tile jobs, from the rings (source = kFromRings). Every tile job runs before every ring job,
// so a tile job reads the ring rows as they were before the op (the cache resolves rows written in
// the same plan to their sources). Jobs of one kind may run in any order or in parallel: no two
// write the same byte.
// Integer formats need finite values with |x| < 65504 (kv_format.h). A backend cannot throw for
// device data, so a failing group sets status[0] (1: a non-finite value, 2: beyond fp16's range)
// and leaves its bytes undefined; the caller reads status when it next synchronizes (the engine:
// once a step, with the logits) and fails then, naming the cache.
#pragma once
#include <cstdint>
#include <vector>

#include "loom/backend/kv_format.h"
#include "loom/backend/kv_quantize.h"
#include "loom/core/tensor.h"

namespace loom {

struct KvStoreRow {
  static constexpr int32_t kFromRings = -1;
  int32_t source = 0;  // index into sources, or kFromRings
  int64_t offset = 0;  // float offset of the row in it
};

struct KvTileJob {
  int32_t stream = 0;  // 0 K, 1 V: the spec the rows are stored in
  int64_t dst = 0;     // byte offset in the pool
  int64_t rows = 1;    // rows quantized together (a per-channel tile: its block rows)
  int64_t first = 0;   // index of the job's first row in KvStorePlan::rows
};

struct KvRingJob {
  KvStoreRow row;      // from a source (never from the rings)
  int64_t dst = 0;     // float offset in the rings
  int64_t width = 0;   // floats
};

struct KvStorePlan {
  KvQuantSpec spec[2];            // [K, V]
  std::vector<KvTileJob> tiles;
  std::vector<KvStoreRow> rows;   // the tile jobs' rows
  std::vector<KvRingJob> rings;

  bool empty() const { return tiles.empty() && rings.empty(); }
  void clear() { tiles.clear(), rows.clear(), rings.clear(); }
};

// The writers' view of a spec (backend/kv_quantize.h).
kvq::KvStoreFormat kv_store_format(const KvQuantSpec& spec);

// Throws a one-line error naming kv_store and the first inconsistency: a job whose rows or bytes
// fall outside their tensors, a ring job reading the rings, dtypes (sources and rings f32, pool
// u8, status i32 of at least one element). Every backend checks with it before running.
void check_kv_store(const KvStorePlan& plan, const std::vector<Tensor>& sources, const Tensor& pool,
                    const Tensor& rings, const Tensor& status);

// argmax_rows' operands: x f32 (n, V) with V >= 1, out i32 (n); throws naming argmax_rows.
void check_argmax_rows(const Tensor& x, const Tensor& out);

// The reference on host memory (sources[i] a host pointer to its floats).
void kv_store_host(const KvStorePlan& plan, const std::vector<const float*>& sources, uint8_t* pool, float* rings,
                   int32_t* status);

}  // namespace loom
