#include "loom/data/batch_source.h"

#include "loom/core/error.h"
#include "loom/core/philox.h"

namespace loom {

RandomWindowSource::RandomWindowSource(std::vector<int32_t> tokens, uint64_t seed)
    : tokens_(std::move(tokens)), seed_(seed) {}

void RandomWindowSource::fill(const Tensor& tokens, const Tensor& targets) {
  const int64_t B = tokens.dim(0), T = tokens.dim(1);
  const int64_t n = static_cast<int64_t>(tokens_.size());
  LOOM_CHECK(n >= T + 1, "need at least ", T + 1, " tokens for windows of length ", T, ", have ", n);
  int32_t* x = tokens.data<int32_t>();
  int32_t* y = targets.data<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t draw = static_cast<uint64_t>(draws_++);
    const PhiloxCounter bits = philox4x32_10({static_cast<uint32_t>(draw), static_cast<uint32_t>(draw >> 32), 0, 0},
                                             {static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32)});
    const uint64_t r = (static_cast<uint64_t>(bits[0]) << 32) | bits[1];
    const int64_t start = static_cast<int64_t>(r % static_cast<uint64_t>(n - T));
    for (int64_t t = 0; t < T; ++t) {
      x[b * T + t] = tokens_[start + t];
      y[b * T + t] = tokens_[start + t + 1];
    }
  }
}

}  // namespace loom
