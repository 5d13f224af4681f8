// Device memory without a GPU: the strict backend (tests/strict_backend.h) gives the CPU kernels
// memory that host code may not read, as a GPU's. These tests show that training, loss scaling,
// evaluation, generation and checkpoints reach a backend's tensors only through the op interface
// and Backend::read / write (so they run unchanged on the CUDA backend), that the results are
// bitwise those of the CPU backend, and that a checkpoint written from device memory is the
// same file a CPU run writes. Also: the caching allocator's bookkeeping (backend/block_cache.h)
// against a fake device, and the `device` key's errors.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "loom/backend/block_cache.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/infer/engine.h"
#include "loom/optim/optimizer.h"
#include "loom/train/config.h"
#include "loom/train/layout.h"
#include "loom/train/trainer.h"
#include "device_training.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

using test::cyclic_tokens;
using test::TrainCase;
using test::losses_and_norms;
using test::train;
using test::train_with;

TEST(DeviceMemoryTest, HostAccessToDeviceMemoryIsAOneLineError) {
  test::StrictBackend backend;
  const Tensor t = Tensor::zeros(backend.allocator(), {2, 3}, DTYPE_F32, MEM_WORKSPACE);
  EXPECT_FALSE(t.host_accessible());
  EXPECT_EQ(test::error_of([&] { (void)t.data<float>(); }),
            "host access to tensor f32(2, 3) in device memory: copy it with Backend::read / Backend::write");
  const std::vector<float> in{1, 2, 3, 4, 5, 6};
  backend.write(t, in.data());
  backend.scale_inplace(t, 2.0);
  EXPECT_EQ(test::values(backend, t), (std::vector<double>{2, 4, 6, 8, 10, 12}));
  EXPECT_EQ(test::values(backend, t.view(3, {2})), (std::vector<double>{8, 10}));  // views read their own range
}

// The losses, the gradient norms and every final weight of a run on device memory equal the CPU
// run's bit for bit: GPT-2 in fp32, Llama (GQA) with bf16 GEMMs, a kept bf16 weight copy,
// gradient accumulation and fp16-style dynamic loss scaling (unscaled through the backend); and
// the low-precision recipes, whose quantizers and bf16 rounding are backend ops: fp16 GEMMs with
// loss scaling, FP8 with delayed and current scaling, FP8 block scaling, MXFP4 / NVFP4 QAT, bf16
// master weights (nearest and stochastic rounding) with a bf16 gradient reduction.
TEST(DeviceMemoryTest, TrainingOnDeviceMemoryIsBitwiseTheCpuRun) {
  for (const TrainCase& c : test::precision_recipes()) {
    auto cpu = make_cpu_backend();
    test::StrictBackend strict;
    std::vector<double> cpu_params, strict_params;
    const std::vector<double> expected = train(*cpu, c, &cpu_params);
    const std::vector<double> got = train(strict, c, &strict_params);
    EXPECT_EQ(got, expected) << c.preset << " compute " << c.compute << " param " << c.param << " master " << c.master
                             << (c.stochastic ? " stochastic" : "") << " qat " << c.qat << " reduce " << c.reduce;
    EXPECT_EQ(strict_params, cpu_params) << c.preset;
    EXPECT_GT(strict.allocator().tracker().peak(MEM_ACTIVATIONS), 0u);  // the run's tensors lived there
  }
}

// A loss pass with its logits kept by columns (Backend::logits_by_columns, as the CUDA backend
// keeps GPT-2's odd vocabulary): the head's GEMMs transposed (W x^T, and dX, dW from d(logits)^T)
// and the loss by columns, bitwise the rows' on the CPU kernels. Every recipe trains as the CPU's
// rows run within the GEMMs' other summation order (at these sizes the same bits); where the head
// computes plainly (f32 or bf16, whatever the blocks' recipe) the run takes the path (counted).
TEST(DeviceMemoryTest, TrainingWithLogitsByColumnsMatchesTheRowsRun) {
  int engaged = 0;
  for (const TrainCase& c : test::precision_recipes()) {
    auto cpu = make_cpu_backend();
    test::StrictBackend strict;
    strict.columns_logits = true;
    std::vector<double> cpu_params, strict_params;
    const std::vector<double> expected = train(*cpu, c, &cpu_params);
    const std::vector<double> got = train(strict, c, &strict_params);
    const std::string name = std::string(c.preset) + " compute " + c.compute + " param " + c.param + " qat " + c.qat;
    const bool plain = std::string(c.qat) == "none" &&
                       (std::string(c.compute) == "bf16" || (std::string(c.compute) == "f32" && std::string(c.param) == "f32"));
    if (plain) {
      EXPECT_EQ(strict.columns_calls, 8) << name;  // 4 steps of 2 micro-batches
    }
    EXPECT_TRUE(strict.columns_calls == 0 || strict.columns_calls == 8) << name << ": " << strict.columns_calls;
    engaged += strict.columns_calls > 0;
    const double tol = std::string(c.compute) == "f32" ? 1e-5 : 1e-4;
    EXPECT_LT(test::max_rel_error(got, expected), tol) << name;
    EXPECT_LT(test::max_rel_error(strict_params, cpu_params), tol) << name;
  }
  EXPECT_GE(engaged, 3);
}

