// Activation checkpointing (memory/recompute.h): every policy gives bitwise the gradients of no
// recomputation; the activation bytes a store holds are exactly the estimate; the budget plan
// stays under its budget; and the plans themselves.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>

#include "loom/data/batch_source.h"
#include "loom/memory/recompute.h"
#include "loom/model/transformer.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

constexpr int64_t kBatch = 2, kSeq = 16;

ModelConfig four_layers(const char* preset) {
  ModelConfig c = model_preset(preset);
  c.n_layer = 4;
  return c;
}

struct PassResult {
  double loss = 0;
  std::vector<float> grads;
  int64_t activation_bytes = 0;  // the store and the shared record, as allocated
  double seconds = 0;            // the fastest forward + backward of three
};

PassResult run(const ModelConfig& config, const std::vector<RecomputePolicy>& plan, bool flash = false) {
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(3);
  model.set_flash_attention(flash);
  model.set_recompute(plan);
  ActivationStore store = model.allocate_store(kBatch, kSeq);
  PassResult r;
  r.activation_bytes = static_cast<int64_t>(backend->allocator().tracker().current(MEM_ACTIVATIONS));
  const Tensor tokens = test::random_tokens(backend->allocator(), {kBatch, kSeq + 1}, static_cast<int32_t>(config.vocab_size), 5);
  for (int64_t b = 0; b < kBatch; ++b) {
    std::memcpy(store.tokens.data<int32_t>() + b * kSeq, tokens.data<int32_t>() + b * (kSeq + 1), kSeq * 4);
    std::memcpy(store.targets.data<int32_t>() + b * kSeq, tokens.data<int32_t>() + b * (kSeq + 1) + 1, kSeq * 4);
  }
  r.seconds = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    model.zero_grads();
    const auto start = std::chrono::steady_clock::now();
    r.loss = model.forward(store);
    model.backward(store, 1.0f);
    r.seconds = std::min(r.seconds, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  const float* g = model.grads().data<float>();
  r.grads.assign(g, g + model.grads().numel());
  return r;
}

RecomputeCosts costs_of(const ModelConfig& c, bool flash = false) {
  RecomputeCosts costs;
  for (int64_t l = 0; l < c.n_layer; ++l) {
    std::array<int64_t, RECOMPUTE_COUNT> bytes{};
    for (int p = 0; p < RECOMPUTE_COUNT; ++p) {
      bytes[p] = block_kept_bytes(c, kBatch, kSeq, static_cast<RecomputePolicy>(p), {.flash = flash});
    }
    costs.bytes.push_back(bytes);
  }
  costs.scratch_bytes = block_kept_bytes(c, kBatch, kSeq, RECOMPUTE_NONE, {.flash = flash}) + 4 * kBatch * kSeq * c.d_model;
  costs.seconds.assign(static_cast<size_t>(c.n_layer), {0.0, 1.0, 3.0});  // unit costs: selective cheaper
  return costs;
}

TEST(RecomputeTest, EveryPolicyGivesBitwiseTheSameGradientsAndExactlyTheEstimatedBytes) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig c = four_layers(preset);
    const PassResult base = run(c, {});
    const RecomputeCosts costs = costs_of(c);
    const int64_t ends = base.activation_bytes - plan_bytes(costs, recompute_plan("none", c.n_layer));
    const int64_t budget = (plan_bytes(costs, recompute_plan("full", c.n_layer)) +
                            plan_bytes(costs, recompute_plan("none", c.n_layer))) / 2;
    const std::vector<std::pair<std::string, std::vector<RecomputePolicy>>> plans = {
        {"none", recompute_plan("none", c.n_layer)},
        {"selective", recompute_plan("selective", c.n_layer)},
        {"full", recompute_plan("full", c.n_layer)},
        {"every:2", recompute_plan("every:2", c.n_layer)},
        {"budget", budget_recompute_plan(costs, budget)}};
    for (const auto& [name, plan] : plans) {
      const PassResult r = run(c, plan);
      EXPECT_EQ(r.loss, base.loss) << preset << " " << name;
      ASSERT_EQ(r.grads.size(), base.grads.size());
      EXPECT_EQ(std::memcmp(r.grads.data(), base.grads.data(), r.grads.size() * sizeof(float)), 0) << preset << " " << name;
      EXPECT_EQ(r.activation_bytes, ends + plan_bytes(costs, plan)) << preset << " " << name;
      std::printf("%s %-9s: activation bytes %8lld (estimate %8lld; blocks %.2f of none), forward + backward %.2f x none\n",
                  preset, name.c_str(), static_cast<long long>(r.activation_bytes),
                  static_cast<long long>(ends + plan_bytes(costs, plan)),
                  static_cast<double>(r.activation_bytes - ends) / static_cast<double>(base.activation_bytes - ends),
                  r.seconds / base.seconds);
      if (name == "budget") {
        EXPECT_LE(r.activation_bytes - ends, budget);
      }
    }
  }
}

