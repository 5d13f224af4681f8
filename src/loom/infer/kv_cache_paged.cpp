// The paged KV cache (PagedAttention, Kwon et al. 2023; kv_cache.h "Sharing", "Forgetting" and
// "Accounting"): a pool of blocks, a free list and reference counts, copy-on-write of a shared
// block, blocks held apart from sequences for prefix caching. A sequence's tile k is the block its
// block table names; everything else is TiledKvCache's (tiled_kv_cache.h).
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/tensor.h"
#include "loom/infer/kv_cache.h"
#include "loom/infer/tiled_kv_cache.h"

namespace loom {

using namespace kv;

namespace {

// PagedAttention's block manager: a pool of num_blocks blocks, a free list, reference counts.
class PagedKvCache final : public TiledKvCache {
 public:
  PagedKvCache(const KvCacheConfig& config, Allocator* allocator, std::unique_ptr<KvBytes> bytes = nullptr)
      : TiledKvCache(checked(config), allocator, std::move(bytes)),
        block_bytes_(kv_block_bytes(config)),
        refcount_(static_cast<size_t>(config.num_blocks), 0) {
    this->bytes().allocate_pool(config.num_blocks * block_bytes_);
    for (int64_t b = config.num_blocks - 1; b >= 0; --b) free_.push_back(b);
  }

  int64_t bytes_reserved() const override { return config_.num_blocks * block_bytes_ + window_bytes_reserved(); }
  int64_t bytes_used() const override {
    int64_t bytes = window_bytes_in_use();
    for (int64_t f : block_fill()) bytes += used_bytes_of_positions(f);
    return bytes;
  }
  int64_t block_bytes() const override { return block_bytes_; }
  int64_t block_positions() const override { return config_.block_size; }
  int64_t blocks_in_use() const override { return config_.num_blocks - free_blocks(); }
  int64_t free_blocks() const override { return static_cast<int64_t>(free_.size()); }
  int64_t positions_in_use() const override {
    int64_t positions = 0;
    for (int64_t f : block_fill()) positions += f;
    return positions;
  }
  double utilisation() const override {
    if (blocks_in_use() == 0) return 0.0;
    int64_t bytes = 0;
    for (int64_t f : block_fill()) bytes += used_bytes_of_positions(f);
    return static_cast<double>(bytes) / static_cast<double>(blocks_in_use() * block_bytes_);
  }
  int64_t sequence_blocks(int64_t seq) const override {
    const Sequence& s = live(seq);
    return static_cast<int64_t>(s.blocks.size()) - s.dropped;
  }
  int64_t block_refcount(int64_t seq, int64_t position) const override {
    const Sequence& s = live(seq);
    const int64_t k = position / config_.block_size;
    LOOM_CHECK(0 <= position && k < static_cast<int64_t>(s.blocks.size()), "kv cache: position ", position,
               " of sequence ", seq, " has no block (", s.blocks.size(), " blocks of ", config_.block_size, ")");
    LOOM_CHECK(k >= s.dropped, "kv cache: position ", position, " of sequence ", seq,
               " was forgotten (forget_before(", seq, ", ", s.forgotten, ") returned its block)");
    return refcount_[static_cast<size_t>(s.blocks[static_cast<size_t>(k)])];
  }

 protected:
  int64_t tile(const Sequence& s, int64_t k, int64_t layer, int stream) const override {
    const int64_t block = s.blocks[static_cast<size_t>(k)];
    return block * block_bytes_ + layer * layouts_.tile_pair_bytes() +
           (stream == STREAM_V ? layouts_.stream[STREAM_K].tile_bytes : 0);
  }

  void reserve_position(Sequence& s, int64_t, int64_t p) override {
    if (p / config_.block_size < static_cast<int64_t>(s.blocks.size())) return;
    s.blocks.push_back(allocate_block());
  }

  void make_tile_writable(Sequence& s, int64_t k) override {
    int64_t& block = s.blocks[static_cast<size_t>(k)];
    if (refcount_[static_cast<size_t>(block)] == 1) return;
    const int64_t copy = allocate_block();
    bytes().copy_pool(block * block_bytes_, copy * block_bytes_, block_bytes_);
    --refcount_[static_cast<size_t>(block)];
    block = copy;
  }