// Every optimizer's update runs through backend ops: each of the 14 trains gpt2-tiny on device
// memory bit for bit as on the CPU (the losses, the gradient norms and every final weight).
TEST(DeviceMemoryTest, EveryOptimizerTrainsOnDeviceMemoryBitwiseAsOnTheCpu) {
  EXPECT_EQ(optimizer_names().size(), 14u);
  for (const std::string& name : optimizer_names()) {
    auto cpu = make_cpu_backend();
    test::StrictBackend strict;
    std::vector<double> cpu_params, strict_params, initial;
    {
      Transformer fresh(*cpu, model_preset("gpt2-tiny"));
      fresh.init_weights(7);
      initial = test::values(*cpu, fresh.params());
    }
    const std::vector<double> expected = train_with(*cpu, name, &cpu_params);
    const std::vector<double> got = train_with(strict, name, &strict_params);
    EXPECT_EQ(got, expected) << name;
    EXPECT_TRUE(strict_params == cpu_params) << name << ": the final weights differ";
    EXPECT_NE(cpu_params, initial) << name << " did not update the weights";
    for (double x : expected) EXPECT_TRUE(std::isfinite(x)) << name;
  }
}

TEST(DeviceMemoryTest, HostOnlyFeaturesAreRefusedWithTheKeyNamed) {
  test::StrictBackend strict;
  LoomConfig config;  // a backend without the model-parallel ops is refused tp
  config.parallel.tp = 2;
  BackendCapabilities caps = strict.capabilities();
  caps.model_parallel = false;
  const std::string message =
      test::error_of([&] { check_layout(layout_facts(config, 2, caps, std::string(strict.name()))); });
  EXPECT_NE(message.find("parallel.tp = 2"), std::string::npos) << message;
  EXPECT_NE(message.find("strict"), std::string::npos) << message;
}

// Mixture of experts (routing, capacity drops, dispatch, combine, the balance losses and the
// auxiliary-loss-free bias) and MLA run behind the backend (Backend::moe_* / mla_*): their
// training on device memory is bitwise the CPU run.
TEST(DeviceMemoryTest, MoeAndMlaTrainingOnDeviceMemoryIsBitwiseTheCpuRun) {
  for (const ModelConfig& config : test::moe_and_mla_models()) {
    const TrainCase c{config.arch == ARCH_GPT2 ? "gpt2-tiny" : "llama-tiny", "f32", "f32", false, "f32", false, "none", "f32"};
    auto cpu = make_cpu_backend();
    test::StrictBackend strict;
    std::vector<double> cpu_params, strict_params;
    const std::vector<double> expected = train(*cpu, c, &cpu_params, &config);
    const std::vector<double> got = train(strict, c, &strict_params, &config);
    EXPECT_EQ(got, expected) << c.preset << ", moe_experts " << config.moe_experts << ", mla_kv_rank "
                             << config.mla_kv_rank;
    EXPECT_EQ(strict_params, cpu_params) << c.preset;
    EXPECT_GT(strict.allocator().tracker().peak(MEM_ACTIVATIONS), 0u);
  }
}

