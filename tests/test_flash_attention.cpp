// FlashAttention-2 on the CPU (backend/cpu/cpu_flash.h): flash_attention_forward / _backward
// against the probabilities kernels (attention_forward / _backward, themselves checked against
// naive references and finite differences in test_ops.cpp), a naive log-sum-exp, and float64
// central differences; on odd shapes (T = 1, 17, 67, tiles that do not divide T), MHA, GQA and
// MQA head layouts, head dims 8 and 64, windows 0, 1, 5 and >= T.
// Tolerances, relative to the reference's scale (test_util.h max_rel_error):
//   f64: out, lse and dqkv 1e-12;  f32: out and lse 2e-6, dqkv 1e-5;  finite differences 1e-6.
// Then the model with train.flash_attention: the blocks keep lse instead of probs, train to the
// losses of the probabilities kernels (1e-5 relative), pass the model gradient check, and the
// combinations whose attention is not the block's (MLA, context parallel, pipelines) are refused.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/backend/checks.h"
#include "loom/backend/cpu/cpu_flash.h"
#include "loom/comm/communicator.h"
#include "loom/core/error.h"
#include "loom/data/batch_source.h"
#include "loom/model/transformer.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::error_of;
using test::expect_gradient_matches;
using test::max_rel_error;
using test::random_tensor;
using test::values;
using test::weighted_sum;

struct Case {
  int64_t B, T, H, KV, hd, window;
  int64_t width() const { return (H + 2 * KV) * hd; }
  std::string name() const {
    return "B " + std::to_string(B) + " T " + std::to_string(T) + " H " + std::to_string(H) + " KV " +
           std::to_string(KV) + " hd " + std::to_string(hd) + " window " + std::to_string(window);
  }
};

// T = 1, 17, 67 (the default 128 x 128 tiles: one partial tile) x hd 8, 64 x MHA, GQA, MQA x
// windows 0, 1, 5, T, T + 3.
std::vector<Case> odd_cases() {
  std::vector<Case> cases;
  for (int64_t T : {1, 17, 67}) {
    for (int64_t hd : {8, 64}) {
      for (auto [H, KV] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}, {3, 1}}) {
        for (int64_t window : {int64_t{0}, int64_t{1}, int64_t{5}, T, T + 3}) cases.push_back({2, T, H, KV, hd, window});
      }
    }
  }
  return cases;
}

struct Tolerance {
  double out, lse, dqkv;
};
Tolerance tolerance(DType dtype) { return dtype == DTYPE_F64 ? Tolerance{1e-12, 1e-12, 1e-12} : Tolerance{2e-6, 2e-6, 1e-5}; }

// lse[b, h, i] = log sum_j exp(scale q_i . k_j) over the keys i - W < j <= i (W = 0: j <= i),
// in double from the tensor's values, the largest score subtracted first.
std::vector<double> naive_lse(const std::vector<double>& qkv, const Case& c) {
  const int64_t W = c.width(), window = c.window >= c.T ? 0 : c.window;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.hd));
  std::vector<double> lse(static_cast<size_t>(c.B * c.H * c.T));
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.H; ++h) {
      const int64_t g = h / (c.H / c.KV);
      for (int64_t i = 0; i < c.T; ++i) {
        const int64_t first = window > 0 ? std::max<int64_t>(0, i - window + 1) : 0;
        std::vector<double> s;
        for (int64_t j = first; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < c.hd; ++d) {
            dot += qkv[(b * c.T + i) * W + h * c.hd + d] * qkv[(b * c.T + j) * W + (c.H + g) * c.hd + d];
          }
          s.push_back(dot * scale);
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (double x : s) sum += std::exp(x - mx);
        lse[(b * c.H + h) * c.T + i] = mx + std::log(sum);
      }
    }
  }
  return lse;
}

class FlashAttentionTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend = make_cpu_backend();
  Allocator& alloc = backend->allocator();
  Tensor random(Shape shape, DType dtype, uint64_t seed, double scale = 1.0) {
    return random_tensor(alloc, std::move(shape), dtype, seed, scale);
  }
  Tensor empty(Shape shape, DType dtype) { return Tensor::empty(alloc, std::move(shape), dtype, MEM_WORKSPACE); }

  // One case's inputs (qkv scaled by 2 so the softmax is far from uniform) and both kernels'
  // results. dqkv starts as noise: the backward must overwrite every element.
  struct Run {
    Tensor qkv, dout;
    Tensor out, probs, dqkv;              // attention_forward / _backward
    Tensor flash_out, lse, flash_dqkv;    // flash_attention_forward / _backward
  };
  Run run(const Case& c, DType dtype) {
    Run r;
    r.qkv = random({c.B, c.T, c.width()}, dtype, 1, 2.0);
    r.dout = random({c.B, c.T, c.H * c.hd}, dtype, 2);
    r.out = empty({c.B, c.T, c.H * c.hd}, dtype), r.probs = empty({c.B, c.H, c.T, c.T}, dtype);
    r.dqkv = random({c.B, c.T, c.width()}, dtype, 3);
    r.flash_out = empty({c.B, c.T, c.H * c.hd}, dtype), r.lse = empty({c.B, c.H, c.T}, dtype);
    r.flash_dqkv = random({c.B, c.T, c.width()}, dtype, 4);
    backend->attention_forward(r.qkv, r.out, r.probs, c.H, c.KV, c.window);
    backend->attention_backward(r.dout, r.qkv, r.out, r.probs, r.dqkv, c.H, c.KV, c.window);
    backend->flash_attention_forward(r.qkv, r.flash_out, r.lse, c.H, c.KV, c.window);
    backend->flash_attention_backward(r.dout, r.qkv, r.flash_out, r.lse, r.flash_dqkv, c.H, c.KV, c.window);
    return r;
  }
};

TEST_F(FlashAttentionTest, ForwardOutEqualsProbsKernelsOut) {
  for (DType dtype : {DTYPE_F64, DTYPE_F32}) {
    for (const Case& c : odd_cases()) {
      const Run r = run(c, dtype);
      EXPECT_LT(max_rel_error(values(r.flash_out), values(r.out)), tolerance(dtype).out)
          << dtype_name(dtype) << " " << c.name();
    }
  }
}

TEST_F(FlashAttentionTest, ForwardLseIsLogSumExpOfTheRowsScaledScores) {
  for (DType dtype : {DTYPE_F64, DTYPE_F32}) {
    for (const Case& c : odd_cases()) {
      const Run r = run(c, dtype);
      EXPECT_LT(max_rel_error(values(r.lse), naive_lse(values(r.qkv), c)), tolerance(dtype).lse)
          << dtype_name(dtype) << " " << c.name();
    }
  }
}

TEST_F(FlashAttentionTest, BackwardOverwritesDqkvWithProbsKernelsGradient) {
  for (DType dtype : {DTYPE_F64, DTYPE_F32}) {
    for (const Case& c : odd_cases()) {
      const Run r = run(c, dtype);
      EXPECT_LT(max_rel_error(values(r.flash_dqkv), values(r.dqkv)), tolerance(dtype).dqkv)
          << dtype_name(dtype) << " " << c.name();
    }
  }
}

// The kernels called with tiles far smaller than T: many key tiles per query row (the online
// softmax rescales O and l across them), partial tiles at both ends, windows that start inside
// a tile and rows that see none of a tile's keys.
TEST_F(FlashAttentionTest, SmallTilesMatchProbsKernels) {
  const int threads = omp_get_max_threads();
  for (DType dtype : {DTYPE_F64, DTYPE_F32}) {
    for (const cpu::FlashTiles tiles : {cpu::FlashTiles{1, 1}, {5, 3}, {4, 16}, {16, 7}}) {
      for (int64_t window : {0, 1, 5, 20}) {
        const Case c{2, 45, 6, 2, 8, window};
        const Run r = run(c, dtype);
        Tensor out = empty({c.B, c.T, c.H * c.hd}, dtype), lse = empty({c.B, c.H, c.T}, dtype);
        Tensor dqkv = random({c.B, c.T, c.width()}, dtype, 5);
        const int64_t per = std::max(cpu::flash_forward_scratch(tiles, c.hd), cpu::flash_backward_scratch(tiles));
        Tensor scratch = empty({threads * per}, dtype);
        auto call = [&]<typename T>() {
          cpu::flash_attention_forward(r.qkv.data<T>(), out.data<T>(), lse.data<T>(), scratch.data<T>(), threads, c.B,
                                       c.T, c.H, c.KV, c.hd, c.window, tiles);
          cpu::flash_attention_backward(r.dout.data<T>(), r.qkv.data<T>(), out.data<T>(), lse.data<T>(),
                                        dqkv.data<T>(), scratch.data<T>(), threads, c.B, c.T, c.H, c.KV, c.hd,
                                        c.window, tiles);
        };
        if (dtype == DTYPE_F64) call.operator()<double>();
        else call.operator()<float>();
        const std::string what = std::string(dtype_name(dtype)) + " tiles " + std::to_string(tiles.rows) + "x" +
                                 std::to_string(tiles.cols) + " " + c.name();
        EXPECT_LT(max_rel_error(values(out), values(r.out)), tolerance(dtype).out) << what;
        EXPECT_LT(max_rel_error(values(lse), naive_lse(values(r.qkv), c)), tolerance(dtype).lse) << what;
        EXPECT_LT(max_rel_error(values(dqkv), values(r.dqkv)), tolerance(dtype).dqkv) << what;
      }
    }
  }
}