  int64_t block_of(int64_t seq, int64_t tile) const override {
    const Sequence& s = live(seq);
    LOOM_CHECK(tile >= s.dropped && tile < static_cast<int64_t>(s.blocks.size()), "kv cache: sequence ", seq,
               " holds no tile ", tile);
    return s.blocks[static_cast<size_t>(tile)];
  }
  void retain(int64_t block) override { ++refcount_[static_cast<size_t>(checked_block(block))]; }
  void drop(int64_t block) override {
    LOOM_CHECK(refcount_[static_cast<size_t>(checked_block(block))] > 0, "kv cache: drop of free block ", block);
    drop_reference(block);
  }
  int64_t refcount(int64_t block) const override { return refcount_[static_cast<size_t>(checked_block(block))]; }

  void on_add(Sequence&) override {}
  void adopt(Sequence& s, const std::vector<int64_t>& blocks) override {
    for (const int64_t b : blocks) {
      LOOM_CHECK(refcount_[static_cast<size_t>(checked_block(b))] > 0, "kv cache: cached block ", b, " is free");
      ++refcount_[static_cast<size_t>(b)];
    }
    s.blocks = blocks;
  }
  void on_fork(const Sequence& parent, Sequence& child) override {
    child.blocks = parent.blocks;  // forgotten tiles stay kNoBlock: the child shares live blocks only
    for (int64_t b : child.blocks) {
      if (b != kNoBlock) ++refcount_[static_cast<size_t>(b)];
    }
  }
  void on_release(Sequence& s) override {
    for (int64_t& b : s.blocks) drop_entry(b);
  }
  // Tiles k with (k + 1) B <= forgotten hold forgotten positions only: their blocks go back
  // (vLLM's sliding-window block release; Mistral 7B's rolling buffer bounds a sequence the same
  // way). The table keeps its length, so tile k still maps to positions [kB, kB + B).
  void on_forget(Sequence& s) override {
    const int64_t dropped = s.forgotten / config_.block_size;  // forgotten <= length: those tiles exist
    for (int64_t k = s.dropped; k < dropped; ++k) drop_entry(s.blocks[static_cast<size_t>(k)]);
    s.dropped = std::max(s.dropped, dropped);
  }

 private:
  static const KvCacheConfig& checked(const KvCacheConfig& config) {
    LOOM_CHECK(config.num_blocks > 0, "kv_cache.num_blocks must be > 0 for a paged cache, got ", config.num_blocks);
    return config;
  }

  // One reference to `block` goes; the block is free once none is left.
  void drop_entry(int64_t& block) {
    if (block == kNoBlock) return;
    drop_reference(block);
    block = kNoBlock;
  }
  void drop_reference(int64_t block) {
    if (--refcount_[static_cast<size_t>(block)] == 0) free_.push_back(block);
  }
  int64_t checked_block(int64_t block) const {
    LOOM_CHECK(block >= 0 && block < config_.num_blocks, "kv cache: block ", block, " outside the pool of ",
               config_.num_blocks);
    return block;
  }

  int64_t allocate_block() {
    LOOM_CHECK(!free_.empty(), "kv cache: out of blocks: all ", config_.num_blocks, " blocks of the pool (",
               config_.block_size, " positions each) are in use; raise kv_cache.num_blocks or release sequences");
    const int64_t b = free_.back();
    free_.pop_back();
    refcount_[static_cast<size_t>(b)] = 1;
    return b;
  }

  // [block] filled positions: the most any live sequence referring to the block fills.
  std::vector<int64_t> block_fill() const {
    std::vector<int64_t> fill(static_cast<size_t>(config_.num_blocks), 0);
    for (const auto& [id, s] : sequences_) {
      const int64_t n = s.filled();
      for (size_t k = static_cast<size_t>(s.dropped); k < s.blocks.size(); ++k) {
        const int64_t f = std::clamp<int64_t>(n - static_cast<int64_t>(k) * config_.block_size, 0, config_.block_size);
        fill[static_cast<size_t>(s.blocks[k])] = std::max(fill[static_cast<size_t>(s.blocks[k])], f);
      }
    }
    return fill;
  }

  const int64_t block_bytes_;
  std::vector<int32_t> refcount_;  // [block] sequences referring to it
  std::vector<int64_t> free_;      // free blocks; the back is handed out next
};

}  // namespace

std::unique_ptr<KvCache> make_paged_kv_cache(const KvCacheConfig& config, Allocator* allocator) {
  return std::make_unique<PagedKvCache>(config, allocator);
}

std::unique_ptr<KvCache> kv::make_paged_kv_cache(const KvCacheConfig& config, std::unique_ptr<KvBytes> bytes) {
  return std::make_unique<PagedKvCache>(config, nullptr, std::move(bytes));
}

}  // namespace loom