// Decoding an MLA model through the latent cache (Transformer::forward_rows, Block::mla_rows)
// on device memory gives the CPU run's logits bit for bit, so the same greedy tokens.
class VectorLatents final : public DecodeCache {
 public:
  VectorLatents(int64_t layers, int64_t rows, int64_t width)
      : width_(width), rows_(static_cast<size_t>(layers), std::vector<std::vector<float>>(static_cast<size_t>(rows))) {}
  void attend(int64_t, int64_t, const float*, const float*, const float*, float*) override {
    ADD_FAILURE() << "an MLA model decodes through latent()";
  }
  const float* latent(int64_t layer, int64_t row, const float* latent, int64_t* count) override {
    std::vector<float>& v = rows_[static_cast<size_t>(layer)][static_cast<size_t>(row)];
    v.insert(v.end(), latent, latent + width_);
    *count = static_cast<int64_t>(v.size()) / width_;
    return v.data();
  }

 private:
  int64_t width_;
  std::vector<std::vector<std::vector<float>>> rows_;
};

std::vector<float> greedy_logits(Backend& backend, const ModelConfig& config, std::vector<int32_t>* tokens) {
  Transformer model(backend, config);
  model.init_weights(5);
  const int64_t n = 2, V = config.vocab_size;
  ActivationStore s = model.allocate_rows(n);
  VectorLatents cache(config.n_layer, n, config.mla_kv_rank + config.mla_rope_dim);
  std::vector<int32_t> next{3, 7};
  std::vector<int64_t> positions{0, 0};
  std::vector<float> all, logits(static_cast<size_t>(n * V));
  for (int step = 0; step < 10; ++step) {
    model.forward_rows(s, next, positions, cache);
    backend.read(s.logits, logits.data());
    all.insert(all.end(), logits.begin(), logits.end());
    for (int64_t r = 0; r < n; ++r) {
      const auto row = logits.begin() + r * V;
      next[r] = static_cast<int32_t>(std::max_element(row, row + V) - row);
      tokens->push_back(next[r]);
      ++positions[r];
    }
  }
  return all;
}

TEST(DeviceMemoryTest, MlaDecodingOnDeviceMemoryIsBitwiseTheCpuRun) {
  ModelConfig windowed = model_preset("mla-tiny");
  windowed.attn_window = 4;
  for (const ModelConfig& config : {model_preset("mla-tiny"), windowed}) {
    auto cpu = make_cpu_backend();
    test::StrictBackend strict;
    std::vector<int32_t> cpu_tokens, strict_tokens;
    const std::vector<float> expected = greedy_logits(*cpu, config, &cpu_tokens);
    const std::vector<float> got = greedy_logits(strict, config, &strict_tokens);
    EXPECT_EQ(strict_tokens, cpu_tokens) << "window " << config.attn_window;
    EXPECT_EQ(got, expected) << "window " << config.attn_window;
    EXPECT_EQ(cpu_tokens.size(), 20u);
  }
}

// The generation engine (infer/engine.h) on device memory: the prompts written, each step's q/k/v
// rows, attention outputs and logits moved through Backend::read / write (Block::forward_rows),
// the KV cache in host memory. Every request's tokens and every logits row the sampler draws from
// equal the CPU run's bit for bit.
struct EngineRun {
  std::vector<std::vector<int32_t>> tokens;      // [request id]
  std::map<int64_t, std::vector<float>> logits;  // [request id] the rows its tokens were drawn from
  std::vector<std::string> finish;
  int64_t kv_bytes_reserved = 0;   // the cache's, after the run
  size_t kv_bytes_in_backend = 0;  // MEM_KV_CACHE in the backend's allocator, after the run
};

EngineRun run_engine(Backend& backend, const ModelConfig& config, const EngineConfig& ec) {
  Transformer model(backend, config);
  model.init_weights(9);
  GenerationEngine engine(model, ec);
  EngineRun out;
  engine.set_on_logits([&out](int64_t id, const float* logits, int64_t vocab) {
    std::vector<float>& v = out.logits[id];
    v.insert(v.end(), logits, logits + vocab);
  });
  // 5 requests (6 sequences) on 3 rows: they join and leave between steps; greedy and seeded
  // sampling (temperature, top-k, top-p); request 2 asks for 2 samples (paged: the prompt
  // prefilled once, its blocks shared); request 2 runs into the model's context.
  for (int64_t i = 0; i < 5; ++i) {
    GenerationRequest r;
    const int64_t P = 2 + (i * 3) % 7;
    for (int64_t t = 0; t < P; ++t) r.prompt.push_back(static_cast<int32_t>((t * 29 + i * 11 + 3) % config.vocab_size));
    r.max_new_tokens = 6 + (i % 3) * 2;
    r.sampling.seed = 40 + static_cast<uint64_t>(i);
    r.sampling.temperature = i % 2 == 0 ? 0.0f : 0.8f;
    r.sampling.top_k = i == 1 ? 10 : 0;
    r.sampling.top_p = i == 3 ? 0.9f : 1.0f;
    r.n = i == 2 ? 2 : 1;
    engine.submit(std::move(r));
  }
  for (const GenerationResult& g : engine.run()) {
    out.tokens.push_back(g.tokens);
    out.finish.push_back(g.finish);
  }
  out.kv_bytes_reserved = engine.cache().bytes_reserved();
  out.kv_bytes_in_backend = backend.allocator().tracker().current(MEM_KV_CACHE);
  return out;
}

