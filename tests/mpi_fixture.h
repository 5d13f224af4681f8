// Shared by the distributed tests: the MPI fixture (the world communicator, a CPU backend,
// this rank and the world size) and the token stream they train on.
#pragma once
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/parallel/slice_source.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/core/targets.h"
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

// Loss masks: the first (row x 5) mod (T - 1) targets of each row the source gives are masked
// (kIgnoreTarget), so every row counts between 1 and T of its targets.
class MaskedWindows final : public BatchSource {
 public:
  MaskedWindows(BatchSource& inner, int64_t T) : inner_(inner), T_(T) {}
  void fill(const Tensor& tokens, const Tensor& targets) override {
    inner_.fill(tokens, targets);
    const int64_t rows = tokens.numel() / T_;
    for (int64_t r = 0; r < rows; ++r, ++row_) {
      const int64_t masked = (row_ * 5) % (T_ - 1);  // 0 .. T-2 masked: every row counts >= 1
      for (int64_t t = 0; t < masked; ++t) targets.data<int32_t>()[r * T_ + t] = kIgnoreTarget;
    }
  }

 private:
  BatchSource& inner_;
  int64_t T_, row_ = 0;
};

// Packed documents (data.document_mask): every input position p of the stream with p mod 5 = 3
// becomes the end-of-text token kDocumentEnd, which the source names as its separator, so each
// row holds several documents (tokens only: the targets stay the corpus's).
class DocumentWindows final : public BatchSource {
 public:
  static constexpr int32_t kDocumentEnd = 1;
  DocumentWindows(BatchSource& inner, int64_t T) : inner_(inner), T_(T) {}
  void fill(const Tensor& tokens, const Tensor& targets) override {
    inner_.fill(tokens, targets);
    const int64_t rows = tokens.numel() / T_;
    for (int64_t r = 0; r < rows; ++r, ++row_) {
      for (int64_t t = 0; t < T_; ++t) {
        if ((row_ * T_ + t) % 5 == 3) tokens.data<int32_t>()[r * T_ + t] = kDocumentEnd;
      }
    }
  }
  int32_t document_end() const override { return kDocumentEnd; }

 private:
  BatchSource& inner_;
  int64_t T_, row_ = 0;
};

// The test corpus's batches (16 tokens a sequence), and rank's `batch` rows of each global
// batch of batch x world rows (world 1: the corpus's batches themselves); `masked`: with the
// loss masks of MaskedWindows; `documents`: packed as DocumentWindows.
struct RankData {
  RankData(Allocator& allocator, const ModelConfig& config, int rank, int world, int64_t batch, bool masked = false,
           bool documents = false)
      : global(mpi_test_corpus(5000, static_cast<int32_t>(config.vocab_size)), 11), masks(global, 16),
        docs(masked ? static_cast<BatchSource&>(masks) : global, 16) {
    BatchSource& all = documents ? static_cast<BatchSource&>(docs) : masked ? static_cast<BatchSource&>(masks) : global;
    if (world > 1) slice = std::make_unique<RankSliceSource>(all, allocator, rank, world, batch, 16);
    whole = &all;
  }
  BatchSource& source() { return slice ? static_cast<BatchSource&>(*slice) : *whole; }

  RandomWindowSource global;
  MaskedWindows masks;
  DocumentWindows docs;
  BatchSource* whole = nullptr;
  std::unique_ptr<RankSliceSource> slice;
};

// The whole model of `config` (seed 7: every layout's starting point) and this rank's slice of
// it in its tensor-parallel group (the whole model again when the group has one rank).
struct SlicedModel {
  SlicedModel(Backend& backend, const ModelConfig& config, Communicator& tp, bool sequence_parallel = false)
      : whole(backend, config), local(tp.size() > 1 ? tp_local_config(config, tp.size()) : config), model(backend, local) {
    whole.init_weights(7);
    tp_copy(backend, config, whole.params(), local, model.params(), tp.rank(), tp.size(), true);
    if (tp.size() > 1) {
      const VocabRange v = tp_vocab_range(config, tp.rank(), tp.size());
      model.set_tensor_parallel(&tp, v.begin, v.valid, sequence_parallel);
    }
  }
  // The whole model's gradient from this rank's: its `ranges` of the slice's gradients (all when
  // empty: e.g. a pipeline stage's counted ranges), put back in the whole layout, summed over the
  // tp and pp groups.
  std::vector<float> whole_grads(Backend& backend, const RangeSet& ranges,
                                 Communicator& tp, Communicator& pp) {
    Tensor mine = Tensor::zeros(backend.allocator(), {model.grads().numel()}, DTYPE_F32, MEM_WORKSPACE);
    if (ranges.empty()) backend.copy(model.grads(), mine);
    for (const auto& [b, e] : ranges) backend.copy(model.grads().view(b, {e - b}), mine.view(b, {e - b}));
    whole.grads().zero_();
    tp_copy(backend, whole.config(), whole.grads(), local, mine, tp.rank(), tp.size(), false, tp.rank() == 0);
    tp.all_reduce(whole.grads());
    pp.all_reduce(whole.grads());
    const float* g = whole.grads().data<float>();
    return std::vector<float>(g, g + whole.grads().numel());
  }

  Transformer whole;
  ModelConfig local;
  Transformer model;
};

// ||got - ref|| / ||ref|| over a whole gradient (float64 sums): the gradient comparisons' measure.
inline double gradient_rel_diff(const float* got, const std::vector<float>& ref) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    diff += d * d, norm += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(diff / norm);
}

// A training run's record: per step the loss, the gradient norm and the whole gradient.
struct Curve {
  std::vector<double> losses, norms;
  std::vector<std::vector<float>> grads;  // [step]
  int64_t tp_bytes = 0;                   // (tensor-parallel runs) sent over the tp group in the first step
};

// The one-process reference: the model of `config` initialised with seed 7, trained `steps`
// steps on the test corpus with `tc`.
inline Curve train_single(const ModelConfig& config, const TrainConfig& tc, int steps, bool masked = false,
                          bool documents = false) {
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(7);
  Trainer trainer(*backend, model, tc);
  RankData data(backend->allocator(), config, 0, 1, tc.batch_size, masked, documents);
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
