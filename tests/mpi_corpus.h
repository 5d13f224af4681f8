// The token stream the distributed tests train on: deterministic, with enough structure that
// 20 steps of a tiny model visibly lower the loss.
#pragma once
#include <cstdint>
#include <vector>

namespace loom {

inline std::vector<int32_t> mpi_test_corpus(int64_t n, int32_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + i / vocab + (i * i) % 13) % vocab);
  return t;
}

}  // namespace loom
