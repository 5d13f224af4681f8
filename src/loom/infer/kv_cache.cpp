// Contiguous and paged KV caches (PagedAttention, Kwon et al. 2023) with KIVI quantization (Liu
// et al. 2024); the storage, quantization schedule, sharing and accounting rules are stated in
// kv_cache.h. Both caches derive from TiledKvCache (tiled_kv_cache.h), which owns everything but
// the mapping from (sequence, tile index) to bytes. This file: the contiguous cache, whose tile k
// is at a fixed offset of the sequence's region; the config's checks and sizes; the interface's
// paged-only defaults. The paged cache is in kv_cache_paged.cpp.
#include "loom/infer/kv_cache.h"

#include <cstring>
#include <memory>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/tensor.h"
#include "loom/infer/tiled_kv_cache.h"

namespace loom {

using namespace kv;

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One region of max_len positions per sequence slot, laid out [layer][K tiles | V tiles].
class ContiguousKvCache final : public TiledKvCache {
 public:
  ContiguousKvCache(const KvCacheConfig& config, int64_t max_sequences, Allocator* allocator,
                    std::unique_ptr<KvBytes> bytes = nullptr)
      : TiledKvCache(checked(config, max_sequences), allocator, std::move(bytes)),
        max_sequences_(max_sequences),
        stream_bytes_{region_stream_bytes(STREAM_K), region_stream_bytes(STREAM_V)},
        region_bytes_(config.n_layer * (stream_bytes_[STREAM_K] + stream_bytes_[STREAM_V])) {
    this->bytes().allocate_pool(max_sequences * region_bytes_);
    for (int64_t r = max_sequences - 1; r >= 0; --r) free_.push_back(r);
  }

  int64_t bytes_reserved() const override { return max_sequences_ * region_bytes_ + window_bytes_reserved(); }
  int64_t bytes_used() const override {
    int64_t bytes = window_bytes_in_use();
    for (const auto& [id, s] : sequences_) bytes += used_bytes_of_positions(s.filled());
    return bytes;
  }
  int64_t block_bytes() const override { return region_bytes_; }
  int64_t block_positions() const override { return config_.max_len; }
  int64_t blocks_in_use() const override { return max_sequences_ - free_blocks(); }
  int64_t free_blocks() const override { return static_cast<int64_t>(free_.size()); }
  int64_t positions_in_use() const override {
    int64_t positions = 0;
    for (const auto& [id, s] : sequences_) positions += s.filled();
    return positions;
  }
  double utilisation() const override {
    if (blocks_in_use() == 0) return 0.0;
    int64_t bytes = 0;
    for (const auto& [id, s] : sequences_) bytes += used_bytes_of_positions(s.filled());
    return static_cast<double>(bytes) / static_cast<double>(blocks_in_use() * region_bytes_);
  }
  int64_t sequence_blocks(int64_t seq) const override { return live(seq).region >= 0 ? 1 : 0; }
  int64_t block_refcount(int64_t seq, int64_t position) const override {
    live(seq);
    LOOM_CHECK(0 <= position && position < config_.max_len, "kv cache: position ", position, " is outside [0, ",
               config_.max_len, ")");
    return 1;
  }

 protected:
  int64_t tile(const Sequence& s, int64_t k, int64_t layer, int stream) const override {
    return s.region * region_bytes_ +
           layer * (stream_bytes_[STREAM_K] + stream_bytes_[STREAM_V]) + (stream == STREAM_V ? stream_bytes_[STREAM_K] : 0) +
           k * layouts_.stream[stream].tile_bytes;
  }

  void reserve_position(Sequence&, int64_t seq, int64_t p) override {
    LOOM_CHECK(p < config_.max_len, "kv cache: sequence ", seq, " is full (max_len ", config_.max_len, " positions)");
  }
  void make_tile_writable(Sequence&, int64_t) override {}

  void on_add(Sequence& s) override { s.region = take_region(); }
  void on_fork(const Sequence& parent, Sequence& child) override {
    child.region = take_region();
    bytes().copy_pool(parent.region * region_bytes_, child.region * region_bytes_, region_bytes_);
  }
  void on_release(Sequence& s) override {
    free_.push_back(s.region);
    s.region = -1;
  }
  void on_forget(Sequence&) override {}  // a region is fixed: forgotten positions keep their storage

 private:
  static const KvCacheConfig& checked(const KvCacheConfig& config, int64_t max_sequences) {
    LOOM_CHECK(max_sequences > 0, "kv cache: max_sequences must be > 0 for a contiguous cache, got ", max_sequences);
    LOOM_CHECK(config.max_len > 0, "kv_cache.max_len must be > 0 for a contiguous cache, got ", config.max_len);
    const bool per_channel = config.k_spec().per_channel_integer() || (config.v_width > 0 && config.v_spec().per_channel_integer());
    LOOM_CHECK(!per_channel || config.max_len % config.block_size == 0, "kv_cache.max_len ", config.max_len,
               " must be a multiple of kv_cache.block_size ", config.block_size,
               " for per-channel quantization (tiles of block_size positions)");
    return config;
  }

