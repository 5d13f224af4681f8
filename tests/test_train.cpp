// Trainer: memory accounting against the model's arithmetic, gradient accumulation, learning,
// and the non-finite-loss guard.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>

#include "loom/arch/param_layout.h"
#include "loom/core/error.h"
#include "loom/train/throughput.h"
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
// A GEMM peak measured below half the datasheet-style peak is not cached (train/throughput.h).
// The shared VM's cases: 59 GFLOP/s against 202 is busy, 75 against the 157 of its stated clock
// too; its idle 144-166 against 157-202 is not, nor is a GPU's peak (no datasheet figure: 0).
TEST(GemmPeakTest, AMeasurementOnABusyMachineIsNotKept) {
  EXPECT_TRUE(peak_measured_on_a_busy_machine(59.1, 202.0));
  EXPECT_TRUE(peak_measured_on_a_busy_machine(75.0, 156.5));
  EXPECT_FALSE(peak_measured_on_a_busy_machine(144.0, 199.0));
  EXPECT_FALSE(peak_measured_on_a_busy_machine(166.0, 187.0));
  EXPECT_FALSE(peak_measured_on_a_busy_machine(101.0, 202.0));
  EXPECT_FALSE(peak_measured_on_a_busy_machine(50.0, 0.0));
}

// MFU above 1 against a cached peak says the peak was measured on a slower machine state: the
// warning names the dtype, the peak and the file; none at or below 1, and none for a peak the run
// measured itself (it would be the run's own noise, and there is no file to delete).
TEST(GemmPeakTest, AnMfuAboveTheCachedPeakNamesTheFileToDelete) {
  GemmPeak peak;
  peak.dtype = DTYPE_BF16;
  peak.measured_gflops = 133.7;
  peak.cached = true;
  peak.cache_file = "/cache/loom/gemm_peak.json";
  EXPECT_EQ(peak.above_peak_warning(1.32),
            "MFU 132% is above the cached bf16 GEMM peak (134 GFLOP/s in /cache/loom/gemm_peak.json), which was "
            "measured while this machine was slower; delete that file to measure it again");
  EXPECT_EQ(peak.above_peak_warning(1.0), "");
  EXPECT_EQ(peak.above_peak_warning(0.83), "");
  peak.cached = false;
  EXPECT_EQ(peak.above_peak_warning(1.32), "");
}

// The CPU backend names its GEMM kernels per input dtype, with the revision the peak cache keys on.
TEST(GemmPeakTest, TheCpuBackendNamesItsGemmKernelsWithARevision) {
  auto backend = make_cpu_backend();
  const std::string f32 = backend->gemm_kernels(DTYPE_F32), bf16 = backend->gemm_kernels(DTYPE_BF16);
  EXPECT_EQ(f32.rfind("oneDNN sgemm, ", 0), 0u) << f32;
  EXPECT_NE(f32, bf16);
  for (const std::string& s : {f32, bf16}) {
    const size_t at = s.rfind(" (cpu gemm r");
    ASSERT_NE(at, std::string::npos) << s;
    EXPECT_EQ(s.back(), ')') << s;
    EXPECT_TRUE(std::isdigit(static_cast<unsigned char>(s[at + 12]))) << s;
  }
  // Without AVX-512 the bf16 GEMM is widened to fp32, and the words say so.
  EXPECT_EQ(bf16.find("widened") != std::string::npos, f32.find("AVX2") != std::string::npos) << bf16;
}

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
    tc.schedule.kind = LrScheduleKind::constant;  // skipped steps must not shift the lr of the taken ones
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

// Every precision recipe against fp32 on the same model and data (60 AdamW steps of
// gpt2-tiny): the first loss and the first step's gradients agree to the recipe's precision, it
// really ran (not bit-identical to fp32), and the mean loss of the last 10 steps is within
// `tail` of fp32's while the model learns. Tolerances follow from each format's unit roundoff
// u (bf16 2^-8, fp16 2^-11, E4M3 2^-4, E5M2 2^-3, E2M1 weights ~2^-2): gradient errors of a few
// u, the first loss within u; measured values are in the comments.
struct RecipeCase {
  const char* name;
  void (*set)(TrainConfig&);
  double first_loss, grad, tail;  // relative tolerances
};