// d/d(qkv) of sum(out o weights) by float64 central differences, through the forward alone.
TEST_F(FlashAttentionTest, BackwardMatchesFiniteDifferences) {
  for (const Case& c : {Case{2, 17, 3, 3, 4, 0}, Case{2, 17, 4, 2, 4, 5}, Case{1, 17, 3, 1, 4, 1}}) {
    Tensor qkv = random({c.B, c.T, c.width()}, DTYPE_F64, 1, 1.5), weights = random({c.B, c.T, c.H * c.hd}, DTYPE_F64, 2);
    Tensor out = empty({c.B, c.T, c.H * c.hd}, DTYPE_F64), lse = empty({c.B, c.H, c.T}, DTYPE_F64);
    Tensor dqkv = empty({c.B, c.T, c.width()}, DTYPE_F64);
    backend->flash_attention_forward(qkv, out, lse, c.H, c.KV, c.window);
    backend->flash_attention_backward(weights, qkv, out, lse, dqkv, c.H, c.KV, c.window);
    auto loss = [&] {
      backend->flash_attention_forward(qkv, out, lse, c.H, c.KV, c.window);
      return weighted_sum(out, weights);
    };
    SCOPED_TRACE(c.name());
    expect_gradient_matches(qkv, values(dqkv), loss, 1e-6, "dqkv");
  }
}

// As attention_forward: a window that covers the whole sequence is full causal attention.
TEST_F(FlashAttentionTest, WindowOfSeqLenOrMoreEqualsFullCausalBitwise) {
  const int64_t T = 67;
  auto results = [&](int64_t window) {
    const Run r = run({2, T, 6, 2, 8, window}, DTYPE_F32);
    return std::vector<std::vector<double>>{values(r.flash_out), values(r.lse), values(r.flash_dqkv)};
  };
  const auto full = results(0);
  EXPECT_EQ(results(T), full);
  EXPECT_EQ(results(T + 5), full);
  EXPECT_NE(results(T - 1), full);
}

// Tasks own disjoint outputs and sum in a fixed order: one thread gives the bits of many.
TEST_F(FlashAttentionTest, ResultsAreBitwiseIndependentOfTheThreadCount) {
  const Case c{3, 67, 6, 2, 64, 0};
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Run one = run(c, DTYPE_F32);
  omp_set_num_threads(threads);
  const Run many = run(c, DTYPE_F32);
  EXPECT_EQ(values(one.flash_out), values(many.flash_out));
  EXPECT_EQ(values(one.lse), values(many.lse));
  EXPECT_EQ(values(one.flash_dqkv), values(many.flash_dqkv));
  // attention_forward / _backward (one task per batch and head, GEMMs inside the task) as well.
  EXPECT_EQ(values(one.out), values(many.out));
  EXPECT_EQ(values(one.probs), values(many.probs));
  EXPECT_EQ(values(one.dqkv), values(many.dqkv));
}

// The same at a training shape (T = 256, hd = 64, GPT-2 small's heads), where oneDNN's sgemm picks
// its blocked kernels: one thread gives the bits of many.
TEST_F(FlashAttentionTest, FullAttentionAtTrainingShapeIsBitwiseIndependentOfTheThreadCount) {
  const Case c{2, 256, 6, 6, 64, 0};
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Run one = run(c, DTYPE_F32);
  omp_set_num_threads(std::max(threads, 3));  // 3: an odd split of the 12 tasks as well
  const Run many = run(c, DTYPE_F32);
  omp_set_num_threads(threads);
  EXPECT_EQ(values(one.out), values(many.out));
  EXPECT_EQ(values(one.dqkv), values(many.dqkv));
}

