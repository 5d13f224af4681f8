// Automatic prefix caching (vLLM's automatic prefix caching, Kwon et al. 2023; SGLang's radix
// cache, Zheng et al. 2024, keeps the same reuse in a tree): the full KV blocks of prompts stay in
// a paged cache after their requests finish, keyed by the hash of the whole token prefix they
// end, so a later prompt that starts with the same tokens takes those blocks (shared, never
// written again) instead of computing them.
//
// Keys. Tile k of a prompt (tokens [kB, (k + 1) B), B = block_size) is keyed by
//     h_k = XXH3-64(tokens of tile k, seed = h_{k-1}),  h_{-1} = 0,
// so a key names the whole prefix [0, (k + 1) B). An entry also keeps its tile's tokens and its
// parent's key, and a lookup compares both, so a hash collision is a miss, never wrong KV.
//
// References. The table holds one reference to each cached block (KvCache::retain), so a block
// outlives the request that computed it; a request that matches takes one more per block
// (KvCache::add_sequence_with). A block whose only reference is the table's is idle: it is what
// eviction may free. Eviction is least-recently-used, deepest first among equals (a leaf before
// the prefix it extends), over idle entries only.
//
// Not thread-safe: the generation engine owns it and calls it from its step.
#pragma once
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace loom {

class KvCache;

struct PrefixCacheStats {
  int64_t queries = 0;         // requests looked up
  int64_t query_tokens = 0;    // prompt tokens that could have been served from the cache
  int64_t hit_tokens = 0;      // of them, served (whole blocks)
  int64_t inserted_blocks = 0, evicted_blocks = 0;
};

class PrefixCache {
 public:
  explicit PrefixCache(KvCache& cache);
  ~PrefixCache();  // drops the table's references

  // The blocks of the longest cached prefix of `prompt` made of at most `max_tiles` whole tiles,
  // in order (empty on a miss); marks them used now. Counts the query in stats().
  std::vector<int64_t> match(std::span<const int32_t> prompt, int64_t max_tiles);
  // Sequence `seq` holds `prompt`'s first `tiles` full tiles: caches those not cached yet.
  void insert(std::span<const int32_t> prompt, int64_t tiles, int64_t seq);
  // Blocks only the table refers to (what evict can free).
  int64_t idle_blocks() const;
  // Frees up to `count` idle blocks, least recently used first; returns how many it freed.
  int64_t evict(int64_t count);
  // Every entry goes (the table's references dropped).
  void clear();

  int64_t entries() const { return static_cast<int64_t>(entries_.size()); }
  const PrefixCacheStats& stats() const { return stats_; }

 private:
  struct Entry {
    uint64_t parent = 0;
    std::vector<int32_t> tokens;  // the tile's B tokens
    int64_t block = 0;
    int64_t depth = 0;            // tile index
    uint64_t used = 0;            // clock of the last match or insert
  };

  uint64_t key(uint64_t parent, std::span<const int32_t> tile) const;

  KvCache& cache_;
  int64_t block_size_;
  std::unordered_map<uint64_t, Entry> entries_;
  uint64_t clock_ = 0;
  PrefixCacheStats stats_;
};

}  // namespace loom
