// Where a KV cache's bytes live, not for callers (the caches' interface is kv_cache.h): the
// cache's bookkeeping (tiled_kv_cache.h) decides which rows go where and hands the storing,
// copying and reading to a KvBytes:
//   HostKvBytes    host memory: rows are quantized on the host as they are stored
//                  (kv_quantize_tile), read in place; a sequence's fp32 window is its own Storage.
//   DeviceKvBytes  a backend's memory (backend/kv_store.h, backend/kv_attention.h): stores are
//                  collected into a KvStorePlan and run by one Backend::kv_store at the next flush
//                  (before any read, copy, attention, fork or release), so a decoding step costs
//                  one kv_store and one kv_attention per layer whatever its batch. The fp32 windows
//                  are slots of one rings tensor (max_sequences of them, allocated up front).
//                  Reads for the host (KvCache::attend / read: MLA's latents, a prefix-cache hit's
//                  chunk) copy the tile to the host first.
// Offsets: the pool is one byte range; a window is addressed by its float offset in "the rings"
// (DeviceKvBytes: the rings tensor; HostKvBytes: slot k's Storage at k x window floats).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/backend/kv_store.h"
#include "loom/core/tensor.h"

namespace loom::kv {

// A row to be stored, by where it is now.
struct RowRef {
  enum From : int32_t { HOST, SOURCE, RING } from = HOST;
  const float* host = nullptr;  // HOST: the row
  int32_t source = 0;           // SOURCE: index from KvBytes::add_source
  int64_t offset = 0;           // SOURCE, RING: the row's float offset

  static RowRef of_host(const float* row) { return {HOST, row, 0, 0}; }
  static RowRef of_source(int32_t source, int64_t offset) { return {SOURCE, nullptr, source, offset}; }
  static RowRef of_ring(int64_t offset) { return {RING, nullptr, 0, offset}; }
};

class KvBytes {
 public:
  virtual ~KvBytes() = default;

  virtual void allocate_pool(int64_t bytes) = 0;  // once, by the cache's constructor
  // A window of `floats` floats for a new sequence (its float offset in the rings); -1 when floats == 0.
  virtual int64_t take_ring() = 0;
  virtual void free_ring(int64_t at) = 0;
  virtual int64_t ring_bytes_reserved() const = 0;

  // `count` rows quantized together (kv_quantize_tile) to pool byte `dst`.
  virtual void store_tile(const KvQuantSpec& spec, int stream, const RowRef* rows, int64_t count, int64_t dst) = 0;
  // One fp32 row of `width` floats to ring float offset `dst`.
  virtual void store_ring(const RowRef& row, int64_t width, int64_t dst) = 0;
  virtual void copy_pool(int64_t src, int64_t dst, int64_t bytes) = 0;
  virtual void copy_ring(int64_t src, int64_t dst, int64_t floats) = 0;
  // Host views, valid until the next call on this object.
  virtual const uint8_t* pool_view(int64_t offset, int64_t bytes) = 0;
  virtual const float* ring_view(int64_t offset, int64_t floats) = 0;

  // Device only (HostKvBytes throws): rows of a backend tensor as RowRef sources, the pending
  // stores run, the tensors kv_attention reads, the stores' status.
  virtual int32_t add_source(const Tensor& rows);
  virtual void flush() {}
  virtual Backend* backend() const { return nullptr; }
  virtual const Tensor& pool() const;
  virtual const Tensor& rings() const;
  virtual void check_status() {}
};

// allocator: host-accessible; window_floats: one sequence's window.
std::unique_ptr<KvBytes> make_host_kv_bytes(Allocator& allocator, int64_t window_floats);
// specs: the cache's [K, V] formats; max_sequences: window slots (sequences alive at once).
std::unique_ptr<KvBytes> make_device_kv_bytes(Backend& backend, const KvQuantSpec (&specs)[2], int64_t window_floats,
                                              int64_t max_sequences);

}  // namespace loom::kv
