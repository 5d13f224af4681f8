// Every training feature of the device-memory tests (test_device_memory.cpp, on the strict
// backend) on the CUDA backend against the CPU backend: each precision recipe, each of the 14
// optimizers, the MoE and MLA models, Qwen3-Next and GPT-OSS, and gradient accumulation with q/k
// norm. Compiled into both
// the unit tests (the nvcc build's backend: skipped without a GPU unless LOOM_REQUIRE_CUDA=1, run
// by scripts/gpu_check) and the simulator's tests (ctest cuda_sim), where every simulator check is
// armed.
//
// Tolerances, relative to the largest value of each kind (losses and gradient norms together,
// final weights), with why they are not bitwise: the GEMMs (cuBLAS's k order vs the CPU's
// blocks), the long sums (fixed trees vs OpenMP's chunks) and the exp in the softmax round
// differently in the last bits.
//  - fp32, bf16 GEMMs, bf16 weight copies: 5e-6 for fp32, 1e-4 with bf16 operands (the
//    single-process trainer test's bounds: test_cuda_sim_train.cpp).
//  - Recipes that quantize to a grid coarser than bf16 (fp16, FP8, MXFP4, NVFP4) and bf16 master
//    weights: 1e-3. A value that lands within the last bits of a rounding boundary of the grid
//    rounds to the neighbouring code on one device and not the other, which moves it by a whole
//    step of the grid (2^-3 relative for E4M3, 2^-1 for E2M1); a few such elements among each
//    GEMM's thousands of products move the losses by about 1e-4.
//  - Stochastic rounding: the same draws on both devices (Philox by element), so the same bound.
// The key part of GPT-2's attn.c_attn.bias is left out of the weights: its gradient is zero in
// exact arithmetic (softmax does not see a constant added to every score), so each device's
// rounding noise is all there is, and the rules that normalize the update (Adam's, Adagrad's,
// Lion's sign, SM3's, Adafactor's) turn that noise into steps of the learning rate's size, of
// either sign (cuda_sim_train_test.py leaves it out for the same reason).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "device_training.h"
#include "loom/arch/param_layout.h"
#include "loom/infer/engine.h"
#include "loom/infer/generate.h"
#include "loom/optim/optimizer.h"
#include "loom/train/model_source.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

// The CUDA backend where this build and machine have one (else skipped, or failed under
// LOOM_REQUIRE_CUDA=1), and it states `capability`.
std::unique_ptr<Backend> cuda_backend(bool BackendCapabilities::*capability) {
  std::string skip;
  std::unique_ptr<Backend> backend = test::op_test_backend("cuda", capability, &skip);
  if (!backend) {
    const char* require = std::getenv("LOOM_REQUIRE_CUDA");
    if (require != nullptr && std::string(require) == "1") ADD_FAILURE() << "LOOM_REQUIRE_CUDA=1 but: " << skip;
  }
  return backend;
}

// The flat weights without the key part of every GPT-2 attn.c_attn.bias (its columns [d, 2d)).
std::vector<double> without_key_bias(const ModelConfig& config, std::vector<double> params) {
  if (config.arch != ARCH_GPT2) return params;
  const ParamLayout layout = build_param_layout(config);
  std::vector<bool> drop(params.size(), false);
  for (const ParamSpec& p : layout.params) {
    if (p.name.size() < 16 || p.name.compare(p.name.size() - 16, 16, "attn.c_attn.bias") != 0) continue;
    for (int64_t i = config.d_model; i < 2 * config.d_model; ++i) drop[static_cast<size_t>(p.offset + i)] = true;
  }
  std::vector<double> kept;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!drop[i]) kept.push_back(params[i]);
  }
  return kept;
}

double recipe_tolerance(const test::TrainCase& c) {
  const std::string compute = c.compute, qat = c.qat, master = c.master;
  if (compute == "f32" && qat == "none" && master == "f32") return 5e-6;
  if (compute == "bf16" && qat == "none" && master == "f32") return 1e-4;
  return 1e-3;
}

