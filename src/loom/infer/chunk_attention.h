// The causal attention of a chunk of consecutive positions of one sequence over its visible keys
// and values (a long prompt's chunk in the generation engine, a long window's in infer/score.h),
// on a CPU backend, FlashAttention's tiling (Dao et al. 2022, Algorithm 1, key tiles in the outer
// loop): per tile of kTile positions and per kv head two GEMMs, the scores of the chunk's queries
// (the kv head's query heads stacked) over the tile's keys scaled by 1/sqrt(head_dim), masked
// causally and by the layer's sliding window (ModelConfig::layer_window), folded into each row's running maximum
// and sum in fp32 (the online softmax, Milakov & Gimelshein 2018), then their product with the
// tile's values accumulated into the rescaled outputs. Memory: the chunk's queries and outputs and
// one tile's scores, keys and values, whatever the number of positions; each position's keys and
// values are read once per call. The decoding kernel (attend_rows.h) does the same a row at a
// time with dot products, several times slower on long prefixes; its sums run in another order,
// so the two agree to rounding, not bitwise.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "loom/arch/config.h"
#include "loom/backend/backend.h"

namespace loom {

class ChunkAttention {
 public:
  static constexpr int64_t kTile = 512;  // key positions a tile
  // Scores a tile needs before its softmax runs on several threads: below it (a few rows, as a
  // long prompt deep in its prefix takes beside decoding rows) a parallel region costs more than
  // it saves (OpenMP's threads wait passively, core/threads.h).
  static constexpr int64_t kParallelScores = 1 << 16;

  explicit ChunkAttention(const ModelConfig& config);
  // kv head g's keys and values of positions [lo + begin, lo + end) (end - begin <= kTile), as
  // (end - begin, head_dim) host tensors; asked tile by tile, every kv head of a tile before the
  // next tile.
  using KvTile = std::function<std::pair<Tensor, Tensor>(int64_t g, int64_t begin, int64_t end)>;
  // Rows r < n, at positions first + r: queries at q + r * q_stride (the heads side by side),
  // outputs likewise at out + r * out_stride, over positions [lo, first + n), lo the first
  // position row 0 sees (0, or first + 1 - W under the layer's window W = `window`; 0: none).
  // sinks: (n_head) attention-sink logits, each a position of zero value every row sees (the
  // running max and sum start at (s_h, 1) instead of (-inf, 0)), or null.
  void run(int64_t first, int64_t n, int64_t lo, int64_t window, const KvTile& tile, const float* q, int64_t q_stride,
           float* out, int64_t out_stride, const float* sinks = nullptr);
  // A KvTile over interleaved rows (n_kv_head x head_dim a position), as a KV cache hands them
  // out: read(begin, end, k, v) writes positions [lo + begin, lo + end) into k and v, once per
  // tile; each kv head's rows are then copied out of the tile (it stays in cache).
  using ReadRows = std::function<void(int64_t begin, int64_t end, float* k, float* v)>;
  KvTile interleaved(ReadRows read);
  Backend& backend() { return *cpu_; }  // host tensors for a KvTile come from its allocator
  // The scratch run and interleaved hold for chunks of up to `rows` rows (bytes).
  static int64_t workspace_bytes(const ModelConfig& config, int64_t rows);

 private:
  Tensor grow(Tensor& t, int64_t numel);
  const ModelConfig& c_;
  int64_t hd_, group_;
  std::unique_ptr<Backend> cpu_;
  Tensor q_, s_, o_, tile_k_, tile_v_;  // every head's query rows and outputs; a kv head's scores; a tile per kv head
  std::vector<float> slab_k_, slab_v_, max_, sum_;  // interleaved's tile; each query row's running max and sum
};

}  // namespace loom
