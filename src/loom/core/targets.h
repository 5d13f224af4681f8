// The target id of a position whose prediction does not count: a loss mask (supervised
// fine-tuning's prompt tokens), PyTorch's ignore_index default. The data loader writes it
// (data/loader.h), the cross-entropy ops (CPU and CUDA) give it loss 0 and a zero gradient row,
// and the trainer's loss is the mean over the other positions.
#pragma once
#include <algorithm>
#include <cstdint>

namespace loom {
inline constexpr int32_t kIgnoreTarget = -100;

// How many of the n targets count (are not kIgnoreTarget).
inline int64_t counted_targets(const int32_t* targets, int64_t n) {
  return n - static_cast<int64_t>(std::count(targets, targets + n, kIgnoreTarget));
}
}  // namespace loom