void expect_close(const std::vector<double>& got, const std::vector<double>& expected, const std::vector<double>& got_params,
                  const std::vector<double>& expected_params, double tolerance, const std::string& name) {
  ASSERT_EQ(got.size(), expected.size()) << name;
  const double values = test::max_rel_error(got, expected), params = test::max_rel_error(got_params, expected_params);
  EXPECT_LT(values, tolerance) << name << ": losses and gradient norms";
  EXPECT_LT(params, tolerance) << name << ": final weights";
  for (double x : got) EXPECT_TRUE(std::isfinite(x)) << name;
  std::printf("[ cuda     ] %s: losses/norms within %.2e, weights within %.2e of the CPU (bound %.0e)\n", name.c_str(),
              values, params, tolerance);
}

TEST(CudaFeatures, EveryPrecisionRecipeTrainsAsOnTheCpu) {
  auto cuda = cuda_backend(&BackendCapabilities::low_precision);
  if (!cuda) GTEST_SKIP() << "no CUDA backend with the low-precision ops";
  auto cpu = make_cpu_backend();
  for (const test::TrainCase& c : test::precision_recipes()) {
    const std::string name = str_cat(c.preset, " compute ", c.compute, " param ", c.param, " master ", c.master,
                                     c.stochastic ? " stochastic" : "", " qat ", c.qat, " reduce ", c.reduce);
    std::vector<double> cpu_params, cuda_params;
    const std::vector<double> expected = test::train(*cpu, c, &cpu_params);
    const std::vector<double> got = test::train(*cuda, c, &cuda_params);
    const ModelConfig config = model_preset(c.preset);
    expect_close(got, expected, without_key_bias(config, cuda_params), without_key_bias(config, cpu_params),
                 recipe_tolerance(c), name);
  }
}

TEST(CudaFeatures, EveryOptimizerTrainsAsOnTheCpu) {
  auto cuda = cuda_backend(&BackendCapabilities::every_optimizer);
  if (!cuda) GTEST_SKIP() << "no CUDA backend with every optimizer";
  auto cpu = make_cpu_backend();
  ASSERT_EQ(optimizer_names().size(), 14u);
  for (const std::string& name : optimizer_names()) {
    std::vector<double> cpu_params, cuda_params;
    const std::vector<double> expected = test::train_with(*cpu, name, &cpu_params);
    const std::vector<double> got = test::train_with(*cuda, name, &cuda_params);
    const ModelConfig config = model_preset("gpt2-tiny");
    expect_close(got, expected, without_key_bias(config, cuda_params), without_key_bias(config, cpu_params), 5e-6, name);
  }
}

TEST(CudaFeatures, MoeAndMlaTrainAsOnTheCpu) {
  auto cuda = cuda_backend(&BackendCapabilities::mixture_of_experts);
  if (!cuda) GTEST_SKIP() << "no CUDA backend with the MoE ops";
  ASSERT_TRUE(cuda->capabilities().latent_attention) << "the MLA ops";
  auto cpu = make_cpu_backend();
  for (const ModelConfig& config : test::moe_and_mla_models()) {
    const test::TrainCase c{config.arch == ARCH_GPT2 ? "gpt2-tiny" : "llama-tiny", "f32", "f32", false, "f32", false,
                            "none", "f32"};
    const std::string name = str_cat(c.preset, " moe_experts ", config.moe_experts, " mla_kv_rank ", config.mla_kv_rank);
    std::vector<double> cpu_params, cuda_params;
    const std::vector<double> expected = test::train(*cpu, c, &cpu_params, &config);
    const std::vector<double> got = test::train(*cuda, c, &cuda_params, &config);
    expect_close(got, expected, without_key_bias(config, cuda_params), without_key_bias(config, cpu_params), 5e-6, name);
  }
}

