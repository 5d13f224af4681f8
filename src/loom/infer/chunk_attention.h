// The causal attention of a chunk of consecutive positions of one sequence over its visible keys
// and values (a long prompt's chunk in the generation engine, a long window's in infer/score.h):
// per kv head two GEMMs on a CPU backend, the scores of the chunk's queries (the kv head's query
// heads stacked) over the visible keys scaled by 1/sqrt(head_dim), masked causally and by the
// sliding window (model.attn_window), softmaxed in fp32, then their product with the values:
// FlashAttention's arithmetic (Dao et al. 2022) without its tiling, since the chunk's scores fit
// (heads per kv head x chunk x positions floats at a time). The decoding kernel (attend_rows.h)
// does the same a row at a time with dot products, several times slower on long prefixes; its sums
// run in another order, so the two agree to rounding, not bitwise.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>

#include "loom/arch/config.h"
#include "loom/backend/backend.h"

namespace loom {

class ChunkAttention {
 public:
  explicit ChunkAttention(const ModelConfig& config);
  // Rows r < n, at positions first + r: queries at q + r * q_stride (the heads side by side),
  // outputs likewise at out + r * out_stride. keys(g) and values(g) are kv head g's (P, head_dim)
  // rows of positions [lo, first + n), lo the first position row 0 sees (0, or first + 1 - W
  // under a window W).
  using HeadRows = std::function<Tensor(int64_t kv_head)>;
  void run(int64_t first, int64_t n, int64_t lo, const HeadRows& keys, const HeadRows& values, const float* q,
           int64_t q_stride, float* out, int64_t out_stride);
  // Interleaved rows (P, n_kv_head x head_dim), as a KV cache hands them out, copied into one
  // (n_kv_head, P, head_dim) tensor of this object's, whose kv head g the HeadRows of
  // keys_by_head / values_by_head then return.
  void set_interleaved(const float* k, const float* v, int64_t P);
  HeadRows keys_by_head() const;
  HeadRows values_by_head() const;
  Backend& backend() { return *cpu_; }  // host tensors for HeadRows come from its allocator

 private:
  Tensor grow(Tensor& t, int64_t numel);
  const ModelConfig& c_;
  int64_t hd_, group_, interleaved_ = 0;
  std::unique_ptr<Backend> cpu_;
  Tensor q_, s_, o_, k_, v_;  // a kv head's query rows, scores, outputs; set_interleaved's keys, values
};

}  // namespace loom