// A model set for training with the bf16 flash attention (train.flash_attention, precision.attention
// = bf16: the end-of-training sample, or a checkpoint of such a run) keeps its prompt's q/k/v record
// in bf16; the engine stores the prompt's K/V rows widened from it (GenerationEngine::store_prompt),
// into the host cache (CPU) and from device memory (strict). Before, reading the record as f32 threw.
// Greedy logits: the prefill's row and every decoding step's (each reads the stored rows) must be
// the fp32 model's within bf16's rounding of the attention's inputs, up to the first token where
// the two runs part; bf16 bits read as floats, or another layer's rows, are far outside it.
struct GreedyRun {
  std::vector<std::vector<int32_t>> tokens;  // [request]
  std::vector<std::vector<float>> logits;    // [request] the rows its tokens were drawn from
};

GreedyRun greedy_engine_run(Backend& backend, const ModelConfig& config, bool bf16_flash) {
  Transformer model(backend, config);
  model.init_weights(9);
  if (bf16_flash) {
    PrecisionConfig precision;
    precision.attention = "bf16";
    model.set_flash_attention(true);
    model.set_precision(resolve_policy(precision));
  }
  EngineConfig ec;
  ec.max_batch = 2, ec.block_size = 4;
  GenerationEngine engine(model, ec);
  GreedyRun out;
  out.logits.resize(2);
  engine.set_on_logits([&out](int64_t id, const float* logits, int64_t vocab) {
    std::vector<float>& v = out.logits.at(static_cast<size_t>(id));
    v.insert(v.end(), logits, logits + vocab);
  });
  for (int64_t i = 0; i < 2; ++i) {
    GenerationRequest r;
    for (int64_t t = 0; t < 5 + 2 * i; ++t) r.prompt.push_back(static_cast<int32_t>((t * 29 + i * 11 + 3) % config.vocab_size));
    r.max_new_tokens = 6;
    r.sampling.temperature = 0.0f;
    EXPECT_EQ(engine.submit(std::move(r)), i);
  }
  for (const GenerationResult& g : engine.run()) out.tokens.push_back(g.tokens);
  return out;
}

TEST(DeviceMemoryTest, GenerationAfterABf16FlashPrefillReadsTheWidenedRecord) {
  auto cpu = make_cpu_backend();
  test::StrictBackend strict;
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig config = model_preset(preset);
    const size_t V = static_cast<size_t>(config.vocab_size);
    const GreedyRun f32 = greedy_engine_run(*cpu, config, false);
    const GreedyRun got = greedy_engine_run(*cpu, config, true);
    const GreedyRun device = greedy_engine_run(strict, config, true);
    EXPECT_EQ(device.tokens, got.tokens) << preset;
    EXPECT_EQ(device.logits, got.logits) << preset;
    ASSERT_EQ(got.tokens.size(), 2u) << preset;
    ASSERT_EQ(f32.tokens.size(), 2u) << preset;
    for (size_t r = 0; r < 2; ++r) {
      size_t same = 0;  // tokens before the runs part
      while (same < got.tokens[r].size() && same < f32.tokens[r].size() && got.tokens[r][same] == f32.tokens[r][same]) ++same;
      const size_t rows = std::min({same + 1, got.tokens[r].size(), f32.tokens[r].size()});
      ASSERT_GE(got.logits[r].size(), rows * V) << preset;
      float largest = 0.0f, worst = 0.0f;
      for (size_t i = 0; i < rows * V; ++i) {
        largest = std::max(largest, std::fabs(f32.logits[r][i]));
        worst = std::max(worst, std::fabs(got.logits[r][i] - f32.logits[r][i]));
      }
      EXPECT_GE(rows, 3u) << preset << " request " << r << ": decoding steps compared";
      EXPECT_LE(worst, 2e-2f * largest) << preset << " request " << r << ": logits against the fp32 model's";
      EXPECT_GT(worst, 0.0f) << preset << " request " << r << ": the bf16 attention rounds";
    }
  }
}

