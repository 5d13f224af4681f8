// The KV caches' two storages (kv_bytes.h): host memory, and a backend's memory written through
// Backend::kv_store in one plan per flush.
#include "loom/infer/kv_bytes.h"

#include <cstring>

#include "loom/core/error.h"
#include "loom/infer/kv_quant.h"

namespace loom::kv {

int32_t KvBytes::add_source(const Tensor&) {
  throw Error("kv cache: rows in backend memory need a cache in the backend's memory (make_device_kv_cache)");
}
const Tensor& KvBytes::pool() const { throw Error("kv cache: a host cache has no backend pool"); }
const Tensor& KvBytes::rings() const { throw Error("kv cache: a host cache has no backend rings"); }

namespace {

class HostKvBytes final : public KvBytes {
 public:
  HostKvBytes(Allocator& allocator, int64_t window_floats) : allocator_(allocator), window_floats_(window_floats) {}

  void allocate_pool(int64_t bytes) override {
    pool_ = std::make_unique<Storage>(allocator_, static_cast<size_t>(bytes), MEM_KV_CACHE);
    base_ = static_cast<uint8_t*>(pool_->data);
  }

  int64_t take_ring() override {
    if (window_floats_ == 0) return -1;
    size_t slot = slots_.size();
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      slots_.emplace_back();
    }
    slots_[slot] = std::make_unique<Storage>(allocator_, static_cast<size_t>(window_floats_) * sizeof(float), MEM_KV_CACHE);
    return static_cast<int64_t>(slot) * window_floats_;
  }
  void free_ring(int64_t at) override {
    if (at < 0) return;
    const auto slot = static_cast<size_t>(at / window_floats_);
    slots_[slot].reset();
    free_.push_back(slot);
  }
  int64_t ring_bytes_reserved() const override {
    int64_t bytes = 0;
    for (const auto& s : slots_) bytes += s ? static_cast<int64_t>(s->bytes) : 0;
    return bytes;
  }

  void store_tile(const KvQuantSpec& spec, int, const RowRef* rows, int64_t count, int64_t dst) override {
    if (count == 1) {
      kv_quantize_tile(spec, row(rows[0]), 1, base_ + dst);
      return;
    }
    const int64_t W = spec.width;
    scratch_.resize(static_cast<size_t>(count * W));
    for (int64_t r = 0; r < count; ++r) {
      std::memcpy(scratch_.data() + r * W, row(rows[r]), static_cast<size_t>(W) * sizeof(float));
    }
    kv_quantize_tile(spec, scratch_.data(), count, base_ + dst);
  }
  void store_ring(const RowRef& from, int64_t width, int64_t dst) override {
    std::memcpy(ring(dst), row(from), static_cast<size_t>(width) * sizeof(float));
  }
  void copy_pool(int64_t src, int64_t dst, int64_t bytes) override {
    std::memcpy(base_ + dst, base_ + src, static_cast<size_t>(bytes));
  }
  void copy_ring(int64_t src, int64_t dst, int64_t floats) override {
    std::memcpy(ring(dst), ring(src), static_cast<size_t>(floats) * sizeof(float));
  }
  const uint8_t* pool_view(int64_t offset, int64_t) override { return base_ + offset; }
  const float* ring_view(int64_t offset, int64_t) override { return ring(offset); }

 private:
  float* ring(int64_t offset) const {
    return static_cast<float*>(slots_[static_cast<size_t>(offset / window_floats_)]->data) + offset % window_floats_;
  }
  const float* row(const RowRef& r) const {
    LOOM_CHECK(r.from != RowRef::SOURCE, "kv cache: a host cache stores host rows only");
    return r.from == RowRef::HOST ? r.host : ring(r.offset);
  }

  Allocator& allocator_;
  const int64_t window_floats_;
  std::unique_ptr<Storage> pool_;
  uint8_t* base_ = nullptr;
  std::vector<std::unique_ptr<Storage>> slots_;  // [slot] a live sequence's window, or null
  std::vector<size_t> free_;                     // null slots
  std::vector<float> scratch_;                   // a per-channel tile's rows
};

class DeviceKvBytes final : public KvBytes {
 public:
  static constexpr int32_t kHostRows = -2;  // a KvStoreRow of the host rows, its source known at flush