// The 2025 families with ops of their own: Qwen3-Next (gated DeltaNet layers: the gated delta
// rule, the causal conv1d + SiLU, the gates; gated attention, partial RoPE, a gated shared
// expert) and GPT-OSS (attention sinks, clamped SwiGLU, biased MoE, alternating windows), trained
// on CUDA against the CPU. The delta rule runs its recurrent form on CUDA and the chunked one on
// the CPU here (the layer's choice): another summation order, the fp32 bound.
TEST(CudaFeatures, Qwen3NextAndGptOssTrainAsOnTheCpu) {
  auto cuda = cuda_backend(&BackendCapabilities::mixture_of_experts);
  if (!cuda) GTEST_SKIP() << "no CUDA backend with the MoE ops";
  auto cpu = make_cpu_backend();
  for (const char* preset : {"qwen3-next-tiny", "gpt-oss-tiny"}) {
    const test::TrainCase c{preset, "f32", "f32", false, "f32", false, "none", "f32"};
    std::vector<double> cpu_params, cuda_params;
    const std::vector<double> expected = test::train(*cpu, c, &cpu_params);
    const std::vector<double> got = test::train(*cuda, c, &cuda_params);
    expect_close(got, expected, cuda_params, cpu_params, 5e-6, preset);
    // Decoding: 10 greedy tokens from the same random weights (the recurrent state and the
    // conv's window carried from step to step; GPT-OSS's sinks in the device KV cache).
    std::vector<int32_t> greedy[2];
    Backend* backends[2] = {cpu.get(), cuda.get()};
    for (int i = 0; i < 2; ++i) {
      Transformer model(*backends[i], model_preset(preset));
      model.init_weights(7);
      SamplingConfig sampling;
      sampling.temperature = 0.0f;
      GenerateOptions options;
      options.max_new_tokens = 10;
      greedy[i] = generate(model, {3, 17, 41, 5, 88, 2}, sampling, options);
    }
    EXPECT_GE(greedy[0].size(), 10u) << preset;
    EXPECT_EQ(greedy[1], greedy[0]) << preset << ": greedy tokens";
  }
}

TEST(CudaFeatures, QkNormTrainsAsOnTheCpu) {
  auto cuda = cuda_backend(&BackendCapabilities::head_norm);
  if (!cuda) GTEST_SKIP() << "no CUDA backend with the q/k norm ops";
  auto cpu = make_cpu_backend();
  ModelConfig config = model_preset("llama-tiny");
  config.qk_norm = true;
  const test::TrainCase c{"llama-tiny", "f32", "f32", false, "f32", false, "none", "f32"};
  std::vector<double> cpu_params, cuda_params;
  const std::vector<double> expected = test::train(*cpu, c, &cpu_params, &config);
  const std::vector<double> got = test::train(*cuda, c, &cuda_params, &config);
  expect_close(got, expected, cuda_params, cpu_params, 5e-6, "llama-tiny qk_norm");
}

// A bf16 Hugging Face folder's linear weights used in place (train/model_source.h
// open_inference_model; Backend::bf16_weight_linear's decode kernel for up to 16 rows) on CUDA
// against the CPU: Llama's bf16 fixture (two shards), the prompt's logits within 1e-5 of the
// largest and the same 12 greedy tokens (prefill, then decoding from the device KV cache).
TEST(CudaFeatures, Bf16WeightsInPlaceDecodeAsOnTheCpu) {
  auto cuda = cuda_backend(&BackendCapabilities::kv_cache);
  if (!cuda) GTEST_SKIP() << "no CUDA backend with the KV cache ops";
  const char* fixtures = std::getenv("LOOM_FIXTURE_DIR");
  if (fixtures == nullptr) GTEST_SKIP() << "LOOM_FIXTURE_DIR is not set (tools/make_hf_fixtures.py's folders)";
  const ModelSource source = model_source(std::string(fixtures) + "/hf/llama");
  auto cpu = make_cpu_backend();
  const std::vector<int32_t> tokens = {3, 17, 41, 5, 88, 2, 60, 9, 31, 77, 12, 50, 8, 66, 1, 29, 44};
  std::vector<double> logits[2];
  std::vector<int32_t> greedy[2];
  Backend* backends[2] = {cpu.get(), cuda.get()};
  for (int i = 0; i < 2; ++i) {
    Backend& b = *backends[i];
    const std::unique_ptr<Transformer> model = open_inference_model(source, b);
    ASSERT_GT(model->bf16_weight_params(), 0) << b.name();
    const int64_t T = static_cast<int64_t>(tokens.size()) - 1;
    ActivationStore store = model->allocate_store(1, T);
    b.write(store.tokens, tokens.data());
    b.write(store.targets, tokens.data() + 1);
    model->forward(store);
    logits[i] = test::values(b, store.logits);
    SamplingConfig sampling;
    sampling.temperature = 0.0f;
    GenerateOptions options;
    options.max_new_tokens = 12;
    greedy[i] = generate(*model, std::vector<int32_t>(tokens.begin(), tokens.begin() + 5), sampling, options);
  }
  double scale = 0.0, worst = 0.0;
  for (size_t k = 0; k < logits[0].size(); ++k) {
    scale = std::max(scale, std::fabs(logits[0][k]));
    worst = std::max(worst, std::fabs(logits[0][k] - logits[1][k]));
  }
  EXPECT_LT(worst, 1e-5 * scale);
  EXPECT_EQ(greedy[1], greedy[0]);
  std::printf("bf16 weights in place on cuda: logits max diff %.2e (largest %.3f), 12 greedy tokens as on the CPU\n", worst,
              scale);
}

