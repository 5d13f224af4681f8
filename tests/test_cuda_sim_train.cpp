// Training through the CUDA backend on the simulator (docs/cuda.md "What is verified without a
// GPU"): the trainer's losses, gradient norms and final weights against the CPU run, within the
// stated tolerances (the GEMMs and the long sums add in another order); two runs bitwise equal,
// whatever order the grid's blocks run in (the determinism docs/cuda.md promises); checkpoints
// written from device memory and loaded back into device memory and into the CPU backend.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "loom/backend/cuda/cuda_backend.h"
#include "loom/backend/cuda/sim/sim_runtime.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

using test::cyclic_tokens;

struct Case {
  const char* preset;
  const char* compute;
  const char* param;
  bool loss_scaling;
  double tolerance;  // on each loss, gradient norm and weight, relative to the largest of its kind
};

struct TrainRun {
  std::vector<double> losses, norms, params;
};

// Four steps of `config` from init seed 5 on `backend`; check(model) before the first.
template <typename Check>
TrainRun train(Backend& backend, const ModelConfig& config, const TrainConfig& tc, Check check) {
  Transformer model(backend, config);
  model.init_weights(5);
  Trainer trainer(backend, model, tc);
  check(model);
  RandomWindowSource data(cyclic_tokens(600, static_cast<int32_t>(config.vocab_size)), 11);
  TrainRun run;
  for (int s = 0; s < 4; ++s) {
    const StepStats st = trainer.train_step(data);
    run.losses.push_back(st.loss);
    run.norms.push_back(st.grad_norm);
  }
  run.params = test::values(backend, model.params());
  return run;
}

TrainRun train(Backend& backend, const Case& c) {
  TrainConfig tc;
  tc.batch_size = 2, tc.seq_len = 12, tc.steps = 4, tc.grad_accum = 2, tc.schedule.warmup = 1;
  tc.precision.compute = c.compute;
  tc.precision.param = c.param;
  tc.loss_scaling = c.loss_scaling;
  return train(backend, model_preset(c.preset), tc, [](const Transformer&) {});
}

TEST(CudaSimTraining, TheCudaBackendTrainsAsTheCpuAndIsBitwiseDeterministic) {
  auto cpu = make_cpu_backend();
  for (const Case& c : {Case{"gpt2-tiny", "f32", "f32", false, 5e-6}, Case{"llama-tiny", "bf16", "f32", false, 1e-4},
                        Case{"llama-tiny", "bf16", "bf16", true, 1e-4}}) {
    const std::string name = std::string(c.preset) + " " + c.compute + "/" + c.param;
    const TrainRun expected = train(*cpu, c);
    auto cuda = make_backend("cuda");
    sim::set_block_order_seed(1);
    const TrainRun got = train(*cuda, c);
    sim::set_block_order_seed(7);  // the grids' blocks in another order: the same bits
    const TrainRun again = train(*cuda, c);
    sim::set_block_order_seed(1);
    EXPECT_EQ(got.losses, again.losses) << name;
    EXPECT_EQ(got.norms, again.norms) << name;
    EXPECT_TRUE(got.params == again.params) << name << ": the weights differ between block orders";
    const double losses = test::max_rel_error(got.losses, expected.losses), norms = test::max_rel_error(got.norms, expected.norms),
                 params = test::max_rel_error(got.params, expected.params);
    EXPECT_LT(losses, c.tolerance) << name;
    EXPECT_LT(norms, c.tolerance) << name;
    EXPECT_LT(params, c.tolerance) << name;
    RecordProperty(name + " losses", std::to_string(losses));
    RecordProperty(name + " norms", std::to_string(norms));
    RecordProperty(name + " params", std::to_string(params));
    std::printf("%s: max relative difference to the CPU: losses %.2e, grad norms %.2e, weights %.2e\n", name.c_str(),
                losses, norms, params);
  }
}

