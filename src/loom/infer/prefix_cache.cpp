#include "loom/infer/prefix_cache.h"

#include <algorithm>
#include <tuple>

#include <xxhash.h>

#include "loom/core/error.h"
#include "loom/infer/kv_cache.h"

namespace loom {

PrefixCache::PrefixCache(KvCache& cache) : cache_(cache), block_size_(cache.config().block_size) {}

PrefixCache::~PrefixCache() { clear(); }

uint64_t PrefixCache::key(uint64_t parent, std::span<const int32_t> tile) const {
  return XXH3_64bits_withSeed(tile.data(), tile.size_bytes(), parent);
}

std::vector<int64_t> PrefixCache::match(std::span<const int32_t> prompt, int64_t max_tiles) {
  const int64_t tiles = std::min<int64_t>(max_tiles, static_cast<int64_t>(prompt.size()) / block_size_);
  ++stats_.queries;
  stats_.query_tokens += std::max<int64_t>(0, tiles) * block_size_;
  ++clock_;
  std::vector<int64_t> blocks;
  uint64_t parent = 0;
  for (int64_t k = 0; k < tiles; ++k) {
    const std::span<const int32_t> tile = prompt.subspan(static_cast<size_t>(k * block_size_), static_cast<size_t>(block_size_));
    const uint64_t h = key(parent, tile);
    const auto it = entries_.find(h);
    if (it == entries_.end() || it->second.parent != parent || !std::equal(tile.begin(), tile.end(), it->second.tokens.begin())) {
      break;
    }
    it->second.used = clock_;
    blocks.push_back(it->second.block);
    parent = h;
  }
  stats_.hit_tokens += static_cast<int64_t>(blocks.size()) * block_size_;
  return blocks;
}

void PrefixCache::insert(std::span<const int32_t> prompt, int64_t tiles, int64_t seq) {
  LOOM_CHECK(tiles * block_size_ <= static_cast<int64_t>(prompt.size()) && tiles * block_size_ <= cache_.length(seq),
             "prefix cache: ", tiles, " tiles of ", block_size_, " positions exceed the prompt (", prompt.size(),
             ") or sequence ", seq, " (", cache_.length(seq), " positions)");
  ++clock_;
  uint64_t parent = 0;
  for (int64_t k = 0; k < tiles; ++k) {
    const std::span<const int32_t> tile = prompt.subspan(static_cast<size_t>(k * block_size_), static_cast<size_t>(block_size_));
    const uint64_t h = key(parent, tile);
    const auto it = entries_.find(h);
    if (it != entries_.end()) {
      // Cached already (or a collision with another prefix: that entry stays, this tile is not cached).
      if (it->second.parent != parent || !std::equal(tile.begin(), tile.end(), it->second.tokens.begin())) return;
      it->second.used = clock_;
    } else {
      Entry e;
      e.parent = parent;
      e.tokens.assign(tile.begin(), tile.end());
      e.block = cache_.block_of(seq, k);
      e.depth = k;
      e.used = clock_;
      cache_.retain(e.block);
      entries_.emplace(h, std::move(e));
      ++stats_.inserted_blocks;
    }
    parent = h;
  }
}

int64_t PrefixCache::idle_blocks() const {
  int64_t idle = 0;
  for (const auto& [h, e] : entries_) idle += cache_.refcount(e.block) == 1 ? 1 : 0;
  return idle;
}

int64_t PrefixCache::evict(int64_t count) {
  std::vector<std::tuple<uint64_t, int64_t, uint64_t>> idle;  // (used, -depth, key)
  for (const auto& [h, e] : entries_) {
    if (cache_.refcount(e.block) == 1) idle.emplace_back(e.used, -e.depth, h);
  }
  std::sort(idle.begin(), idle.end());
  int64_t freed = 0;
  for (size_t i = 0; i < idle.size() && freed < count; ++i) {
    const auto it = entries_.find(std::get<2>(idle[i]));
    cache_.drop(it->second.block);
    entries_.erase(it);
    ++freed;
  }
  stats_.evicted_blocks += freed;
  return freed;
}

void PrefixCache::clear() {
  for (const auto& [h, e] : entries_) cache_.drop(e.block);
  entries_.clear();
}

}  // namespace loom
