// GRPO (train/grpo.h): the per-token objective and its derivative against central differences
// (inside and outside the clipping range, with the KL term), the group-normalised advantages,
// the exact-answer reward, the rollout rows (prompt not counted, the reference's
// log-probabilities of the policy's initial weights equal to the policy's own), and training
// that learns: a tiny Llama rewarded for completions whose first token ends in 7 (about one in
// ten at the start) raises its mean reward well above where it started.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/arch/param_layout.h"
#include "loom/core/targets.h"
#include "loom/train/grpo.h"
#include "test_util.h"

namespace loom {
namespace {

TEST(Grpo, TokenTermDerivativeMatchesCentralDifferences) {
  GrpoConfig c;
  c.beta = 0.1, c.epsilon = 0.2;
  // (advantage, logp - old): inside the range, clipped above with A > 0, clipped below with A < 0.
  for (const auto& [a, shift] : {std::pair{1.5, 0.05}, std::pair{1.5, 0.4}, std::pair{-0.7, -0.5}, std::pair{-0.7, 0.1}}) {
    const double old = -2.0, ref = -1.6, logp = old + shift, h = 1e-6;
    const TokenTerms t = grpo_token(c, a, logp, old, ref);
    const double fd = (grpo_token(c, a, logp + h, old, ref).objective - grpo_token(c, a, logp - h, old, ref).objective) / (2 * h);
    EXPECT_NEAR(t.d_logp, fd, 1e-7) << a << " " << shift;
    const double rho = std::exp(shift), x = ref - logp;
    EXPECT_NEAR(t.objective, std::min(rho * a, std::clamp(rho, 0.8, 1.2) * a) - 0.1 * (std::exp(x) - x - 1), 1e-12);
  }
  // At the sampling policy (rho = 1) and the reference: the advantage, no KL.
  const TokenTerms t = grpo_token(c, 0.75, -1.0, -1.0, -1.0);
  EXPECT_DOUBLE_EQ(t.objective, 0.75);
  EXPECT_DOUBLE_EQ(t.d_logp, 0.75);
  EXPECT_DOUBLE_EQ(t.kl, 0.0);
}

TEST(Grpo, AdvantagesAreNormalisedWithinEachGroup) {
  const std::vector<double> a = group_advantages({1, 0, 0, 0, 2, 2, 2, 2}, 4);
  const double std = std::sqrt((0.75 * 0.75 + 3 * 0.25 * 0.25) / 3);  // Bessel's correction
  EXPECT_NEAR(a[0], 0.75 / (std + 1e-4), 1e-12);
  EXPECT_NEAR(a[1], -0.25 / (std + 1e-4), 1e-12);
  for (int i = 4; i < 8; ++i) EXPECT_EQ(a[static_cast<size_t>(i)], 0.0) << "equal rewards: no signal";
  EXPECT_NE(test::error_of([] { group_advantages({1, 2, 3}, 2); }).find("groups of 2"), std::string::npos);
}

TEST(Grpo, ExactAnswerRewardReadsTheFirstInteger) {
  EXPECT_EQ(exact_answer_reward(" 63\n12 + 4", "63"), 1.0);
  EXPECT_EQ(exact_answer_reward(" 64", "63"), 0.0);
  EXPECT_EQ(exact_answer_reward("The answer is -5.", " -5 "), 1.0);
  EXPECT_EQ(exact_answer_reward("635", "63"), 0.0);
  EXPECT_EQ(exact_answer_reward("no number", "1"), 0.0);
}

// Token t decodes to the digit t % 10 and a space: the first integer of a completion is its
// first token's digit.
std::string digits(const std::vector<int32_t>& tokens) {
  std::string s;
  for (int32_t t : tokens) s += std::to_string(t % 10) + " ";
  return s;
}

std::vector<PromptExample> prompts(int n) {
  std::vector<PromptExample> p;
  for (int i = 0; i < n; ++i) p.push_back({{11 + i, 20 + 3 * i, 5}, "prompt", "7", "prompts.jsonl:" + std::to_string(i + 1)});
  return p;
}

// Groups of 8 completions of up to 3 tokens for 6 prompts (2 a step of 16 rows), the objective set.
struct GrpoRun {
  GrpoRun(Transformer& model, Trainer& trainer)
      : batches(prompts(6), model, config(), 8, 3, LOADER_ORDER_SHUFFLED, digits, {}, 0, "train"),
        objective(config(), batches) {
    trainer.set_objective(&objective);
  }
  static GrpoConfig config() {
    GrpoConfig gc;
    gc.group = 8, gc.max_new_tokens = 3;
    return gc;
  }
  GrpoBatches batches;
  GrpoObjective objective;
};

TEST(Grpo, RolloutRowsAndTrainingRaiseTheReward) {
  auto backend = make_cpu_backend();
  Transformer model(*backend, model_preset("llama-tiny"));
  model.init_weights(5);
  TrainConfig tc;
  tc.batch_size = 16, tc.seq_len = 8, tc.steps = 40, tc.grad_clip = 1.0;
  tc.schedule.warmup = 0, tc.schedule.max_lr = tc.schedule.min_lr = 1e-2;
  Trainer trainer(*backend, model, tc);
  GrpoRun run(model, trainer);
  GrpoBatches& batches = run.batches;
  // One rollout by hand: the rows, and the reference (the same weights) equal to the policy.
  CpuAllocator host;
  const Tensor tokens = Tensor::empty(host, {16, 8}, DTYPE_I32, MEM_WORKSPACE), targets = Tensor::empty(host, {16, 8}, DTYPE_I32, MEM_WORKSPACE);
  batches.fill(tokens, targets);
  const Rollout& r = batches.rollout();
  ASSERT_EQ(r.rewards.size(), 16u);
  for (int64_t row = 0; row < 16; ++row) {
    EXPECT_EQ(r.lengths[static_cast<size_t>(row)], 3);
    const int32_t* y = targets.data<int32_t>() + row * 8;
    EXPECT_EQ(y[0], kIgnoreTarget);  // the prompt's targets
    EXPECT_EQ(y[1], kIgnoreTarget);
    EXPECT_EQ(y[2], tokens.data<int32_t>()[row * 8 + 3]);  // the completion's
    EXPECT_EQ(y[4], tokens.data<int32_t>()[row * 8 + 5]);
    EXPECT_EQ(y[5], kIgnoreTarget);  // padding
    EXPECT_EQ(r.rewards[static_cast<size_t>(row)], tokens.data<int32_t>()[row * 8 + 3] % 10 == 7 ? 1.0 : 0.0);
  }
  ActivationStore store = model.allocate_store(16, 8);
  std::copy_n(tokens.data<int32_t>(), 128, store.tokens.data<int32_t>());
  std::copy_n(targets.data<int32_t>(), 128, store.targets.data<int32_t>());
  model.forward(store);
  for (int64_t i = 0; i < 128; ++i) {
    if (targets.data<int32_t>()[i] == kIgnoreTarget) continue;
    EXPECT_NEAR(r.reference[static_cast<size_t>(i)], -store.losses.data<float>()[i], 1e-6) << i;
  }
  batches.take_stats();
  // Training: the share of rewarded completions rises.
  double early = 0, late = 0;
  for (int s = 0; s < 40; ++s) {
    trainer.train_step(batches);
    const double reward = batches.take_stats().reward / 16.0;
    if (s < 5) early += reward / 5;
    if (s >= 35) late += reward / 5;
  }
  std::printf("GRPO, reward = first token ends in 7: mean reward %.3f (steps 1-5) -> %.3f (steps 36-40)\n", early, late);
  EXPECT_LT(early, 0.3);
  EXPECT_GT(late, 0.6);
}

// With LoRA the reference is the policy with its adapters off (no copy): after training steps
// have moved the adapters, a rollout's reference log-probabilities are still the base model's.
TEST(Grpo, LoraReferenceIsTheBaseWithTheAdaptersOff) {
  auto backend = make_cpu_backend();
  ModelConfig c = model_preset("llama-tiny");
  c.peft_method = PeftMethod::lora, c.lora_rank = 4, c.lora_targets = "q,k,v,o,gate,up,down";
  Transformer model(*backend, c);
  model.init_weights(5);
  Transformer base(*backend, model_preset("llama-tiny"));
  base.init_weights(5);  // the same base weights (the same offsets and streams)
  TrainConfig tc;
  tc.batch_size = 16, tc.seq_len = 8, tc.steps = 4;
  tc.schedule.warmup = 0, tc.schedule.max_lr = tc.schedule.min_lr = 5e-2;
  Trainer trainer(*backend, model, tc);
  GrpoRun run(model, trainer);
  GrpoBatches& batches = run.batches;
  EXPECT_EQ(backend->allocator().tracker().current(MEM_PARAMETERS),
            static_cast<size_t>(model.params().nbytes() + base.params().nbytes()));  // no reference copy
  for (int s = 0; s < 3; ++s) trainer.train_step(batches);
  const float* p = model.params().data<float>();
  double adapters = 0.0;
  for (int64_t i = lora_begin(c, model.layout()); i < model.layout().total; ++i) adapters += std::abs(p[i]);
  EXPECT_GT(adapters, 0.0);
  CpuAllocator host;
  const Tensor tokens = Tensor::empty(host, {16, 8}, DTYPE_I32, MEM_WORKSPACE), targets = Tensor::empty(host, {16, 8}, DTYPE_I32, MEM_WORKSPACE);
  batches.fill(tokens, targets);
  ActivationStore b = base.allocate_store(16, 8), m = model.allocate_store(16, 8);
  for (ActivationStore* st : {&b, &m}) {
    std::copy_n(tokens.data<int32_t>(), 128, st->tokens.data<int32_t>());
    std::copy_n(targets.data<int32_t>(), 128, st->targets.data<int32_t>());
  }
  base.forward(b);
  model.forward(m);
  double moved = 0.0;
  for (int64_t i = 0; i < 128; ++i) {
    if (targets.data<int32_t>()[i] == kIgnoreTarget) continue;
    EXPECT_NEAR(batches.rollout().reference[static_cast<size_t>(i)], -b.losses.data<float>()[i], 1e-6) << i;
    moved = std::max(moved, static_cast<double>(std::abs(m.losses.data<float>()[i] - b.losses.data<float>()[i])));
  }
  EXPECT_GT(moved, 1e-4) << "the adapted policy differs from the base (the test can fail)";
}

}  // namespace
}  // namespace loom