TEST(DeviceMemoryTest, GenerationOnDeviceMemoryIsBitwiseTheCpuRun) {
  struct Mode {
    const char* name;
    bool paged, chunked;
  };
  int64_t runs = 0;
  auto cpu = make_cpu_backend();
  test::StrictBackend strict;
  // Llama: GQA; MLA: the latent cache; GPT-OSS: attention sinks in kv_attention, MoE decoding.
  for (const char* preset : {"gpt2-tiny", "llama-tiny", "mla-tiny", "gpt-oss-tiny"}) {
    for (const int64_t window : {0, 3}) {
      ModelConfig config = model_preset(preset);
      config.attn_window = window;
      if (window == 0) config.window_pattern = 0;  // GPT-OSS's alternation needs a window
      for (const char* kv : {"fp32", "bf16", "int8", "int4", "kivi4", "kivi2"}) {
        for (const Mode& mode : {Mode{"paged", true, false}, Mode{"contiguous", false, false},
                                 Mode{"paged chunked", true, true}}) {
          EngineConfig ec;
          ec.max_batch = 3, ec.block_size = 4, ec.paged = mode.paged, ec.chunked_prefill = mode.chunked;
          apply_kv_preset(ec, kv, config.head_dim());
          if (ec.residual > 0) ec.residual = 3;  // KIVI: tiles quantized within the tiny context
          const EngineRun expected = run_engine(*cpu, config, ec);
          const EngineRun got = run_engine(strict, config, ec);
          const std::string what = std::string(preset) + " window " + std::to_string(window) + " kv " + kv + " " + mode.name;
          EXPECT_EQ(got.tokens, expected.tokens) << what;
          EXPECT_EQ(got.finish, expected.finish) << what;
          EXPECT_EQ(got.logits, expected.logits) << what;
          ASSERT_EQ(expected.tokens.size(), 6u) << what;
          EXPECT_EQ(expected.finish[2], "context") << what;  // 8 prompt tokens + 10 > 16 positions
          EXPECT_EQ(expected.tokens[0].size(), 6u) << what;
          EXPECT_EQ(expected.logits.at(4).size(), expected.tokens[4].size() * static_cast<size_t>(config.vocab_size)) << what;
          // On the CPU the cache is host memory in the backend's allocator. On device memory it is
          // the backend's (Backend::kv_store / kv_attention), exactly its reservation: the pool and
          // max_batch fp32 windows, allocated up front; an MLA latent cache stays host memory.
          EXPECT_EQ(expected.kv_bytes_in_backend, static_cast<size_t>(expected.kv_bytes_reserved)) << what;
          EXPECT_GT(expected.kv_bytes_reserved, 0) << what;
          if (config.mla()) {
            EXPECT_EQ(got.kv_bytes_in_backend, 0u) << what;
            EXPECT_EQ(got.kv_bytes_reserved, expected.kv_bytes_reserved) << what;
          } else {
            EXPECT_EQ(got.kv_bytes_in_backend, static_cast<size_t>(got.kv_bytes_reserved)) << what;
            EXPECT_EQ(got.kv_bytes_reserved,
                      expected.kv_bytes_reserved + ec.max_batch * kv_window_bytes(engine_cache_config(config, ec)))
                << what;
          }
          ++runs;
        }
      }
    }
  }
  EXPECT_EQ(runs, 4 * 2 * 6 * 3);
  EXPECT_GT(strict.allocator().tracker().peak(MEM_KV_CACHE), 0u);
}