const RecipeCase kRecipes[] = {
    // measured (first loss, grad, tail): 1.0e-5, 3.3e-3, 0.11% (1.3e-5, 3.2e-3, 0.17% with precision.outputs = f32)
    {"bf16", [](TrainConfig& t) { t.precision.compute = "bf16"; }, 1e-4, 1e-2, 0.01},
    // 5.7e-7, 5.0e-4, 0.04%
    {"fp16+scaling", [](TrainConfig& t) { t.precision.compute = "fp16", t.loss_scaling = true; }, 1e-4, 2e-3, 0.005},
    // 3.0e-5, 5.4e-2, 0.55%
    {"fp8-delayed", [](TrainConfig& t) { t.precision.compute = "fp8-delayed"; }, 1e-3, 0.15, 0.02},
    // 9.0e-5, 5.6e-2, 0.61%
    {"fp8-current", [](TrainConfig& t) { t.precision.compute = "fp8-current"; }, 1e-3, 0.15, 0.02},
    // 4.6e-5, 2.3e-2, 0.42% (E4M3 gradients with 1x128 scales beat per-tensor E5M2)
    {"fp8-block", [](TrainConfig& t) { t.precision.compute = "fp8-block"; }, 1e-3, 0.15, 0.02},
    // 4.0e-5, 8.3e-2, 1.45%
    {"mxfp4-qat", [](TrainConfig& t) { t.precision.qat = "mxfp4"; }, 1e-3, 0.2, 0.03},
    // 7.6e-5, 6.4e-2, 0.95%
    {"nvfp4-qat", [](TrainConfig& t) { t.precision.qat = "nvfp4"; }, 1e-3, 0.2, 0.03},
    // 6.2e-6, 3.4e-3, 1.06%: the updates themselves are rounded to bf16
    {"bf16+master-bf16-sr",
     [](TrainConfig& t) { t.precision.compute = "bf16", t.precision.master = "bf16", t.precision.stochastic_rounding = true; },
     1e-4, 1e-2, 0.02},
    // 1.4e-5, 3.3e-3, 0.06%: attention's GEMMs in bf16 too (precision.attention), the bf16 bounds
    {"bf16+attention-bf16", [](TrainConfig& t) { t.precision.compute = "bf16", t.precision.attention = "bf16"; }, 1e-4,
     1e-2, 0.01},
    // 1.3e-5, 4.4e-3, 0.15%
    {"bf16+reduce-bf16", [](TrainConfig& t) { t.precision.compute = "bf16", t.precision.reduce = "bf16"; }, 1e-4, 1e-2, 0.01},
    // 6.2e-5, 4.7e-2, 1.19%
    {"fp8-current+param-bf16",
     [](TrainConfig& t) { t.precision.compute = "fp8-current", t.precision.param = "bf16"; }, 1e-3, 0.15, 0.02},
};

struct RecipeRun {
  std::vector<double> loss, grads;
  double tail = 0.0;
};

RecipeRun run_recipe(void (*set)(TrainConfig&)) {
  ModelConfig config = model_preset("gpt2-tiny");
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(1);
  TrainConfig tc;
  tc.batch_size = 8, tc.seq_len = 16, tc.steps = 60, tc.schedule.warmup = 5, tc.schedule.max_lr = 1e-2;
  if (set) set(tc);
  Trainer trainer(*backend, model, tc);
  RandomWindowSource data(repeating_tokens(3000, 97), 3);
  RecipeRun r;
  for (int s = 0; s < 60; ++s) {
    const StepStats st = trainer.train_step(data);
    EXPECT_FALSE(st.skipped) << "step " << s;
    r.loss.push_back(st.loss);
    if (s == 0) r.grads = test::values(model.grads());
    if (s >= 50) r.tail += st.loss / 10;
  }
  return r;
}

class RecipeTest : public ::testing::TestWithParam<RecipeCase> {};

TEST_P(RecipeTest, TracksFp32) {
  static const RecipeRun fp32 = run_recipe(nullptr);
  const RecipeCase& c = GetParam();
  const RecipeRun r = run_recipe(c.set);
  const double first = std::abs(r.loss[0] - fp32.loss[0]) / fp32.loss[0];
  const double grad = test::max_rel_error(r.grads, fp32.grads);
  const double tail = std::abs(r.tail - fp32.tail) / fp32.tail;
  std::printf("%-24s first loss rel %.1e, grad rel %.1e, last-10 loss %.4f vs fp32 %.4f (%.2f%%)\n", c.name, first, grad,
              r.tail, fp32.tail, 100 * tail);
  EXPECT_LT(first, c.first_loss);
  EXPECT_LT(grad, c.grad);
  EXPECT_GT(grad, 1e-6);  // the recipe really ran
  EXPECT_LT(tail, c.tail);
  EXPECT_LT(fp32.tail, 0.5 * fp32.loss[0]);  // and the model learns
}

