// Trainer: memory accounting against the model's arithmetic, gradient accumulation, learning,
// and the non-finite-loss guard.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

std::vector<int32_t> repeating_tokens(int64_t n, int32_t period) {
  std::vector<int32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>((i * 7 + i / period) % period);
  return t;
}

// Parameters 4N, gradients 4N, AdamW state 8N bytes: the tracker must report exactly those
// (within the 10%), and activations must be non-zero.
TEST(TrainerTest, PeakMemoryByCategoryMatchesModelArithmetic) {
  auto backend = make_cpu_backend();
  ModelConfig config = model_preset("gpt2-tiny");
  Transformer model(*backend, config);
  model.init_weights(1);
  TrainConfig tc;
  tc.batch_size = 2, tc.seq_len = 16, tc.steps = 2;
  Trainer trainer(*backend, model, tc);
  RandomWindowSource data(repeating_tokens(500, 97), 3);
  trainer.train_step(data);
  const MemoryTracker& mem = backend->allocator().tracker();
  const double n = static_cast<double>(param_count(config));
  EXPECT_NEAR(mem.peak(MEM_PARAMETERS) / (4 * n), 1.0, 0.10);
  EXPECT_NEAR(mem.peak(MEM_GRADIENTS) / (4 * n), 1.0, 0.10);
  EXPECT_EQ(mem.peak(MEM_OPTIMIZER_STATE), static_cast<size_t>(8 * param_count(config)));  // AdamW: m and v
  EXPECT_GT(mem.peak(MEM_ACTIVATIONS), 0u);
}

// Two micro-batches of B=2 accumulate to the same gradient as one batch of B=4 with the same rows.
TEST(TrainerTest, GradientAccumulationEqualsTheLargeBatch) {
  auto backend = make_cpu_backend();
  Transformer model(*backend, model_preset("llama-tiny"));
  model.init_weights(1);
  ActivationStore big = model.allocate_store(4, 8), small = model.allocate_store(2, 8);
  const auto tokens = repeating_tokens(64, 101);
  for (int64_t i = 0; i < 32; ++i) {
    big.tokens.data<int32_t>()[i] = tokens[i];
    big.targets.data<int32_t>()[i] = tokens[i + 1];
  }
  model.zero_grads();
  model.forward(big);
  model.backward(big, 1.0f);
  std::vector<float> expected(model.grads().data<float>(), model.grads().data<float>() + model.grads().numel());
  model.zero_grads();
  for (int64_t half = 0; half < 2; ++half) {
    for (int64_t i = 0; i < 16; ++i) {
      small.tokens.data<int32_t>()[i] = tokens[half * 16 + i];
      small.targets.data<int32_t>()[i] = tokens[half * 16 + i + 1];
    }
    model.forward(small);
    model.backward(small, 0.5f);
  }
  const float* g = model.grads().data<float>();
  double err = 0, scale = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    err = std::max(err, static_cast<double>(std::abs(g[i] - expected[i])));
    scale = std::max(scale, static_cast<double>(std::abs(expected[i])));
  }
  EXPECT_LT(err / scale, 1e-5);
}

TEST(TrainerTest, LearnsARepeatingSequence) {
  auto backend = make_cpu_backend();
  Transformer model(*backend, model_preset("gpt2-tiny"));
  model.init_weights(1);
  TrainConfig tc;
  tc.batch_size = 4, tc.seq_len = 16, tc.steps = 60, tc.schedule.warmup = 5, tc.schedule.max_lr = 1e-2, tc.schedule.min_lr = 1e-3;
  Trainer trainer(*backend, model, tc);
  RandomWindowSource data(repeating_tokens(2000, 97), 3);
  const double first = trainer.train_step(data).loss;
  EXPECT_NEAR(first, std::log(97.0), 0.3);  // near-uniform predictions at init
  double last = first;
  for (int i = 1; i < tc.steps; ++i) last = trainer.train_step(data).loss;
  EXPECT_LT(last, 0.5 * first);
}