// GPT-2's training step as the benchmark runs it (bf16 linears, flash attention in bf16 on tensor
// cores, precision.outputs = bf16: qkv written and read in bf16, dO from the output projection in
// bf16, proj's and fc2's dy rounded by the norms' backward, the GELU in fc's and fc2's GEMMs'
// cuBLASLt epilogues: the activation from fc's unrounded sum), and Llama's (qkv through RoPE on an
// fp32 staging, then rounded into the record), on models whose heads are 64 wide (the tensor-core
// kernels' size; the presets' are 8 and 16):
// against the CPU, whose bf16 flash attention rounds the same q, k, v and dO but not P and dS
// (the tensor cores' operands): the losses agree within bf16's unit roundoff u = 2^-8, the
// gradient norms and the weights after 4 steps within 4 u of the largest of their kind (P and dS
// each one more rounding of a product's operand).
// Two runs bitwise equal whatever order the blocks run in; no simulator check fires.
TEST(CudaSimTraining, TheTensorCoreAttentionTrainsAsTheCpu) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    ModelConfig config = model_preset(preset);
    config.n_head = 2, config.n_kv_head = config.arch == ARCH_GPT2 ? 2 : 1;  // heads of 64
    config.d_model = 128, config.d_ff = 256;
    TrainConfig tc;
    tc.batch_size = 2, tc.seq_len = 16, tc.schedule.warmup = 1;
    tc.precision.compute = "bf16", tc.precision.attention = "bf16";
    tc.flash_attention = true;
    const auto run = [&](Backend& backend) {
      return train(backend, config, tc, [&](const Transformer& model) {
        const LayerPlan& plan = model.layer_plans().front();
        EXPECT_TRUE(plan.qkv_bf16 && plan.attn_dy_bf16) << preset;
        EXPECT_TRUE(plan.proj_dy_bf16 && plan.fc2_dy_bf16) << preset;  // the norms' backward round dy for both
        const bool gelu = config.arch == ARCH_GPT2;  // its GELU in the GEMMs' epilogues (Llama: SwiGLU)
        EXPECT_TRUE(plan.fc_gelu == gelu && plan.fc2_dgelu == gelu) << preset;
      });
    };
    auto cpu = make_cpu_backend();
    const TrainRun expected = run(*cpu);
    auto cuda = make_backend("cuda");
    sim::set_block_order_seed(1);
    const TrainRun got = run(*cuda);
    // GPT-2: fc's forward and fc2's input gradient with cuBLASLt's GELU epilogues, each layer and step.
    EXPECT_EQ(cuda_gelu_epilogue_gemms(*cuda), config.arch == ARCH_GPT2 ? 4 * 2 * config.n_layer : 0) << preset;
    sim::set_block_order_seed(7);
    const TrainRun again = run(*cuda);
    sim::set_block_order_seed(1);
    EXPECT_EQ(got.losses, again.losses) << preset;
    EXPECT_TRUE(got.params == again.params) << preset << ": the weights differ between block orders";
    const double u = 0x1p-8;
    const double losses = test::max_rel_error(got.losses, expected.losses);
    const double norms = test::max_rel_error(got.norms, expected.norms);
    const double params = test::max_rel_error(got.params, expected.params);
    std::printf("%s, tensor-core attention: max relative difference to the CPU: losses %.2e, grad norms %.2e, "
                "weights %.2e\n", preset, losses, norms, params);
    EXPECT_LT(losses, u) << preset;
    EXPECT_LT(norms, 4 * u) << preset;
    EXPECT_LT(params, 4 * u) << preset;
    EXPECT_EQ(sim::last_report(), "") << preset;
  }
}

