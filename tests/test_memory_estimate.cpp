// loom memory's estimate (memory/estimate.h): the ZeRO paper's worked example exactly, and Loom's
// bytes per category against what a real model and trainer allocate after one step, for several
// (model, precision, optimizer, recompute) combinations.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "loom/data/batch_source.h"
#include "loom/memory/estimate.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

// The offload tests' tokens: 2048 of i * 7 mod vocab.
std::vector<int32_t> cyclic_corpus(int64_t vocab) {
  std::vector<int32_t> corpus(2048);
  for (size_t i = 0; i < corpus.size(); ++i) corpus[i] = static_cast<int32_t>(static_cast<int64_t>(i) * 7 % vocab);
  return corpus;
}

// Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 ranks, mixed-precision Adam (K = 12).
TEST(MemoryEstimateTest, ReproducesTheZeroPapersWorkedExample) {
  const auto z = zero_model_state_bytes(7.5e9, 64, 2, 2, 12);
  EXPECT_DOUBLE_EQ(z[0], 120e9);
  EXPECT_DOUBLE_EQ(z[1], 31.40625e9);   // 31.4 GB
  EXPECT_DOUBLE_EQ(z[2], 16.640625e9);  // 16.6 GB
  EXPECT_DOUBLE_EQ(z[3], 1.875e9);      // 1.9 GB
  // w, g, K from a run's settings: bf16 weights and reduction, fp32 master, AdamW: 2 + 2 + 12.
  MemoryPlan plan;
  plan.model = model_preset("gpt2-tiny");
  plan.optim.name = "adamw";
  plan.precision.param = "bf16", plan.precision.reduce = "bf16";
  EXPECT_EQ(zero_bytes_per_param(plan), (std::array<double, 3>{2, 2, 12}));
}

struct Combo {
  const char* preset;
  const char* optimizer;
  const char* param;      // precision.param
  const char* recompute;  // train.recompute
};

TEST(MemoryEstimateTest, MatchesWhatOneTrainingStepAllocates) {
  for (const Combo& c : {Combo{"gpt2-tiny", "adamw", "f32", "none"}, Combo{"llama-tiny", "adamw", "bf16", "none"},
                         Combo{"gpt2-tiny", "sgd", "f32", "full"}, Combo{"llama-tiny", "lion", "f32", "selective"},
                         Combo{"moe-tiny", "adamw", "f32", "none"}, Combo{"gpt2-tiny", "adafactor", "bf16", "every:2"},
                         Combo{"mla-tiny", "adamw", "bf16", "none"}}) {
    MemoryPlan plan;
    plan.model = model_preset(c.preset);
    plan.batch = 2, plan.seq_len = 16, plan.recompute = c.recompute;
    plan.optim.name = c.optimizer;
    plan.precision.param = c.param;
    const MemoryEstimate est = estimate_memory(plan);
    auto backend = make_cpu_backend();
    Transformer model(*backend, plan.model);
    model.init_weights(1);
    TrainConfig tc;
    tc.batch_size = plan.batch, tc.seq_len = plan.seq_len, tc.recompute = plan.recompute;
    tc.optim.name = plan.optim.name;
    tc.precision.param = plan.precision.param;
    Trainer trainer(*backend, model, tc);
    std::vector<int32_t> tokens(2048);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 13 % plan.model.vocab_size);
    RandomWindowSource data(std::move(tokens), 3);
    trainer.train_step(data);
    const MemoryTracker& mem = backend->allocator().tracker();
    std::printf("%-10s %-9s param %-4s recompute %-9s:", c.preset, c.optimizer, c.param, c.recompute);
    for (const MemCategory cat : {MEM_PARAMETERS, MEM_GRADIENTS, MEM_OPTIMIZER_STATE, MEM_ACTIVATIONS}) {
      const double measured = static_cast<double>(mem.peak(cat)), estimated = static_cast<double>(est.bytes[cat]);
      std::printf(" %s %.0f/%.0f", std::string(mem_category_name(cat)).c_str(), measured, estimated);
      if (estimated == 0.0) {  // (SGD keeps no state)
        EXPECT_EQ(measured, 0.0) << c.preset << " " << c.optimizer << " " << mem_category_name(cat);
      } else {
        EXPECT_NEAR(measured / estimated, 1.0, 0.10) << c.preset << " " << c.optimizer << " " << mem_category_name(cat);
      }
    }
    std::printf("\n");
  }
}