INSTANTIATE_TEST_SUITE_P(Precision, RecipeTest, ::testing::ValuesIn(kRecipes),
                         [](const ::testing::TestParamInfo<RecipeCase>& param_info) {
                           std::string n = param_info.param.name;
                           for (char& ch : n) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return n;
                         });

// precision.activations = bf16 (nn/plan.h LayerPlan::saved_bf16) against f32, under bf16
// compute, 12 AdamW steps. The norms' outputs and the MLP activation are exactly what the bf16
// GEMMs read, so with FlashAttention (whose O stays fp32) every loss and gradient is bitwise the
// f32-saved run's. With the plain attention O is saved in bf16 too and the softmax backward's
// D = rowsum(dO o O) reads it so: the first loss is bitwise equal (the forward is unchanged), the
// first gradients differ from the fp32-saved ones by a small fraction of bf16 compute's own
// error against fp32 (3.2e-3 in RecipeTest), and activation checkpointing reproduces them
// bitwise. The bf16 run's peak activation bytes are below the f32 run's.
struct SavedRun {
  std::vector<double> loss, grads;
  int64_t activations = 0;
};

SavedRun run_saved(const char* preset, const char* activations, bool flash, const char* recompute,
                   const char* attention = "f32", const char* outputs = "f32") {
  const ModelConfig config = model_preset(preset);
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(1);
  TrainConfig tc;
  tc.batch_size = 4, tc.seq_len = 16, tc.schedule.warmup = 2, tc.schedule.max_lr = 1e-2;
  tc.precision.compute = "bf16", tc.precision.activations = activations, tc.precision.attention = attention;
  tc.precision.outputs = outputs;
  tc.flash_attention = flash, tc.recompute = recompute;
  Trainer trainer(*backend, model, tc);
  RandomWindowSource data(repeating_tokens(3000, 97), 3);
  SavedRun r;
  for (int s = 0; s < 12; ++s) {
    const StepStats st = trainer.train_step(data);
    r.loss.push_back(st.loss);
    if (s == 0) r.grads = test::values(model.grads());
  }
  r.activations = static_cast<int64_t>(backend->allocator().tracker().peak(MEM_ACTIVATIONS));
  return r;
}

// The blocks' saved fields (the GEMM outputs in f32 here: precision.outputs is the next test's): with flash
// attention in fp32 O stays fp32: the saved inputs are the f32-saved run's bf16 copies
// bit for bit, and the one other difference is the fc bias's gradient, which sums d(fc output) in
// bf16 (LayerPlan::mlp_in_dy_bf16, as autocast's): llama-tiny (no biases) is bitwise the f32-saved
// run, gpt2-tiny in every gradient but its c_fc biases. The plain attention, and flash attention
// in bf16 (precision.attention = bf16: its kernels write O in bf16 and read it for D), keep O in
// bf16, which moves the gradients by bf16's rounding of D.
TEST(TrainerTest, Bf16SavedActivationsTrainAsTheFp32SavedOnes) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    for (const char* attention : {"flash", "plain", "flash-bf16"}) {
      const bool flash = std::string(attention) != "plain", o16 = std::string(attention) == "flash-bf16";
      const char* attn_dtype = o16 ? "bf16" : "f32";
      const SavedRun f32 = run_saved(preset, "f32", flash, "none", attn_dtype);
      const SavedRun bf16 = run_saved(preset, "bf16", flash, "none", attn_dtype);
      EXPECT_EQ(bf16.loss[0], f32.loss[0]) << preset;
      EXPECT_LT(bf16.activations, f32.activations) << preset;
      const double grad = test::max_rel_error(bf16.grads, f32.grads);
      double tail = 0;
      for (size_t s = 0; s < f32.loss.size(); ++s) tail = std::max(tail, std::abs(bf16.loss[s] - f32.loss[s]) / f32.loss[s]);
      std::printf("%-10s %-10s: activations %lld -> %lld bytes, first gradients rel %.1e, losses rel %.1e\n", preset,
                  attention, static_cast<long long>(f32.activations), static_cast<long long>(bf16.activations), grad, tail);
      if (flash && !o16) {
        const ParamLayout layout = build_param_layout(model_preset(preset));
        double bias_scale = 0.0, bias_err = 0.0;
        int64_t other_diffs = 0, fc_biases = 0;
        for (const ParamSpec& p : layout.params) {
          const bool fc_bias = p.name.ends_with("mlp.c_fc.bias");
          fc_biases += fc_bias;
          for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
            const double a = bf16.grads[static_cast<size_t>(i)], b = f32.grads[static_cast<size_t>(i)];
            if (!fc_bias) other_diffs += a != b;
            if (fc_bias) bias_scale = std::max(bias_scale, std::abs(b)), bias_err = std::max(bias_err, std::abs(a - b));
          }
        }
        EXPECT_EQ(other_diffs, 0) << preset;
        std::printf("%-10s fc bias gradients from the bf16 d(fc): rel %.1e (%lld biases)\n", preset,
                    bias_err / std::max(bias_scale, 1e-30), static_cast<long long>(fc_biases));
        if (fc_biases == 0) {
          EXPECT_EQ(bf16.loss, f32.loss) << preset;
        } else {  // a sum of bf16-rounded terms: within a few bf16 steps of the fp32 one, and not equal
          EXPECT_GT(bias_err, 0.0) << preset;
          EXPECT_LT(bias_err, 1e-2 * bias_scale) << preset;
          EXPECT_LT(tail, 1e-3) << preset;
        }
        continue;
      }
      // measured: gradients 3.1e-5 (gpt2-tiny), 2.5e-4 (llama-tiny); losses 2.9e-4, 6.2e-4
      EXPECT_LT(grad, 1e-3) << preset;
      EXPECT_GT(grad, 0.0) << preset;  // O really was saved in bf16
      EXPECT_LT(tail, 2e-3) << preset;
      for (const char* recompute : {"selective", "full"}) {
        const SavedRun again = run_saved(preset, "bf16", flash, recompute, attn_dtype);
        EXPECT_EQ(again.grads, bf16.grads) << preset << " " << recompute;
        EXPECT_EQ(again.loss, bf16.loss) << preset << " " << recompute;
      }
    }
  }
}