// Bad operands fail with check_attention's (or check_attention_backward's) one-line message.
TEST_F(FlashAttentionTest, RejectsBadShapesWithTheChecksMessage) {
  const int64_t B = 2, T = 5, H = 4, KV = 2, hd = 8, W = (H + 2 * KV) * hd;
  const DType f32 = DTYPE_F32;
  Tensor qkv = random({B, T, W}, f32, 1), out = empty({B, T, H * hd}, f32), lse = empty({B, H, T}, f32);
  Tensor dout = random({B, T, H * hd}, f32, 2), dqkv = empty({B, T, W}, f32);
  backend->flash_attention_forward(qkv, out, lse, H, KV, 0);  // the good call
  auto expect_rejected = [&](const std::function<void()>& call, const std::function<void()>& check,
                             const std::string& fragment) {
    const std::string message = error_of(call);
    EXPECT_FALSE(message.empty()) << fragment;
    EXPECT_EQ(message, error_of(check));
    EXPECT_NE(message.find(fragment), std::string::npos) << message;
  };
  const char* fwd = "flash_attention_forward";
  const char* bwd = "flash_attention_backward";
  Tensor probs_sized = empty({B, H, T, T}, f32), lse64 = empty({B, H, T}, DTYPE_F64);
  expect_rejected([&] { backend->flash_attention_forward(qkv, out, probs_sized, H, KV, 0); },
                  [&] { checks::check_attention(fwd, qkv, out, probs_sized, H, KV, 0, true); },
                  "flash_attention_forward: lse (B, H, T) is");
  expect_rejected([&] { backend->flash_attention_forward(qkv, out, lse64, H, KV, 0); },
                  [&] { checks::check_attention(fwd, qkv, out, lse64, H, KV, 0, true); }, "expected dtype f32");
  expect_rejected([&] { backend->flash_attention_forward(qkv, out, lse, 3, KV, 0); },
                  [&] { checks::check_attention(fwd, qkv, out, lse, 3, KV, 0, true); }, "must be a multiple of n_kv_head");
  Tensor odd_qkv = random({B, T, W + 1}, f32, 3);
  expect_rejected([&] { backend->flash_attention_forward(odd_qkv, out, lse, H, KV, 0); },
                  [&] { checks::check_attention(fwd, odd_qkv, out, lse, H, KV, 0, true); }, "qkv must be");
  expect_rejected([&] { backend->flash_attention_forward(qkv, out, lse, H, KV, -1); },
                  [&] { checks::check_attention(fwd, qkv, out, lse, H, KV, -1, true); }, "window must be >= 0");
  expect_rejected([&] { backend->flash_attention_backward(dout, qkv, out, probs_sized, dqkv, H, KV, 0); },
                  [&] { checks::check_attention(bwd, qkv, out, probs_sized, H, KV, 0, true); },
                  "flash_attention_backward: lse (B, H, T) is");
  Tensor short_dout = random({B, T - 1, H * hd}, f32, 4);
  expect_rejected([&] { backend->flash_attention_backward(short_dout, qkv, out, lse, dqkv, H, KV, 0); },
                  [&] { checks::check_attention_backward(bwd, short_dout, qkv, out, lse, dqkv, H, KV, 0, true); },
                  "flash_attention_backward: dout");
  Tensor dqkv64 = empty({B, T, W}, DTYPE_F64);
  expect_rejected([&] { backend->flash_attention_backward(dout, qkv, out, lse, dqkv64, H, KV, 0); },
                  [&] { checks::check_attention_backward(bwd, dout, qkv, out, lse, dqkv64, H, KV, 0, true); },
                  "flash_attention_backward: dqkv");
}

// ---------------------------------------------------------------- the model with flash attention

// The losses of `steps` AdamW steps of a preset on a cyclic corpus, with or without flash.
std::vector<double> train_losses(const ModelConfig& config, bool flash, int steps) {
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(11);
  TrainConfig tc;
  tc.batch_size = 2, tc.seq_len = 16, tc.steps = steps, tc.flash_attention = flash;
  Trainer trainer(*backend, model, tc);
  EXPECT_EQ(model.flash_attention(), flash);
  std::vector<int32_t> corpus(2048);
  for (size_t i = 0; i < corpus.size(); ++i) corpus[i] = static_cast<int32_t>((i * 31 + i / 5) % config.vocab_size);
  RandomWindowSource data(std::move(corpus), 3);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) losses.push_back(trainer.train_step(data).loss);
  return losses;
}

ModelConfig llama_with_window() {
  ModelConfig c = model_preset("llama-tiny");
  c.attn_window = 5;
  return c;
}