// train.flash_attention: one training step's activation bytes are exactly the estimate with
// MemoryPlan::flash_attention (lse (B,H,T) in place of probs (B,H,T,T); selective keeps lse too),
// for GPT-2 and Llama (GQA) under every checkpointing policy; without recomputation the saving
// is exactly L x 4 B H (T^2 - T) bytes.
TEST(MemoryEstimateTest, FlashAttentionActivationsAreExactlyTheEstimate) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig config = model_preset(preset);
    for (const char* policy : {"none", "selective", "full", "every:2"}) {
      MemoryPlan plan;
      plan.model = config, plan.batch = 2, plan.seq_len = 16, plan.recompute = policy, plan.flash_attention = true;
      auto backend = make_cpu_backend();
      Transformer model(*backend, config);
      model.init_weights(1);
      TrainConfig tc;
      tc.batch_size = plan.batch, tc.seq_len = plan.seq_len, tc.recompute = policy, tc.flash_attention = true;
      Trainer trainer(*backend, model, tc);
      RandomWindowSource data(cyclic_corpus(config.vocab_size), 3);
      trainer.train_step(data);
      const MemoryTracker& mem = backend->allocator().tracker();
      const int64_t estimate = estimate_memory(plan).bytes[MEM_ACTIVATIONS];
      EXPECT_EQ(static_cast<int64_t>(mem.peak(MEM_ACTIVATIONS)), estimate) << preset << " " << policy;
      EXPECT_EQ(static_cast<int64_t>(mem.current(MEM_ACTIVATIONS)), estimate) << preset << " " << policy;
      plan.flash_attention = false;
      const int64_t probs_estimate = estimate_memory(plan).bytes[MEM_ACTIVATIONS];
      const int64_t B = plan.batch, T = plan.seq_len, H = config.n_head;
      if (std::string(policy) == "none") {
        EXPECT_EQ(probs_estimate - estimate, config.n_layer * 4 * B * H * (T * T - T)) << preset;
      }
      EXPECT_LT(estimate, probs_estimate) << preset << " " << policy;
      std::printf("%-10s recompute %-9s: activations with flash %lld (estimate %lld), with probabilities %lld\n", preset,
                  policy, static_cast<long long>(mem.peak(MEM_ACTIVATIONS)), static_cast<long long>(estimate),
                  static_cast<long long>(probs_estimate));
    }
  }
}

// precision.activations = bf16 under bf16 compute: one training step's activation bytes are
// exactly the estimate, for GPT-2 and Llama under every checkpointing policy, with and without
// FlashAttention; without recomputation the saving against f32-saved activations is exactly
// L x 2 B T (C + attn_width + C + F) bytes (norm1's output, O, norm2's output and the activation
// at 2 bytes instead of 4), and with FlashAttention O stays fp32; precision.outputs = f32 adds
// L x 2 B T W (fc's output, W = F or 2F wide, kept fp32).
TEST(MemoryEstimateTest, Bf16SavedActivationsAreExactlyTheEstimate) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig config = model_preset(preset);
    for (const bool flash : {false, true}) {
      for (const char* policy : {"none", "selective", "full", "every:2"}) {
        MemoryPlan plan;
        plan.model = config, plan.batch = 2, plan.seq_len = 16, plan.recompute = policy, plan.flash_attention = flash;
        plan.precision.compute = "bf16";
        auto backend = make_cpu_backend();
        Transformer model(*backend, config);
        model.init_weights(1);
        TrainConfig tc;
        tc.batch_size = plan.batch, tc.seq_len = plan.seq_len, tc.recompute = policy, tc.flash_attention = flash;
        tc.precision.compute = "bf16";
        Trainer trainer(*backend, model, tc);
        RandomWindowSource data(cyclic_corpus(config.vocab_size), 3);
        trainer.train_step(data);
        const MemoryTracker& mem = backend->allocator().tracker();
        const int64_t estimate = estimate_memory(plan).bytes[MEM_ACTIVATIONS];
        EXPECT_EQ(static_cast<int64_t>(mem.peak(MEM_ACTIVATIONS)), estimate) << preset << " " << policy << " " << flash;
        plan.precision.activations = "f32";
        const int64_t f32_estimate = estimate_memory(plan).bytes[MEM_ACTIVATIONS];
        const int64_t B = plan.batch, T = plan.seq_len, C = config.d_model;
        const int64_t halved = C + (flash ? 0 : config.attn_width()) + C + config.d_ff;
        if (std::string(policy) == "none") {
          EXPECT_EQ(f32_estimate - estimate, config.n_layer * 2 * B * T * halved) << preset;
          plan.precision.outputs = "f32";
          EXPECT_EQ(estimate_memory(plan).bytes[MEM_ACTIVATIONS] - f32_estimate,
                    config.n_layer * 2 * B * T * config.mlp_in_width()) << preset;
        }
        EXPECT_LT(estimate, f32_estimate) << preset << " " << policy << " " << flash;
        std::printf("%-10s flash %d recompute %-9s: activations bf16-saved %lld (estimate %lld), f32-saved %lld\n", preset,
                    flash, policy, static_cast<long long>(mem.peak(MEM_ACTIVATIONS)), static_cast<long long>(estimate),
                    static_cast<long long>(f32_estimate));
      }
    }
  }
}