// Requests whose logits nobody reads are decoded with the backend's tokens on device memory
// (Backend::argmax_rows when every row is greedy, Backend::sample_rows when one samples: the step
// reads one int a row instead of its logits), with the CPU run's tokens (the host sampler's, drawn
// from the same rule and Philox counters), a request with OpenAI's penalties among them too (its
// drawn tokens' penalties go with the step); an on_logits callback brings the logits back to the
// host.
TEST(DeviceMemoryTest, TokensAreDrawnOnTheBackendWhenNoOneReadsTheLogits) {
  enum Mix { kGreedy, kSampled, kPenalty };
  const auto run = [](Backend& backend, Mix mix, bool callback) {
    ModelConfig config = model_preset("llama-tiny");
    Transformer model(backend, config);
    model.init_weights(9);
    EngineConfig ec;
    ec.max_batch = 3, ec.block_size = 4;
    GenerationEngine engine(model, ec);
    if (callback) engine.set_on_logits([](int64_t, const float*, int64_t) {});
    for (int64_t i = 0; i < 4; ++i) {
      GenerationRequest r;
      for (int64_t t = 0; t < 3 + i; ++t) r.prompt.push_back(static_cast<int32_t>((t * 13 + i * 5 + 1) % config.vocab_size));
      r.max_new_tokens = 6;
      if (mix != kGreedy && i >= 1) r.sampling.temperature = 0.7f + 0.3f * static_cast<float>(i);
      if (i == 2) r.sampling.top_k = 20;
      if (i == 3) r.sampling.top_p = 0.8f;
      if (mix == kPenalty && i == 2) r.sampling.presence_penalty = 0.5f;
      r.sampling.seed = 5 + static_cast<uint64_t>(i);
      engine.submit(r);
    }
    std::vector<std::vector<int32_t>> tokens;
    for (const GenerationResult& g : engine.run()) tokens.push_back(g.tokens);
    return std::make_pair(tokens, engine.stats().backend_picks);
  };
  auto cpu = make_cpu_backend();
  test::StrictBackend strict;
  for (const Mix mix : {kGreedy, kSampled, kPenalty}) {
    const auto expected = run(*cpu, mix, false);
    const auto got = run(strict, mix, false);
    EXPECT_EQ(got.first, expected.first) << mix;
    EXPECT_EQ(expected.second, 0) << mix;  // a host cache: the host samples
    EXPECT_EQ(got.second, 4 * 5) << mix;   // every token after the prefill's first
  }
  EXPECT_NE(run(*cpu, kSampled, false).first, run(*cpu, kGreedy, false).first);  // the sampled mix samples
  EXPECT_NE(run(*cpu, kPenalty, false).first, run(*cpu, kSampled, false).first);  // the penalty changes tokens
  EXPECT_EQ(run(strict, kSampled, true).second, 0);  // logits wanted: read
}

// Automatic prefix caching with the cache in device memory: a prompt sharing cached blocks feeds
// its rest as a chunk (staged through the host), then decodes in backend memory; tokens and
// logits are the CPU run's bit for bit, and the second request took the cached blocks.
TEST(DeviceMemoryTest, PrefixCachingOnDeviceMemoryIsBitwiseTheCpuRun) {
  const auto run = [](Backend& backend, const ModelConfig& config, const char* kv) {
    Transformer model(backend, config);
    model.init_weights(9);
    EngineConfig ec;
    ec.max_batch = 2, ec.block_size = 4, ec.prefix_cache = true;
    apply_kv_preset(ec, kv, config.head_dim());
    GenerationEngine engine(model, ec);
    std::vector<float> logits;
    engine.set_on_logits([&](int64_t, const float* l, int64_t vocab) { logits.insert(logits.end(), l, l + vocab); });
    std::vector<int32_t> prompt;
    for (int32_t t = 0; t < 10; ++t) prompt.push_back((t * 7 + 5) % static_cast<int32_t>(config.vocab_size));
    std::vector<std::vector<int32_t>> tokens;
    int64_t cached = 0;
    for (int k = 0; k < 2; ++k) {
      GenerationRequest r;
      r.prompt = prompt;
      if (k == 1) r.prompt.insert(r.prompt.end(), {3, 1, 4});
      r.max_new_tokens = 4;
      engine.submit(r);
      for (const GenerationResult& g : engine.run()) {
        tokens.push_back(g.tokens);
        cached += g.cached_tokens;
      }
    }
    return std::make_tuple(tokens, logits, cached);
  };
  auto cpu = make_cpu_backend();
  test::StrictBackend strict;
  for (const char* kv : {"fp32", "int4"}) {
    const ModelConfig config = model_preset("llama-tiny");
    const auto expected = run(*cpu, config, kv);
    const auto got = run(strict, config, kv);
    EXPECT_EQ(std::get<0>(got), std::get<0>(expected)) << kv;
    EXPECT_EQ(std::get<1>(got), std::get<1>(expected)) << kv;
    EXPECT_EQ(std::get<2>(expected), 8) << kv;  // two full blocks of the 10-token prompt
    EXPECT_EQ(std::get<2>(got), 8) << kv;
  }
}