// Decoding steps as CUDA graphs (EngineConfig::step_graphs: Backend::begin_step_graph, one
// graph a step, updated in place while the step's shape repeats): the same tokens and logits,
// bit for bit, as the same engine without them, for Llama (GQA, RoPE) and GPT-2 (learned
// positions), an fp32 and an int8 KV cache, greedy and sampled requests joining and leaving (steps
// of 1 to 3 rows: several graphs), and with the tokens drawn on the device. Every decoding step
// ran as a graph, most by updating a kept one (the backend keeps them across engines). On the simulator a step that waited for the host
// or copied to it inside the capture would be refused (the "capture" check) and fail the test.
TEST(CudaFeatures, StepGraphsDecodeBitwiseAsWithoutThem) {
  auto cuda = cuda_backend(&BackendCapabilities::kv_cache);
  if (!cuda) GTEST_SKIP() << "no CUDA backend with the KV cache ops";
  for (const char* preset : {"llama-tiny", "gpt2-tiny"}) {
    for (const char* kv : {"fp32", "int8"}) {
      const ModelConfig config = model_preset(preset);
      Transformer model(*cuda, config);
      model.init_weights(11);
      ASSERT_TRUE(model.step_graphs());
      const auto run = [&](bool graphs, bool logits) {
        EngineConfig ec;
        ec.max_batch = 9, ec.block_size = 4, ec.step_graphs = graphs;
        apply_kv_preset(ec, kv, config.head_dim());
        GenerationEngine engine(model, ec);
        std::vector<float> seen;
        if (logits) engine.set_on_logits([&](int64_t, const float* l, int64_t v) { seen.insert(seen.end(), l, l + v); });
        for (int64_t i = 0; i < 11; ++i) {
          GenerationRequest r;
          for (int64_t t = 0; t < 2 + i % 6; ++t) r.prompt.push_back(static_cast<int32_t>((t * 7 + i * 3 + 1) % config.vocab_size));
          r.max_new_tokens = 4 + i % 5;
          r.sampling.temperature = i % 2 == 0 ? 0.0f : 0.8f;
          r.sampling.top_p = 0.9f;
          r.sampling.seed = 3 + static_cast<uint64_t>(i);
          engine.submit(r);
        }
        std::vector<std::vector<int32_t>> tokens;
        for (const GenerationResult& g : engine.run()) tokens.push_back(g.tokens);
        return std::make_tuple(tokens, seen, engine.stats());
      };
      const std::string name = std::string(preset) + ", kv " + kv;
      const auto before = cuda->step_graph_counts();
      const auto [plain_tokens, plain_logits, plain_stats] = run(false, true);
      EXPECT_EQ(plain_stats.graph_steps, 0) << name;
      const auto [tokens, logits, stats] = run(true, true);
      EXPECT_EQ(tokens, plain_tokens) << name;
      EXPECT_TRUE(logits == plain_logits) << name << ": logits differ";
      EXPECT_GT(stats.steps, 5) << name;
      EXPECT_EQ(stats.graph_steps, stats.steps) << name;  // every step decodes (each prompt is prefilled whole)
      const auto [picked, none, picked_stats] = run(true, false);  // tokens drawn on the device
      EXPECT_EQ(picked, plain_tokens) << name;
      EXPECT_GT(picked_stats.backend_picks, 0) << name;
      const auto after = cuda->step_graph_counts();
      EXPECT_EQ(after.launched - before.launched, stats.graph_steps + picked_stats.graph_steps) << name;
      EXPECT_GT(after.updated - before.updated, after.made - before.made) << name;  // most steps reuse a graph
      std::printf("step graphs, %s: %lld graph steps of %lld, %lld graphs made, %lld updated in place; tokens and "
                  "logits bitwise\n", name.c_str(), static_cast<long long>(stats.graph_steps),
                  static_cast<long long>(stats.steps), static_cast<long long>(after.made - before.made),
                  static_cast<long long>(after.updated - before.updated));
    }
  }
}

}  // namespace
}  // namespace loom