// Real sizes: Llama-3-8B and 70B have their published parameter counts (8.03B and 70.55B) and
// loom memory's estimate for them is the fp32 AdamW bill, 16 bytes per parameter of model state.
TEST(MemoryEstimateTest, LlamaThreeConfigsAtRealSize) {
  const char* dir = std::getenv("LOOM_SOURCE_DIR");
  const std::string root = dir != nullptr ? dir : ".";
  for (const auto& [file, published] : {std::pair{"configs/llama3_8b.toml", 8.03e9}, std::pair{"configs/llama3_70b.toml", 70.55e9}}) {
    LoomConfig config;
    apply_config_file(config, root + "/" + file);
    MemoryPlan plan;
    plan.model = config.model, plan.batch = config.train.batch_size, plan.seq_len = config.train.seq_len;
    const MemoryEstimate est = estimate_memory(plan);
    EXPECT_NEAR(static_cast<double>(est.parameters) / published, 1.0, 0.005) << file;
    EXPECT_EQ(est.bytes[MEM_PARAMETERS] + est.bytes[MEM_GRADIENTS] + est.bytes[MEM_OPTIMIZER_STATE], 16 * est.parameters);
    std::printf("%s: %.3fB parameters (published %.2fB); model states %.1f GB, activations of one 8192-token sequence "
                "%.1f GB (fp32, no recomputation)\n", file, static_cast<double>(est.parameters) / 1e9, published / 1e9,
                16.0 * static_cast<double>(est.parameters) / 1e9, static_cast<double>(est.bytes[MEM_ACTIVATIONS]) / 1e9);
  }
}

// Offload: a model whose optimizer state does not fit the device budget is refused naming the
// remedies, and trains with optim.offload (its state accounted as host memory) to bitwise the
// losses of a run without a budget; the estimate moves the state to the offloaded category.
TEST(MemoryEstimateTest, OffloadTrainsAModelWhoseOptimizerStateExceedsTheDeviceBudget) {
  const ModelConfig config = model_preset("gpt2-tiny");
  const std::vector<int32_t> corpus = cyclic_corpus(config.vocab_size);
  auto train = [&](double budget_mb, bool offload, std::vector<double>* losses, int64_t* device) {
    auto backend = make_cpu_backend();
    Transformer model(*backend, config);
    model.init_weights(2);
    TrainConfig tc;
    tc.batch_size = 2, tc.seq_len = 16, tc.steps = 3, tc.device_budget_mb = budget_mb;
    tc.optim.offload = offload;
    Trainer trainer(*backend, model, tc);
    const MemoryTracker& mem = backend->allocator().tracker();
    *device = static_cast<int64_t>(mem.current_total() - mem.current(MEM_OFFLOADED));
    EXPECT_EQ(mem.current(offload ? MEM_OPTIMIZER_STATE : MEM_OFFLOADED), 0u);
    RandomWindowSource data(corpus, 4);
    for (int s = 0; s < 3; ++s) losses->push_back(trainer.train_step(data).loss);
  };
  std::vector<double> free_losses, offload_losses, unused;
  int64_t device_all = 0, device_offloaded = 0;
  train(0.0, false, &free_losses, &device_all);
  const int64_t state = 8 * param_count(config);
  const double budget_mb = static_cast<double>(device_all - state / 2) / (1 << 20);  // the state does not fit
  const std::string error = test::error_of([&] { int64_t d = 0; train(budget_mb, false, &unused, &d); });
  EXPECT_NE(error.find("train.device_budget_mb"), std::string::npos) << error;
  EXPECT_NE(error.find("optim.offload"), std::string::npos) << error;
  train(budget_mb, true, &offload_losses, &device_offloaded);
  EXPECT_EQ(offload_losses, free_losses);
  EXPECT_EQ(device_all - device_offloaded, state);
  MemoryPlan plan;
  plan.model = config, plan.batch = 2, plan.seq_len = 16;
  plan.optim.offload = true;
  const MemoryEstimate est = estimate_memory(plan);
  EXPECT_EQ(est.bytes[MEM_OPTIMIZER_STATE], 0);
  EXPECT_EQ(est.bytes[MEM_OFFLOADED], state);
}