// The teacher-forced loss through a quantized cache (loom bench generate --ppl) on device memory
// is the CPU run's bit for bit.
TEST(DeviceMemoryTest, TeacherForcedLossOnDeviceMemoryIsBitwiseTheCpuRun) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig config = model_preset(preset);
    EngineConfig ec;
    ec.max_batch = 2, ec.block_size = 4;
    apply_kv_preset(ec, "int4", config.head_dim());
    const std::vector<int32_t> all = cyclic_tokens(36, static_cast<int32_t>(config.vocab_size));
    const std::vector<std::vector<int32_t>> sequences{{all.begin(), all.begin() + 12}, {all.begin() + 12, all.begin() + 24},
                                                      {all.begin() + 24, all.end()}};
    const auto loss = [&](Backend& backend) {
      Transformer model(backend, config);
      model.init_weights(9);
      return teacher_forced_loss(model, sequences, ec);
    };
    auto cpu = make_cpu_backend();
    test::StrictBackend strict;
    const double expected = loss(*cpu);
    EXPECT_GT(expected, 0.0) << preset;
    EXPECT_EQ(loss(strict), expected) << preset;
  }
}

// A checkpoint saved from device memory is byte for byte the CPU run's files, and loads back
// into device memory (through the backend) and into a CPU model alike.
TEST(DeviceMemoryTest, CheckpointsAreTheSameFilesFromDeviceMemory) {
  const fs::path root = fs::temp_directory_path() / ("loom_device_ckpt_" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto cpu = make_cpu_backend();
  test::StrictBackend strict;
  const ModelConfig config = model_preset("gpt2-tiny");
  std::vector<std::string> paths;
  for (Backend* b : {cpu.get(), static_cast<Backend*>(&strict)}) {
    Transformer model(*b, config);
    model.init_weights(3);
    TrainConfig tc;
    tc.batch_size = 2, tc.seq_len = 8, tc.steps = 2;
    Trainer trainer(*b, model, tc);
    RandomWindowSource data(cyclic_tokens(400, static_cast<int32_t>(config.vocab_size)), 4);
    trainer.train_step(data);
    CheckpointOptions options;
    options.backend = b;
    CheckpointManager manager((root / std::string(b->name())).string(), options);
    CheckpointContents contents;
    contents.step = 1;
    contents.model = ModelState{config, model.params()};
    contents.optimizer = OptimizerState{trainer.optimizer().name(), trainer.optimizer().state()};
    contents.optimizer_steps = trainer.optimizer().steps_taken();
    paths.push_back(manager.save(contents));

    // Loads back into fresh device-memory tensors, through the backend.
    Transformer fresh(*b, config);
    TrainConfig tc2 = tc;
    Trainer fresh_trainer(*b, fresh, tc2);
    manager.load(paths.back(), ModelState{config, fresh.params()},
                 OptimizerState{fresh_trainer.optimizer().name(), fresh_trainer.optimizer().state()});
    EXPECT_EQ(test::values(*b, fresh.params()), test::values(*b, model.params())) << b->name();
    for (size_t i = 0; i < contents.optimizer.tensors.size(); ++i) {
      EXPECT_EQ(test::values(*b, fresh_trainer.optimizer().state()[i].second),
                test::values(*b, contents.optimizer.tensors[i].second))
          << b->name() << " " << contents.optimizer.tensors[i].first;
    }
  }
  // Same files, same bytes.
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(paths[0])) names.insert(entry.path().filename().string());
  for (const std::string& name : names) {
    EXPECT_EQ(test::read_file_bytes((fs::path(paths[0]) / name).string()),
              test::read_file_bytes((fs::path(paths[1]) / name).string()))
        << name;
  }
  fs::remove_all(root);
}

// ---------------------------------------------------------------- the caching allocator

