// Shared by the distributed tests: the MPI fixture (the world communicator, a CPU backend,
// this rank and the world size) and the token stream they train on.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"

namespace loom {

struct MpiFixture {
  std::unique_ptr<Communicator> comm = make_mpi_communicator();
  std::unique_ptr<Backend> backend = make_cpu_backend();
  int r = comm->rank(), n = comm->size();
  Tensor make(const Shape& shape, DType dtype) { return Tensor::zeros(backend->allocator(), shape, dtype, MEM_WORKSPACE); }
  Tensor f32(int64_t numel) { return make({numel}, DTYPE_F32); }
};

// Deterministic, with enough structure that 20 steps of a tiny model visibly lower the loss.
inline std::vector<int32_t> mpi_test_corpus(int64_t n, int32_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + i / vocab + (i * i) % 13) % vocab);
  return t;
}

}  // namespace loom