// No host synchronisation inside a step's forward and backward but the loss's read (docs/cuda.md
// "Expected speed"): the id checks of the embedding (forward and backward) and the cross-entropy
// are read with the next host read, in its wait (CudaBackend::claim_flag / check_pending); each
// waited for the stream on its own before (3 waits in the forward, 1 in the backward). A bad
// target is still the op's one-line error, from the loss's read; the backend stays usable.
TEST(CudaSimTraining, AStepWaitsForTheDeviceOnlyToReadItsLoss) {
  auto backend = make_backend("cuda");
  const ModelConfig config = model_preset("gpt2-tiny");
  Transformer model(*backend, config);
  model.init_weights(5);
  PrecisionConfig pc;
  pc.compute = "bf16";
  model.set_precision(resolve_policy(pc));
  ActivationStore store = model.allocate_store(2, 12);
  const std::vector<int32_t> tokens = cyclic_tokens(25, static_cast<int32_t>(config.vocab_size));
  std::vector<int32_t> targets(tokens.begin() + 1, tokens.end());
  backend->write(store.tokens, tokens.data());
  backend->write(store.targets, targets.data());
  model.zero_grads();
  const uint64_t w0 = sim::host_waits();
  const double loss = model.forward(store);
  const uint64_t w1 = sim::host_waits();
  model.backward(store, 1.0f);
  const uint64_t w2 = sim::host_waits();
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_EQ(w1 - w0, 1u) << "the forward waited " << w1 - w0 << " times";
  EXPECT_EQ(w2 - w1, 0u) << "the backward waited " << w2 - w1 << " times";
  backend->synchronize();  // (the embedding backward's check, read here)

  const int32_t bad = static_cast<int32_t>(config.vocab_size) + 3, good = targets[5];
  targets[5] = bad;
  backend->write(store.targets, targets.data());
  const std::string message = test::error_of([&] { model.forward(store); });
  EXPECT_NE(message.find(str_cat("cross_entropy_forward: target ", bad, " at row 5 outside vocab")), std::string::npos)
      << message;
  targets[5] = good;
  backend->write(store.targets, targets.data());
  EXPECT_DOUBLE_EQ(model.forward(store), loss);
}

TEST(CudaSimTraining, CheckpointsFromDeviceMemoryLoadIntoDeviceMemoryAndTheCpu) {
  const fs::path root = fs::temp_directory_path() / ("loom_cuda_sim_ckpt_" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto cuda = make_backend("cuda");
  auto cpu = make_cpu_backend();
  const ModelConfig config = model_preset("gpt2-tiny");
  Transformer model(*cuda, config);
  model.init_weights(3);
  TrainConfig tc;
  tc.batch_size = 2, tc.seq_len = 8, tc.steps = 2;
  Trainer trainer(*cuda, model, tc);
  RandomWindowSource data(cyclic_tokens(400, static_cast<int32_t>(config.vocab_size)), 4);
  trainer.train_step(data);
  CheckpointOptions options;
  options.backend = cuda.get();
  CheckpointManager manager(root.string(), options);
  CheckpointContents contents;
  contents.step = 1;
  contents.model = ModelState{config, model.params()};
  contents.optimizer = OptimizerState{trainer.optimizer().name(), trainer.optimizer().state()};
  contents.optimizer_steps = trainer.optimizer().steps_taken();
  const std::string path = manager.save(contents);
  const std::vector<double> trained = test::values(*cuda, model.params());
  for (Backend* b : {cuda.get(), cpu.get()}) {
    Transformer fresh(*b, config);
    Trainer fresh_trainer(*b, fresh, tc);
    CheckpointOptions load_options;
    load_options.backend = b;
    CheckpointManager loader(root.string(), load_options);
    loader.load(path, ModelState{config, fresh.params()},
                OptimizerState{fresh_trainer.optimizer().name(), fresh_trainer.optimizer().state()});
    EXPECT_TRUE(test::values(*b, fresh.params()) == trained) << b->name();
    for (size_t i = 0; i < contents.optimizer.tensors.size(); ++i) {
      EXPECT_TRUE(test::values(*b, fresh_trainer.optimizer().state()[i].second) ==
                  test::values(*cuda, contents.optimizer.tensors[i].second))
          << b->name() << " " << contents.optimizer.tensors[i].first;
    }
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace loom