// ZeRO-Offload's master weights: with a bf16 weight copy for the compute, optim.offload also
// moves the fp32 master weights to host memory (the device keeps the 2-byte copy), as estimated;
// the losses are bitwise those of the run that keeps them on the device.
TEST(MemoryEstimateTest, OffloadMovesTheFp32MasterWeightsBesideTheOptimizerState) {
  const ModelConfig config = model_preset("llama-tiny");
  const std::vector<int32_t> corpus = cyclic_corpus(config.vocab_size);
  const int64_t P = param_count(config);
  std::vector<double> losses[2];
  for (const bool offload : {false, true}) {
    auto backend = make_cpu_backend();
    Transformer model(*backend, config);
    model.init_weights(2);
    TrainConfig tc;
    tc.batch_size = 2, tc.seq_len = 16, tc.steps = 3;
    tc.precision.param = "bf16";
    tc.optim.offload = offload;
    Trainer trainer(*backend, model, tc);
    RandomWindowSource data(corpus, 4);
    for (int s = 0; s < 3; ++s) losses[offload].push_back(trainer.train_step(data).loss);
    const MemoryTracker& mem = backend->allocator().tracker();
    const int64_t state = 8 * P;  // AdamW
    EXPECT_EQ(static_cast<int64_t>(mem.current(MEM_PARAMETERS)), offload ? 2 * P : 6 * P);
    EXPECT_EQ(static_cast<int64_t>(mem.current(MEM_OFFLOADED)), offload ? 4 * P + state : 0);
    MemoryPlan plan;
    plan.model = config, plan.batch = 2, plan.seq_len = 16;
    plan.precision.param = "bf16";
    plan.optim.offload = offload;
    const MemoryEstimate est = estimate_memory(plan);
    EXPECT_EQ(est.bytes[MEM_PARAMETERS], static_cast<int64_t>(mem.current(MEM_PARAMETERS)));
    EXPECT_EQ(est.bytes[MEM_OFFLOADED], static_cast<int64_t>(mem.current(MEM_OFFLOADED)));
  }
  EXPECT_EQ(losses[1], losses[0]);
}

// Activation offload: the checkpointed blocks' kept fields move to host memory (the offloaded
// category), exactly as estimated; the losses are bitwise those of the run that keeps them.
TEST(MemoryEstimateTest, ActivationOffloadMovesTheCheckpointsToHostMemory) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig config = model_preset(preset);
    const std::vector<int32_t> corpus = cyclic_corpus(config.vocab_size);
    for (const char* policy : {"full", "selective", "every:2"}) {
      std::vector<double> losses[2];
      int64_t activations[2] = {0, 0}, offloaded[2] = {0, 0};
      MemoryPlan plan;
      plan.model = config, plan.batch = 2, plan.seq_len = 16, plan.recompute = policy;
      for (const bool offload : {false, true}) {
        auto backend = make_cpu_backend();
        Transformer model(*backend, config);
        model.init_weights(2);
        TrainConfig tc;
        tc.batch_size = 2, tc.seq_len = 16, tc.steps = 3, tc.recompute = policy, tc.offload_activations = offload;
        Trainer trainer(*backend, model, tc);
        RandomWindowSource data(corpus, 4);
        for (int s = 0; s < 3; ++s) losses[offload].push_back(trainer.train_step(data).loss);
        const MemoryTracker& mem = backend->allocator().tracker();
        activations[offload] = static_cast<int64_t>(mem.current(MEM_ACTIVATIONS));
        offloaded[offload] = static_cast<int64_t>(mem.current(MEM_OFFLOADED));
        plan.offload_activations = offload;
        const MemoryEstimate est = estimate_memory(plan);
        EXPECT_EQ(est.bytes[MEM_ACTIVATIONS], activations[offload]) << preset << " " << policy << " " << offload;
        EXPECT_EQ(est.bytes[MEM_OFFLOADED], offloaded[offload]) << preset << " " << policy << " " << offload;
      }
      EXPECT_EQ(losses[1], losses[0]) << preset << " " << policy;
      EXPECT_EQ(offloaded[0], 0);
      EXPECT_GT(offloaded[1], 0);
      EXPECT_EQ(activations[0], activations[1] + offloaded[1]) << preset << " " << policy;  // moved, not added
    }
  }
  TrainConfig tc;
  tc.offload_activations = true;  // without a checkpointing policy: nothing to offload
  const std::string error = test::error_of([&] { tc.validate(); });
  EXPECT_NE(error.find("train.offload_activations"), std::string::npos) << error;
  EXPECT_NE(error.find("train.recompute"), std::string::npos) << error;
}

}  // namespace
}  // namespace loom