TEST(FlashAttentionModelTest, TrainsToTheLossesOfTheProbabilitiesKernels) {
  for (const auto& [name, config] : {std::pair{"gpt2-tiny", model_preset("gpt2-tiny")},
                                     std::pair{"llama-tiny (GQA)", model_preset("llama-tiny")},
                                     std::pair{"llama-tiny window 5", llama_with_window()}}) {
    const std::vector<double> probs = train_losses(config, false, 5), flash = train_losses(config, true, 5);
    ASSERT_EQ(flash.size(), probs.size());
    double worst = 0.0;
    for (size_t s = 0; s < probs.size(); ++s) {
      EXPECT_NEAR(flash[s], probs[s], 1e-5 * std::abs(probs[s])) << name << " step " << s;
      worst = std::max(worst, std::abs(flash[s] - probs[s]) / std::abs(probs[s]));
    }
    std::printf("%s: %zu steps, losses %.6f .. %.6f, largest |flash - probs| / probs %.2e\n", name, probs.size(),
                probs.front(), probs.back(), worst);
  }
}

TEST(FlashAttentionModelTest, StoresKeepTheLogSumExpInsteadOfProbabilities) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    auto backend = make_cpu_backend();
    const ModelConfig config = model_preset(preset);
    Transformer model(*backend, config);
    model.set_flash_attention(true);
    const ActivationStore store = model.allocate_store(2, 9);
    for (const BlockSaved& s : store.blocks) {
      EXPECT_FALSE(s.attention.probs.defined()) << preset;
      ASSERT_TRUE(s.attention.lse.defined()) << preset;
      EXPECT_EQ(s.attention.lse.shape(), (Shape{2, config.n_head, 9})) << preset;
    }
    EXPECT_NE(test::error_of([&] { model.set_flash_attention(false); }).find("before the activation stores"),
              std::string::npos);
  }
}

// The model gradients with flash against finite differences: TransformerTest.GradientsMatchFiniteDifferencesOfTheLoss
// (test_model.cpp) runs with and without it.

// MLA and context parallelism compute their own attention, and pipeline stores are allocated
// before the trainer could choose: refused at load with one line naming the key.
TEST(FlashAttentionModelTest, RefusesCombinationsWhoseAttentionIsNotTheBlocks) {
  auto config_error = [](const std::string& sets) {
    LoomConfig c;
    c.model = model_preset("llama-tiny");
    c.train.seq_len = 16;
    apply_overrides(c, "train.flash_attention=true," + sets);
    return test::error_of([&] { c.validate(); });
  };
  EXPECT_EQ(config_error(""), "");
  for (const auto& [sets, key] : {std::pair{"parallel.cp=2", "parallel.cp"}, std::pair{"parallel.pp=2", "parallel.pp"},
                                  std::pair{"model.mla_kv_rank=16,model.n_kv_head=6,model.mla_rope_dim=4,model.mla_nope_dim=8,model.mla_v_dim=8",
                                            "model.mla_kv_rank"}}) {
    const std::string error = config_error(sets);
    EXPECT_NE(error.find("train.flash_attention"), std::string::npos) << sets << ": " << error;
    EXPECT_NE(error.find(key), std::string::npos) << sets << ": " << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  }
  // The same at the model, whichever is set first.
  auto backend = make_cpu_backend();
  Transformer mla(*backend, model_preset("mla-tiny"));
  EXPECT_NE(test::error_of([&] { mla.set_flash_attention(true); }).find("train.flash_attention"), std::string::npos);
  const std::unique_ptr<Communicator> comm = make_local_communicator();
  Transformer cp_first(*backend, model_preset("gpt2-tiny"));
  cp_first.set_context_parallel(comm.get(), false);
  EXPECT_NE(test::error_of([&] { cp_first.set_flash_attention(true); }).find("train.flash_attention"), std::string::npos);
  Transformer flash_first(*backend, model_preset("gpt2-tiny"));
  flash_first.set_flash_attention(true);
  EXPECT_NE(test::error_of([&] { flash_first.set_context_parallel(comm.get(), false); }).find("train.flash_attention"),
            std::string::npos);
}

TEST(FlashAttentionModelTest, ConfigKeyDefaultsToFalseAndParses) {
  LoomConfig c;
  EXPECT_FALSE(c.train.flash_attention);
  EXPECT_NE(config_to_toml(c).find("flash_attention = false"), std::string::npos);
  apply_overrides(c, "train.flash_attention=true");
  EXPECT_TRUE(c.train.flash_attention);
  EXPECT_NE(config_to_toml(c).find("flash_attention = true"), std::string::npos);
  LoomConfig from_file;
  apply_config_text(from_file, "[train]\nflash_attention = true\n", "flash.toml");
  EXPECT_TRUE(from_file.train.flash_attention);
  EXPECT_NE(test::error_of([&] { apply_overrides(c, "train.flash_attention=1"); }).find("expects a boolean"),
            std::string::npos);
}

}  // namespace
}  // namespace loom
