// Loss masks (supervised fine-tuning: only the completion's tokens count): a target of
// kIgnoreTarget gives the cross-entropy ops loss 0 and a zero gradient row, and the trainer's
// loss is the mean over the step's positions that count, on every micro-batch (and rank)
// together: masked positions contribute nothing to the loss or the gradients (finite
// differences of the masked mean), and splitting the batch into micro-batches with different
// numbers of counted positions changes nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "loom/core/error.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

// Rows of a fixed batch, handed out `rows` at a time; row r's first mask[r] targets are masked.
class MaskedRows final : public BatchSource {
 public:
  MaskedRows(int64_t total_rows, int64_t T, int32_t vocab, std::vector<int64_t> masked)
      : T_(T), masked_(std::move(masked)) {
    for (int64_t r = 0; r < total_rows; ++r) {
      for (int64_t t = 0; t <= T; ++t) stream_.push_back(static_cast<int32_t>((r * 31 + t * 7 + t * t) % vocab));
    }
  }
  void fill(const Tensor& tokens, const Tensor& targets) override {
    const int64_t rows = tokens.numel() / T_;
    for (int64_t i = 0; i < rows; ++i, next_ = (next_ + 1) % static_cast<int64_t>(masked_.size())) {
      const int32_t* row = stream_.data() + next_ * (T_ + 1);
      for (int64_t t = 0; t < T_; ++t) {
        tokens.data<int32_t>()[i * T_ + t] = row[t];
        targets.data<int32_t>()[i * T_ + t] = t < masked_[static_cast<size_t>(next_)] ? kIgnoreTarget : row[t + 1];
      }
    }
  }

 private:
  int64_t T_, next_ = 0;
  std::vector<int64_t> masked_;
  std::vector<int32_t> stream_;
};

TEST(LossMask, CrossEntropyIgnoresMaskedRows) {
  auto backend = make_cpu_backend();
  Allocator& a = backend->allocator();
  const int64_t N = 6, V = 11;
  const Tensor logits = test::random_tensor(a, {N, V}, DTYPE_F32, 3);
  const Tensor targets = Tensor::empty(a, {N}, DTYPE_I32, MEM_WORKSPACE);
  for (int64_t i = 0; i < N; ++i) targets.data<int32_t>()[i] = i % 2 == 0 ? kIgnoreTarget : static_cast<int32_t>(i);
  const Tensor losses = Tensor::empty(a, {N}, DTYPE_F32, MEM_WORKSPACE), lse = Tensor::empty(a, {N}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor d = Tensor::empty(a, {N, V}, DTYPE_F32, MEM_WORKSPACE);
  backend->cross_entropy_forward(logits, targets, losses, lse);
  backend->cross_entropy_backward(logits, targets, lse, 0.5f, d);
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits.data<float>() + i * V;
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(x[v]));
    const double want = i % 2 == 0 ? 0.0 : std::log(sum) - x[i];
    EXPECT_NEAR(losses.data<float>()[i], want, 1e-5) << i;
    double row = 0;
    for (int64_t v = 0; v < V; ++v) row += std::abs(d.data<float>()[i * V + v]);
    if (i % 2 == 0) EXPECT_EQ(row, 0.0) << i;
    else EXPECT_GT(row, 0.0) << i;
  }
  targets.data<int32_t>()[1] = -1;  // another negative is still an error
  EXPECT_NE(test::error_of([&] { backend->cross_entropy_forward(logits, targets, losses, lse); }).find("target -1"),
            std::string::npos);
}

struct StepResult {
  double loss = 0;
  std::vector<float> grads;
};

// One step (the step's gradients stay in the model after its update).
StepResult step(const ModelConfig& c, int64_t batch, int64_t accum, int64_t T, const std::vector<int64_t>& masked) {
  auto backend = make_cpu_backend();
  Transformer model(*backend, c);
  model.init_weights(5);
  TrainConfig tc;
  tc.batch_size = batch, tc.seq_len = T, tc.grad_accum = accum, tc.steps = 1;
  tc.grad_clip = 0.0;
  Trainer trainer(*backend, model, tc);
  MaskedRows data(static_cast<int64_t>(masked.size()), T, static_cast<int32_t>(c.vocab_size), masked);
  StepResult r;
  r.loss = trainer.train_step(data).loss;
  r.grads.assign(model.grads().data<float>(), model.grads().data<float>() + model.grads().numel());
  return r;
}

TEST(LossMask, MaskedPositionsContributeNothingAndMicroBatchesDoNotMatter) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig c = model_preset(preset);
    const int64_t T = 12;
    const std::vector<int64_t> masked = {9, 2, 5, 11};  // rows with 3, 10, 7 and 1 counted targets
    const StepResult one = step(c, 4, 1, T, masked);
    // The loss: the mean of the counted positions' losses of a plain forward.
    auto backend = make_cpu_backend();
    Transformer model(*backend, c);
    model.init_weights(5);
    ActivationStore s = model.allocate_store(4, T);
    MaskedRows data(4, T, static_cast<int32_t>(c.vocab_size), masked);
    data.fill(s.tokens, s.targets);
    const auto masked_mean = [&] {
      model.forward(s);
      double sum = 0;
      int64_t n = 0;
      for (int64_t i = 0; i < s.targets.numel(); ++i) {
        if (s.targets.data<int32_t>()[i] == kIgnoreTarget) continue;
        sum += s.losses.data<float>()[i];
        ++n;
      }
      return sum / static_cast<double>(n);
    };
    EXPECT_NEAR(one.loss, masked_mean(), 1e-6 * one.loss) << preset;
    // The gradients: central differences of that masked mean (3 elements of every parameter).
    float* p = model.params().data<float>();
    for (const ParamSpec& spec : model.layout().params) {
      for (int64_t k = 0; k < 3; ++k) {
        const int64_t i = spec.offset + (k * 7919) % spec.numel;
        const float saved = p[i], h = 1e-2f;
        p[i] = saved + h;
        const double up = masked_mean();
        p[i] = saved - h;
        const double down = masked_mean();
        p[i] = saved;
        const double fd = (up - down) / (2.0 * h);
        EXPECT_NEAR(one.grads[static_cast<size_t>(i)], fd, 2e-3 * std::max(1.0, std::abs(fd)) + 1e-4)
            << preset << " " << spec.name;
      }
    }
    // Four micro-batches of one row each (1 to 10 counted targets apiece): the same step.
    const StepResult four = step(c, 1, 4, T, masked);
    EXPECT_NEAR(four.loss, one.loss, 1e-6 * one.loss) << preset;
    std::vector<double> a(four.grads.begin(), four.grads.end()), b(one.grads.begin(), one.grads.end());
    EXPECT_LT(test::max_rel_error(a, b), 1e-5) << preset;
  }
}

TEST(LossMask, AStepWithEveryTargetMaskedIsRefused) {
  const std::vector<int64_t> all = {12, 12};
  EXPECT_NE(test::error_of([&] { step(model_preset("gpt2-tiny"), 2, 1, 12, all); }).find("every target of the step is masked"),
            std::string::npos);
}

}  // namespace
}  // namespace loom