  DeviceKvBytes(Backend& backend, const KvQuantSpec (&specs)[2], int64_t window_floats, int64_t max_sequences)
      : backend_(backend), window_floats_(window_floats), max_sequences_(max_sequences) {
    LOOM_CHECK(backend.capabilities().kv_cache, "kv cache: backend ", backend.name(),
               " does not run a KV cache in its memory (capabilities().kv_cache)");
    LOOM_CHECK(max_sequences > 0, "kv cache: a cache in backend memory needs max_sequences > 0, got ", max_sequences);
    plan_.spec[0] = specs[0], plan_.spec[1] = specs[1];
    status_ = Tensor::zeros(backend.allocator(), {1}, DTYPE_I32, MEM_WORKSPACE);
    if (window_floats > 0) {
      rings_ = Tensor::zeros(backend.allocator(), {max_sequences * window_floats}, DTYPE_F32, MEM_KV_CACHE);
      for (int64_t s = max_sequences - 1; s >= 0; --s) free_.push_back(s);
    }
  }

  void allocate_pool(int64_t bytes) override {
    // Zeroed: a host read (pool_view) copies whole tiles, written or not (a GPU's initcheck).
    pool_ = Tensor::zeros(backend_.allocator(), {bytes}, DTYPE_U8, MEM_KV_CACHE);
  }

  int64_t take_ring() override {
    if (window_floats_ == 0) return -1;
    LOOM_CHECK(!free_.empty(), "kv cache: all ", max_sequences_, " fp32 windows of the cache in backend memory are in "
               "use (one per live sequence; generate.max_batch sets how many)");
    const int64_t slot = free_.back();
    free_.pop_back();
    return slot * window_floats_;
  }
  void free_ring(int64_t at) override {
    if (at < 0) return;
    flush();  // no pending store may land in the slot after its next owner's
    free_.push_back(at / window_floats_);
  }
  int64_t ring_bytes_reserved() const override {
    return rings_.defined() ? static_cast<int64_t>(rings_.nbytes()) : 0;
  }

  void store_tile(const KvQuantSpec& spec, int stream, const RowRef* rows, int64_t count, int64_t dst) override {
    plan_.tiles.push_back({stream, dst, count, static_cast<int64_t>(plan_.rows.size())});
    for (int64_t r = 0; r < count; ++r) plan_.rows.push_back(resolve(rows[r], spec.width));
  }
  void store_ring(const RowRef& from, int64_t width, int64_t dst) override {
    const KvStoreRow row = resolve(from, width);
    const auto pending = pending_rings_.find(dst);
    if (pending != pending_rings_.end()) {  // the slot's newer row replaces the one not yet stored
      plan_.rings[pending->second].row = row;
      return;
    }
    pending_rings_.emplace(dst, plan_.rings.size());
    plan_.rings.push_back({row, dst, width});
  }
  void copy_pool(int64_t src, int64_t dst, int64_t bytes) override {
    flush();
    backend_.copy(pool_.view(src, {bytes}), pool_.view(dst, {bytes}));
  }
  void copy_ring(int64_t src, int64_t dst, int64_t floats) override {
    flush();
    backend_.copy(rings_.view(src, {floats}), rings_.view(dst, {floats}));
  }
  const uint8_t* pool_view(int64_t offset, int64_t bytes) override {
    flush();
    bytes_.resize(static_cast<size_t>(bytes));
    backend_.read(pool_.view(offset, {bytes}), bytes_.data());
    return bytes_.data();
  }
  const float* ring_view(int64_t offset, int64_t floats) override {
    flush();
    floats_.resize(static_cast<size_t>(floats));
    backend_.read(rings_.view(offset, {floats}), floats_.data());
    return floats_.data();
  }