struct FakeDevice {
  size_t capacity = 0, used = 0;
  std::vector<std::pair<void*, size_t>> live;  // what the "device" handed out
  BlockCache cache{"fake device",
                   [this](size_t bytes) -> void* {
                     if (used + bytes > capacity) return nullptr;
                     used += bytes;
                     void* p = std::malloc(bytes);
                     live.emplace_back(p, bytes);
                     return p;
                   },
                   [this](void* p) {
                     for (auto it = live.begin(); it != live.end(); ++it) {
                       if (it->first == p) {
                         used -= it->second;
                         live.erase(it);
                         break;
                       }
                     }
                     std::free(p);
                   }};
};

TEST(BlockCacheTest, RoundsRequestsToGranules) {
  EXPECT_EQ(BlockCache::rounded(0), 0u);
  EXPECT_EQ(BlockCache::rounded(1), 512u);
  EXPECT_EQ(BlockCache::rounded(512), 512u);
  EXPECT_EQ(BlockCache::rounded(513), 1024u);
  EXPECT_EQ(BlockCache::rounded(size_t{1} << 20), size_t{1} << 20);
  EXPECT_EQ(BlockCache::rounded((size_t{1} << 20) + 1), size_t{2} << 20);
  EXPECT_EQ(BlockCache::rounded((size_t{5} << 20) + 3), size_t{6} << 20);
}

// A step loop that allocates the same shapes every step calls the device only in its first step.
TEST(BlockCacheTest, RepeatedStepsReuseTheirBlocks) {
  FakeDevice dev;
  dev.capacity = size_t{64} << 20;
  const std::vector<size_t> step_sizes{100, 4096, 3u << 20, 700, 4096};
  for (int step = 0; step < 5; ++step) {
    std::vector<std::pair<void*, size_t>> held;
    for (size_t s : step_sizes) held.emplace_back(dev.cache.allocate(s), s);
    for (auto& [p, s] : held) dev.cache.release(p, s);
  }
  EXPECT_EQ(dev.cache.device_allocations(), step_sizes.size());
  EXPECT_EQ(dev.cache.reserved_bytes(), dev.used);
  EXPECT_EQ(dev.cache.cached_bytes(), dev.used);  // everything released: all cached
  dev.cache.empty_cache();
  EXPECT_EQ(dev.used, 0u);
  EXPECT_EQ(dev.cache.reserved_bytes(), 0u);
}

// Out of device memory: the cache is given back and the request retried; if it still does not
// fit, one line names the device, the request and the bytes in use.
TEST(BlockCacheTest, OutOfMemoryEmptiesTheCacheThenFailsWithOneLine) {
  FakeDevice dev;
  dev.capacity = size_t{8} << 20;
  void* a = dev.cache.allocate(size_t{4} << 20);
  void* b = dev.cache.allocate(size_t{2} << 20);
  dev.cache.release(b, size_t{2} << 20);        // 2 MiB cached
  void* c = dev.cache.allocate(size_t{4} << 20);  // fits only once the cached block is returned
  EXPECT_NE(c, nullptr);
  EXPECT_EQ(dev.cache.cached_bytes(), 0u);
  EXPECT_EQ(dev.used, size_t{8} << 20);
  EXPECT_EQ(test::error_of([&] { dev.cache.allocate(1000); }),
            "fake device out of memory: allocating 1.00 KiB with 8.00 MiB in use by tensors (loom memory estimates a run "
            "before it starts)");
  dev.cache.release(a, size_t{4} << 20);
  dev.cache.release(c, size_t{4} << 20);
}

TEST(DeviceConfigTest, DeviceKeyIsValidated) {
  LoomConfig config;  // parsed into its enum at load
  EXPECT_EQ(test::error_of([&] { apply_overrides(config, "device=tpu"); }),
            "--set: key 'device' must be one of cpu | cuda, got 'tpu'");
  EXPECT_NE(test::error_of([] { make_backend("tpu"); }).find("expected \"cpu\" or \"cuda\""), std::string::npos);
  const std::string cuda = test::error_of([] { make_backend("cuda"); });
  if (!cuda_backend_built()) {
    EXPECT_NE(cuda.find("this build of Loom has no CUDA backend"), std::string::npos) << cuda;
  } else if (!cuda.empty()) {  // built, no GPU here
    EXPECT_NE(cuda.find("device = \"cuda\": no CUDA device is visible"), std::string::npos) << cuda;
  }
}

}  // namespace
}  // namespace loom