// precision.outputs = bf16: the GEMM outputs autocast returns in bf16 are bf16: the training
// loss's logits (Transformer::head_and_loss: the loss reads them widened and writes d(logits) over
// them) and fc's output (LayerPlan::fc_bf16: the activation reads it widened). Against the same
// runs with fp32 outputs: the first loss moves by bf16's rounding and is not equal, the first
// gradients by less than bf16 compute's own error against fp32 (RecipeTest's bound: 1e-2); over 12
// steps at this high learning rate the losses stay within 5e-3. The saved fc is half the bytes.
// With the flash attention in bf16 (precision.attention = bf16) GPT-2's qkv is bf16 too
// (LayerPlan::qkv_bf16: half its bytes; Llama's RoPE keeps it fp32) and so is dO, the output
// projection's d(input) (attn_dy_bf16): the kernels round both to those bits anyway, so on the CPU
// they change no bit (measured with either flag forced off).
// (measured: first gradients 1.3e-3 gpt2-tiny, 2.2e-3 llama-tiny, 1.5e-3 gpt2-tiny with bf16
// attention; losses 2.4e-3, 2.2e-3, 2.4e-3)
TEST(TrainerTest, Bf16OutputsTrainAsTheFp32Outputs) {
  for (const auto& [preset, attention] :
       {std::pair{"gpt2-tiny", "f32"}, std::pair{"llama-tiny", "f32"}, std::pair{"gpt2-tiny", "bf16"}}) {
    const SavedRun f32 = run_saved(preset, "bf16", true, "none", attention, "f32");
    const SavedRun bf16 = run_saved(preset, "bf16", true, "none", attention, "bf16");
    const double grad = test::max_rel_error(bf16.grads, f32.grads);
    double tail = 0;
    for (size_t s = 0; s < f32.loss.size(); ++s) tail = std::max(tail, std::abs(bf16.loss[s] - f32.loss[s]) / f32.loss[s]);
    std::printf("%-10s attention %s, bf16 outputs: first loss %.7f vs %.7f, first gradients rel %.1e, losses rel %.1e, "
                "activations %lld -> %lld bytes\n", preset, attention, bf16.loss[0], f32.loss[0], grad, tail,
                static_cast<long long>(f32.activations), static_cast<long long>(bf16.activations));
    const ModelConfig config = model_preset(preset);
    EXPECT_NE(bf16.loss[0], f32.loss[0]) << preset;  // the outputs really were rounded
    EXPECT_LT(std::abs(bf16.loss[0] - f32.loss[0]) / f32.loss[0], 1e-3) << preset;
    const bool qkv16 = std::string(attention) == "bf16" && config.arch == ARCH_GPT2;
    EXPECT_EQ(f32.activations - bf16.activations,
              config.n_layer * 2 * 4 * 16 * (config.mlp_in_width() + (qkv16 ? config.qkv_width() : 0)))
        << preset << " attention " << attention;
    EXPECT_GT(grad, 0.0) << preset;
    EXPECT_LT(grad, 5e-3) << preset;
    EXPECT_LT(tail, 5e-3) << preset;
  }
}

