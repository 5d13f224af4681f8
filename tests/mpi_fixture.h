// Shared by the distributed tests: the MPI fixture (the world communicator, a CPU backend,
// this rank and the world size) and the token stream they train on.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/train/trainer.h"

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

// The test corpus's batches (16 tokens a sequence), and rank's `batch` rows of each global
// batch of batch x world rows (world 1: the corpus's batches themselves).
struct RankData {
  RankData(Allocator& allocator, const ModelConfig& config, int rank, int world, int64_t batch)
      : global(mpi_test_corpus(5000, static_cast<int32_t>(config.vocab_size)), 11) {
    if (world > 1) slice = std::make_unique<RankSliceSource>(global, allocator, rank, world, batch, 16);
  }
  BatchSource& source() { return slice ? static_cast<BatchSource&>(*slice) : global; }

  RandomWindowSource global;
  std::unique_ptr<RankSliceSource> slice;
};

// A training run's record: per step the loss, the gradient norm and the whole gradient.
struct Curve {
  std::vector<double> losses, norms;
  std::vector<std::vector<float>> grads;  // [step]
  int64_t tp_bytes = 0;                   // (tensor-parallel runs) sent over the tp group in the first step
};

// The one-process reference: the model of `config` initialised with seed 7, trained `steps`
// steps on the test corpus with `tc`.
inline Curve train_single(const ModelConfig& config, const TrainConfig& tc, int steps) {
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(7);
  Trainer trainer(*backend, model, tc);
  RankData data(backend->allocator(), config, 0, 1, tc.batch_size);
  Curve c;
  for (int s = 0; s < steps; ++s) {
    const StepStats st = trainer.train_step(data.source());
    c.losses.push_back(st.loss);
    c.norms.push_back(st.grad_norm);
    const float* g = model.grads().data<float>();
    c.grads.emplace_back(g, g + model.grads().numel());
  }
  return c;
}

}  // namespace loom