// With FlashAttention (train.flash_attention) the records keep lse instead of probs (selective:
// lse too, and the attention is not rerun): every policy still gives bitwise the losses and
// gradients of no recomputation with flash, and the store holds exactly the flash estimate.
TEST(RecomputeTest, WithFlashAttentionEveryPolicyGivesBitwiseTheSameGradientsAndTheEstimatedBytes) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig c = four_layers(preset);
    const PassResult base = run(c, {}, true);
    const RecomputeCosts costs = costs_of(c, true);
    const int64_t ends = base.activation_bytes - plan_bytes(costs, recompute_plan("none", c.n_layer));
    EXPECT_EQ(ends, run(c, {}).activation_bytes - plan_bytes(costs_of(c), recompute_plan("none", c.n_layer)));
    for (const char* name : {"none", "selective", "full", "every:2"}) {
      const std::vector<RecomputePolicy> plan = recompute_plan(name, c.n_layer);
      const PassResult r = run(c, plan, true);
      EXPECT_EQ(r.loss, base.loss) << preset << " " << name;
      ASSERT_EQ(r.grads.size(), base.grads.size());
      EXPECT_EQ(std::memcmp(r.grads.data(), base.grads.data(), r.grads.size() * sizeof(float)), 0) << preset << " " << name;
      EXPECT_EQ(r.activation_bytes, ends + plan_bytes(costs, plan)) << preset << " " << name;
      std::printf("%s flash %-9s: activation bytes %8lld (estimate %8lld), forward + backward %.2f x none\n", preset,
                  name, static_cast<long long>(r.activation_bytes), static_cast<long long>(ends + plan_bytes(costs, plan)),
                  r.seconds / base.seconds);
    }
  }
}

TEST(RecomputeTest, PlansAndTheBudgetKnapsack) {
  EXPECT_EQ(recompute_plan("every:2", 5), (std::vector<RecomputePolicy>{RECOMPUTE_FULL, RECOMPUTE_NONE, RECOMPUTE_FULL,
                                                                        RECOMPUTE_NONE, RECOMPUTE_FULL}));
  EXPECT_NE(test::error_of([] { recompute_plan("sometimes", 2); }).find("train.recompute"), std::string::npos);
  EXPECT_NE(test::error_of([] { recompute_plan("every:0", 2); }).find("every:2"), std::string::npos);
  // Three layers: none 100 B, selective 40 B at 1 s, full 10 B at 3 s; shared record 50 B.
  RecomputeCosts costs;
  costs.bytes.assign(3, {100, 40, 10});
  costs.seconds.assign(3, {0.0, 1.0, 3.0});
  costs.scratch_bytes = 50;
  EXPECT_EQ(budget_recompute_plan(costs, 300), std::vector<RecomputePolicy>(3, RECOMPUTE_NONE));  // fits as is
  // 250 B: the record takes 50, leaving 200 for the layers. Two layers none need 200 + at least
  // 10; one none and two selective take 180 B and 2 s, the least time that fits.
  const std::vector<RecomputePolicy> plan = budget_recompute_plan(costs, 250);
  EXPECT_EQ(plan_seconds(costs, plan), 2.0);
  EXPECT_LE(plan_bytes(costs, plan), 250);
  EXPECT_EQ(plan_bytes(costs, budget_recompute_plan(costs, 80)), 80);  // 50 + 3 x 10: all full
  EXPECT_NE(test::error_of([&] { budget_recompute_plan(costs, 79); }).find("train.recompute_budget_mb"), std::string::npos);
}

// Through the trainer: train.recompute = budget measures the recompute times, keeps its plan
// under the budget, and trains to bitwise the losses of no recomputation.
TEST(RecomputeTest, TrainerWithABudgetTrainsTheSameLosses) {
  const ModelConfig c = four_layers("gpt2-tiny");
  std::vector<double> losses[2];
  for (int with = 0; with < 2; ++with) {
    auto backend = make_cpu_backend();
    Transformer model(*backend, c);
    model.init_weights(1);
    TrainConfig tc;
    tc.batch_size = kBatch, tc.seq_len = kSeq, tc.steps = 3;
    if (with) {
      tc.recompute = "budget";
      tc.recompute_budget_mb = 0.2;
    }
    Trainer trainer(*backend, model, tc);
    if (with) {
      EXPECT_LE(trainer.recompute().kept_bytes, static_cast<int64_t>(0.2 * (1 << 20)));
      EXPECT_LT(trainer.recompute().kept_bytes, trainer.recompute().no_recompute_bytes);
      EXPECT_GT(trainer.recompute().seconds, 0.0);
      std::printf("budget 0.2 MiB: plan");
      for (RecomputePolicy p : trainer.recompute().plan) std::printf(" %s", std::string(recompute_name(p)).c_str());
      std::printf(", kept %lld of %lld bytes, recompute %.3f ms per micro-batch (measured)\n",
                  static_cast<long long>(trainer.recompute().kept_bytes),
                  static_cast<long long>(trainer.recompute().no_recompute_bytes), 1e3 * trainer.recompute().seconds);
    }
    std::vector<int32_t> corpus(4096);
    for (size_t i = 0; i < corpus.size(); ++i) corpus[i] = static_cast<int32_t>((i * 31 + i / 7) % c.vocab_size);
    RandomWindowSource data(std::move(corpus), 9);
    for (int s = 0; s < 3; ++s) losses[with].push_back(trainer.train_step(data).loss);
  }
  EXPECT_EQ(losses[0], losses[1]);
}

}  // namespace
}  // namespace loom