// The trainer's fused loss (ActivationStore::fused_loss_weight): the loss pass writes d(logits)
// and backward starts from it; the gradients are bitwise those of the loss then its gradient in
// backward, for an fp32 head (in place) and a bf16 one (straight into the head's bf16 operand; its
// logits in fp32 here, as the separate ops keep them: precision.outputs = bf16 is the test above).
// A backward with another loss weight than the loss pass's is refused.
TEST(TrainerTest, TheFusedLossGivesBitwiseTheGradientsOfTheSeparateOnes) {
  for (const char* compute : {"f32", "bf16"}) {
    const ModelConfig config = model_preset("gpt2-tiny");
    auto backend = make_cpu_backend();
    Transformer model(*backend, config);
    model.init_weights(1);
    PrecisionConfig pc;
    pc.compute = compute;
    pc.outputs = "f32";
    model.set_precision(resolve_policy(pc));
    ActivationStore store = model.allocate_store(4, 16);
    const std::vector<int32_t> tokens = repeating_tokens(65, 29);
    backend->write(store.tokens, tokens.data());
    backend->write(store.targets, tokens.data() + 1);
    const auto run = [&](float fused) {
      model.zero_grads();
      store.fused_loss_weight = fused;
      const double loss = model.forward(store);
      EXPECT_EQ(store.dlogits.defined(), fused != 0.0f) << compute;
      if (fused != 0.0f) {
        EXPECT_EQ(store.dlogits.dtype(), std::string(compute) == "bf16" ? DTYPE_BF16 : DTYPE_F32);
      }
      model.backward(store, 0.5f);
      EXPECT_FALSE(store.dlogits.defined());
      return std::make_pair(loss, test::values(model.grads()));
    };
    const auto plain = run(0.0f), fused = run(0.5f);
    EXPECT_EQ(fused.first, plain.first) << compute;
    EXPECT_EQ(fused.second, plain.second) << compute;
    store.fused_loss_weight = 0.5f;
    model.forward(store);
    EXPECT_THROW(model.backward(store, 0.25f), Error) << compute;
  }
}

// FP16 with dynamic loss scaling from 2^40: the first steps overflow fp16 (inf gradients), are
// skipped with the parameters bit-identical, and halve the scale each time, until it fits; then
// training proceeds, with at most an occasional overflow as the gradients grow (the growth
// interval is 2000, so the scale only comes down).
TEST(TrainerTest, Fp16LossScalingBacksOffUntilTheGradientsFit) {
  ModelConfig config = model_preset("gpt2-tiny");
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(1);
  TrainConfig tc;
  tc.batch_size = 8, tc.seq_len = 16, tc.steps = 40;
  tc.precision.compute = "fp16";
  tc.loss_scaling = true;
  tc.loss_scaler.init_scale = std::ldexp(1.0, 40);
  Trainer trainer(*backend, model, tc);
  RandomWindowSource data(repeating_tokens(3000, 97), 3);
  int skipped = 0, taken = 0, late_overflows = 0;
  float scale = static_cast<float>(tc.loss_scaler.init_scale);
  for (int s = 0; s < 40; ++s) {
    const std::vector<double> before = test::values(model.params());
    const StepStats st = trainer.train_step(data);
    EXPECT_EQ(st.loss_scale, scale) << "step " << s;
    if (st.skipped) {
      EXPECT_EQ(test::values(model.params()), before) << "step " << s;
      scale /= 2;
      ++skipped;
      if (taken > 0) ++late_overflows;
    } else {
      EXPECT_NE(test::values(model.params()), before) << "step " << s;
      ++taken;
    }
  }
  EXPECT_LE(late_overflows, 3);
  EXPECT_GT(taken, 10);
  EXPECT_GT(skipped, 10);  // 2^40 * |dlogits| ~ 2^40 / 128 is far beyond fp16's 65504
  EXPECT_EQ(trainer.loss_scaler()->scale(), scale);
}

}  // namespace
}  // namespace loom