  // One layer's stream in a region: max_len rows, or whole tiles for per-channel integers.
  int64_t region_stream_bytes(int stream) const {
    const StreamLayout& st = layouts_.stream[stream];
    if (!st.present) return 0;
    if (st.spec.per_channel_integer()) return config_.max_len / config_.block_size * st.tile_bytes;
    return config_.max_len * st.row_bytes;
  }

  int64_t take_region() {
    LOOM_CHECK(!free_.empty(), "kv cache: all ", max_sequences_, " sequence regions of the contiguous cache are in use",
               " (max_sequences ", max_sequences_, ")");
    const int64_t r = free_.back();
    free_.pop_back();
    return r;
  }

  const int64_t max_sequences_;
  const int64_t stream_bytes_[STREAM_COUNT];  // [stream] one layer's bytes in a region
  const int64_t region_bytes_;
  std::vector<int64_t> free_;   // free regions
};

}  // namespace

void KvCacheConfig::validate() const {
  LOOM_CHECK(n_layer > 0, "kv_cache.n_layer must be > 0, got ", n_layer);
  LOOM_CHECK(k_width > 0, "kv_cache.k_width must be > 0, got ", k_width);
  LOOM_CHECK(v_width >= 0, "kv_cache.v_width must be >= 0 (0 = no V rows), got ", v_width);
  LOOM_CHECK(block_size > 0, "kv_cache.block_size must be > 0, got ", block_size);
  LOOM_CHECK(residual >= 0, "kv_cache.residual must be >= 0, got ", residual);
  LOOM_CHECK(group >= 0, "kv_cache.group must be >= 0 (0 = the whole row), got ", group);
  const auto check_spec = [](const KvQuantSpec& spec, const char* which) {
    try {
      spec.validate();
    } catch (const Error& e) {
      throw Error(str_cat("kv_cache ", which, " rows: ", e.what()));
    }
  };
  check_spec(k_spec(), "K");
  if (v_width > 0) check_spec(v_spec(), "V");
}

int64_t kv_block_bytes(const KvCacheConfig& config) {
  config.validate();
  const Layouts layouts(config);
  return config.n_layer * layouts.tile_pair_bytes();
}

double kv_bytes_per_token(const KvCacheConfig& config) {
  return static_cast<double>(kv_block_bytes(config)) / static_cast<double>(config.block_size);
}

int64_t kv_window_bytes(const KvCacheConfig& config) {
  config.validate();
  const Layouts layouts(config);
  return config.n_layer * layouts.window_floats_per_layer() * static_cast<int64_t>(sizeof(float));
}

int64_t kv_sequence_bytes(const KvCacheConfig& config, int64_t length) {
  LOOM_CHECK(length >= 0, "kv cache: sequence length must be >= 0, got ", length);
  return ceil_div(length, config.block_size) * kv_block_bytes(config) + kv_window_bytes(config);
}

std::unique_ptr<KvCache> make_contiguous_kv_cache(const KvCacheConfig& config, int64_t max_sequences,
                                                  Allocator* allocator) {
  return std::make_unique<ContiguousKvCache>(config, max_sequences, allocator);
}

std::unique_ptr<KvCache> make_device_kv_cache(const KvCacheConfig& config, Backend& backend, int64_t max_sequences,
                                              bool paged) {
  const KvQuantSpec specs[2] = {config.k_spec(), config.v_spec()};
  auto bytes = make_device_kv_bytes(backend, specs, kv_window_bytes(config) / static_cast<int64_t>(sizeof(float)),
                                    max_sequences);
  if (paged) return kv::make_paged_kv_cache(config, std::move(bytes));
  return std::make_unique<ContiguousKvCache>(config, max_sequences, nullptr, std::move(bytes));
}

void KvCache::write_rows(int64_t, const std::vector<int64_t>&, const Tensor&, int64_t, int64_t, int64_t) {
  throw Error("kv cache: write_rows needs a cache in the backend's memory (make_device_kv_cache)");
}
void KvCache::attend_rows(int64_t, const std::vector<int64_t>&, const Tensor&, const Tensor&, int64_t, int64_t, int64_t,
                          int64_t, const Tensor&) {
  throw Error("kv cache: attend_rows needs a cache in the backend's memory (make_device_kv_cache)");
}

int64_t KvCache::block_of(int64_t, int64_t) const { throw Error("kv cache: block_of needs a paged cache"); }
void KvCache::retain(int64_t) { throw Error("kv cache: retain needs a paged cache"); }
void KvCache::drop(int64_t) { throw Error("kv cache: drop needs a paged cache"); }
int64_t KvCache::refcount(int64_t) const { throw Error("kv cache: refcount needs a paged cache"); }
int64_t KvCache::add_sequence_with(const std::vector<int64_t>&) {
  throw Error("kv cache: add_sequence_with needs a paged cache");
}

}  // namespace loom