TEST(TrainerTest, NonFiniteLossStopsBeforeTheUpdate) {
  auto backend = make_cpu_backend();
  Transformer model(*backend, model_preset("gpt2-tiny"));
  model.init_weights(1);
  model.params().data<float>()[0] = std::nanf("");  // poisons token 0's embedding
  TrainConfig tc;
  tc.batch_size = 1, tc.seq_len = 16;
  Trainer trainer(*backend, model, tc);
  const float before = model.params().data<float>()[5000];
  RandomWindowSource data(std::vector<int32_t>(100, 0), 3);
  EXPECT_THROW(trainer.train_step(data), Error);
  EXPECT_EQ(model.params().data<float>()[5000], before);
  EXPECT_EQ(trainer.step(), 0);
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// GradScaler semantics in the trainer: a loss scale so large that the gradients overflow makes
// the step a no-op (parameters and optimizer state bit-identical) and halves the scale, until
// the scale fits and training proceeds; the scaled-and-unscaled gradient then equals the plain
// one (scales are powers of two), so the loss curve matches a run without scaling.
TEST(TrainerTest, LossScalingSkipsOverflowingStepsAndBacksOff) {
  ModelConfig config = model_preset("gpt2-tiny");
  auto make = [&](bool scaling, std::unique_ptr<Backend>& backend, std::unique_ptr<Transformer>& model) {
    backend = make_cpu_backend();
    model = std::make_unique<Transformer>(*backend, config);
    model->init_weights(1);
    // A final-norm gain of 1e4: finite loss, but d(wte) overflows fp32 under a scale of 2^127.
    backend->fill(model->param("ln_f.weight"), 1e4);
    TrainConfig tc;
    tc.batch_size = 2, tc.seq_len = 16, tc.steps = 40;
    tc.schedule.kind = "constant";  // skipped steps must not shift the lr of the taken ones
    tc.loss_scaling = scaling;
    tc.loss_scaler.init_scale = std::ldexp(1.0, 127);
    return std::make_unique<Trainer>(*backend, *model, tc);
  };
  std::unique_ptr<Backend> b1, b2;
  std::unique_ptr<Transformer> m1, m2;
  auto scaled = make(true, b1, m1);
  auto plain = make(false, b2, m2);
  RandomWindowSource d1(repeating_tokens(500, 97), 3), d2(repeating_tokens(500, 97), 3);
  int skipped = 0;
  Tensor tokens = Tensor::empty(b2->allocator(), {2, 16}, DTYPE_I32, MEM_WORKSPACE);
  Tensor targets = Tensor::empty(b2->allocator(), {2, 16}, DTYPE_I32, MEM_WORKSPACE);
  for (int s = 0; s < 40; ++s) {
    const std::vector<double> before = test::values(m1->params());
    const StepStats st = scaled->train_step(d1);
    if (st.skipped) {
      ++skipped;
      EXPECT_EQ(test::values(m1->params()), before) << "step " << s;  // bit-identical
      EXPECT_EQ(scaled->loss_scaler()->scale(), st.loss_scale / 2) << "backoff";
      d2.fill(tokens, targets);  // the plain run skips the same batch
      continue;
    }
    // Once the scale fits, each taken step matches the unscaled run's step on the same batch.
    const StepStats sp = plain->train_step(d2);
    EXPECT_NEAR(st.loss, sp.loss, 1e-6 * sp.loss) << "step " << s;
  }
  EXPECT_GT(skipped, 0);
  EXPECT_LT(skipped, 40);
  EXPECT_LT(scaled->loss_scaler()->scale(), std::ldexp(1.0f, 127));
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// bf16 compute (bf16 GEMM operands, fp32 accumulation, fp32 master weights) against fp32 on the
// same model and data: the first loss and every gradient agree to bf16's precision, and after
// 60 AdamW steps the training loss is within 1% of fp32's (measured: 0.2%).
TEST(TrainerTest, Bf16ComputeTracksFp32) {
  ModelConfig config = model_preset("gpt2-tiny");
  std::vector<double> loss[2], grads[2];
  for (int bf = 0; bf < 2; ++bf) {
    auto backend = make_cpu_backend();
    Transformer model(*backend, config);
    model.init_weights(1);
    TrainConfig tc;
    tc.batch_size = 8, tc.seq_len = 16, tc.steps = 60, tc.schedule.warmup = 5, tc.schedule.max_lr = 1e-2;
    tc.precision.compute = bf ? "bf16" : "f32";
    Trainer trainer(*backend, model, tc);
    EXPECT_EQ(model.precision().recipe[LINEAR_MLP_IN], bf ? RECIPE_BF16 : RECIPE_F32);
    RandomWindowSource data(repeating_tokens(3000, 97), 3);
    for (int s = 0; s < 60; ++s) {
      loss[bf].push_back(trainer.train_step(data).loss);
      if (s == 0) grads[bf] = test::values(model.grads());
    }
  }
  EXPECT_NEAR(loss[1][0], loss[0][0], 1e-3 * loss[0][0]);
  const double grad_err = test::max_rel_error(grads[1], grads[0]);
  EXPECT_LT(grad_err, 1e-2);  // measured 3e-3
  EXPECT_GT(grad_err, 1e-6);  // bf16 really ran: not bit-identical to fp32
  double tail[2] = {0, 0};
  for (int bf = 0; bf < 2; ++bf) {
    for (int s = 50; s < 60; ++s) tail[bf] += loss[bf][static_cast<size_t>(s)] / 10;
  }
  EXPECT_NEAR(tail[1], tail[0], 0.01 * tail[0]);
  EXPECT_LT(tail[0], 0.5 * loss[0][0]);  // and the model did learn
  std::printf("bf16 vs fp32: first loss %.6f vs %.6f, gradient rel error %.2e, last-10 loss %.4f vs %.4f\n", loss[1][0],
              loss[0][0], grad_err, tail[1], tail[0]);
}

}  // namespace
}  // namespace loom