  int32_t add_source(const Tensor& rows) override {
    LOOM_CHECK(rows.dtype() == DTYPE_F32, "kv cache: rows to store must be f32, got ", dtype_name(rows.dtype()));
    if (plan_.empty()) sources_.clear();  // nothing pending reads them
    for (size_t i = 0; i < sources_.size(); ++i) {
      if (sources_[i].device_ptr() == rows.device_ptr() && sources_[i].numel() == rows.numel()) {
        return static_cast<int32_t>(i);
      }
    }
    sources_.push_back(rows);
    return static_cast<int32_t>(sources_.size() - 1);
  }

  // Runs the pending stores. The sources stay: a write_rows may flush half-way (a copy-on-write)
  // and go on naming its source by index; add_source drops them once nothing is pending.
  void flush() override {
    if (plan_.empty()) return;
    const size_t named = sources_.size();
    if (!host_rows_.empty()) {  // KvCache::write's host rows, uploaded once
      const auto n = static_cast<int64_t>(host_rows_.size());
      if (!host_tensor_.defined() || host_tensor_.numel() < n) {
        host_tensor_ = Tensor::empty(backend_.allocator(), {n}, DTYPE_F32, MEM_WORKSPACE);
      }
      backend_.write(host_tensor_.view(0, {n}), host_rows_.data());
      const auto index = static_cast<int32_t>(sources_.size());
      sources_.push_back(host_tensor_);
      for (KvStoreRow& r : plan_.rows) r.source = r.source == kHostRows ? index : r.source;
      for (KvRingJob& j : plan_.rings) j.row.source = j.row.source == kHostRows ? index : j.row.source;
    }
    backend_.kv_store(plan_, sources_, pool_, rings_, status_);
    plan_.clear();
    pending_rings_.clear();
    sources_.resize(named);  // without the host rows' tensor
    host_rows_.clear();
  }

  Backend* backend() const override { return &backend_; }
  const Tensor& pool() const override { return pool_; }
  const Tensor& rings() const override { return rings_; }

  void check_status() override {
    int32_t status = 0;
    backend_.read(status_, &status);
    LOOM_CHECK(status == 0, "kv cache: a K or V row held ",
               status == 1 ? "a non-finite value (inf or NaN)" : "a value beyond fp16's range (|x| >= 65504)",
               ", which the cache's integer format cannot store (a (scale, min) pair is fp16)");
  }

 private:
  // A RowRef as the plan names it: a ring row stored earlier in this plan is read from where that
  // row came from (the ring jobs run after the tile jobs).
  KvStoreRow resolve(const RowRef& r, int64_t width) {
    switch (r.from) {
      case RowRef::SOURCE:
        return {r.source, r.offset};
      case RowRef::RING: {
        const auto pending = pending_rings_.find(r.offset);
        if (pending != pending_rings_.end()) return plan_.rings[pending->second].row;
        return {KvStoreRow::kFromRings, r.offset};
      }
      case RowRef::HOST:
      default: {
        const auto at = static_cast<int64_t>(host_rows_.size());
        host_rows_.insert(host_rows_.end(), r.host, r.host + width);
        return {kHostRows, at};
      }
    }
  }

  Backend& backend_;
  const int64_t window_floats_, max_sequences_;
  Tensor pool_, rings_, status_, host_tensor_;
  std::vector<int64_t> free_;                 // free window slots
  KvStorePlan plan_;                          // the stores since the last flush
  std::vector<Tensor> sources_;               // the rows' source tensors (add_source)
  std::vector<float> host_rows_;              // their host rows
  std::map<int64_t, size_t> pending_rings_;   // ring float offset -> its ring job in plan_
  std::vector<uint8_t> bytes_;                // pool_view's copy
  std::vector<float> floats_;                 // ring_view's copy
};

}  // namespace

std::unique_ptr<KvBytes> make_host_kv_bytes(Allocator& allocator, int64_t window_floats) {
  return std::make_unique<HostKvBytes>(allocator, window_floats);
}

std::unique_ptr<KvBytes> make_device_kv_bytes(Backend& backend, const KvQuantSpec (&specs)[2], int64_t window_floats,
                                              int64_t max_sequences) {
  return std::make_unique<DeviceKvBytes>(backend, specs, window_floats, max_sequences);
}

}  // namespace loom::kv
