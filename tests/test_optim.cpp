// Optimizer properties from each method's paper (docs/optimizers.md; the golden values against
// float64 references are in test_optim_golden.cpp), state-byte accounting, parameter groups,
// schedules, and bitwise resume of every optimizer's state.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "loom/core/error.h"
#include "loom/data/batch_source.h"
#include "loom/optim/optimizer.h"
#include "loom/optim/rules.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

// A small parameter set: a tall and a wide hidden matrix, a fused QKV-like matrix, a vector.
struct Fixture {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  std::vector<OptimParam> list;
  Tensor params, grads;

  explicit Fixture(float weight_decay = 0.0f, uint64_t seed = 5) {
    auto add = [&](const std::string& name, int64_t rows, int64_t cols, bool matrix, bool hidden, std::vector<std::pair<int64_t, int64_t>> segs) {
      OptimParam q;
      q.name = name;
      q.offset = list.empty() ? 0 : list.back().offset + list.back().numel;
      q.numel = rows * cols;
      q.matrix = matrix;
      q.hidden = hidden;
      q.weight_decay = weight_decay;
      int64_t row = 0;
      for (auto [r, block] : segs) {
        q.segments.push_back({q.offset + row * cols, r, cols, block});
        row += r;
      }
      list.push_back(q);
    };
    add("tall", 24, 8, true, true, {{24, 1}});
    add("wide", 8, 40, true, true, {{8, 1}});
    add("qkv", 48, 16, true, true, {{16, 4}, {16, 4}, {16, 1}});
    add("emb", 30, 16, true, false, {{30, 1}});
    add("norm", 1, 16, false, false, {{1, 1}});
    const int64_t P = list.back().offset + list.back().numel;
    params = test::random_tensor(backend->allocator(), {P}, DTYPE_F32, seed);
    grads = test::random_tensor(backend->allocator(), {P}, DTYPE_F32, seed + 1);
  }
  std::vector<float> values(const Tensor& t) const { return std::vector<float>(t.data<float>(), t.data<float>() + t.numel()); }
};

OptimConfig config(const std::string& name) {
  OptimConfig c;
  c.name = name;
  return c.resolved();
}

TEST(OptimTest, AdamFirstStepIsLrTimesSignOfTheGradient) {
  for (const char* name : {"adam", "adamw"}) {
    Fixture f;
    f.params.zero_();  // so the step is read exactly, not through fp32 rounding of theta
    const std::vector<float> before = f.values(f.params), g = f.values(f.grads);
    OptimConfig c = config(name);
    c.weight_decay = 0.0;
    auto opt = make_optimizer(*f.backend, f.params, f.grads, f.list, c);
    opt->step(1e-2f);
    for (size_t i = 0; i < g.size(); ++i) {
      // m_hat = g, v_hat = g^2: the step is lr g / (|g| + eps) = lr sign(g) up to eps/|g|.
      EXPECT_NEAR(f.params.data<float>()[i] - before[i], -1e-2f * (g[i] > 0 ? 1.0f : -1.0f), 1e-2 * (1e-8 / std::fabs(g[i]) + 1e-5))
          << name << " element " << i;
    }
  }
}

TEST(OptimTest, LionStepIsPlusMinusLrElementwise) {
  Fixture f;
  auto opt = make_optimizer(*f.backend, f.params, f.grads, f.list, config("lion"));
  for (int s = 0; s < 3; ++s) {
    const std::vector<float> before = f.values(f.params);
    const Tensor g = test::random_tensor(f.backend->allocator(), {f.params.numel()}, DTYPE_F32, 40 + s);
    std::memcpy(f.grads.raw_data(), g.raw_data(), g.nbytes());
    opt->step(3e-4f);
    for (int64_t i = 0; i < f.params.numel(); ++i) EXPECT_NEAR(std::fabs(f.params.data<float>()[i] - before[i]), 3e-4f, 1e-7f);
  }
}

// ZeRO hands an optimizer a shard: for the elementwise rules, any split of the flat buffer into
// ranges must give bit-identical parameters to the whole.
TEST(OptimTest, ElementwiseRulesGiveTheSameResultOnAnySplitIntoShards) {
  for (const char* name : {"sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam", "adamw", "lion"}) {
    Fixture whole(0.1f), split(0.1f);
    std::vector<OptimParam> shards;
    for (const OptimParam& q : split.list) {
      for (int64_t part = 0; part < 3; ++part) {  // three uneven ranges per parameter
        OptimParam r = q;
        const int64_t begin = q.numel * part / 3, end = q.numel * (part + 1) / 3;
        r.offset = q.offset + begin;
        r.numel = end - begin;
        r.matrix = false;
        r.segments = {{r.offset, 1, r.numel, 1}};
        shards.push_back(r);
      }
    }
    auto a = make_optimizer(*whole.backend, whole.params, whole.grads, whole.list, config(name));
    auto b = make_optimizer(*split.backend, split.params, split.grads, shards, config(name));
    for (int s = 0; s < 3; ++s) {
      a->step(1e-2f, 0.9f);
      b->step(1e-2f, 0.9f);
    }
    EXPECT_EQ(std::memcmp(whole.params.raw_data(), split.params.raw_data(), whole.params.nbytes()), 0) << name;
  }
}

TEST(OptimTest, AdafactorUpdateRmsIsClippedToD) {
  Fixture f;
  OptimConfig c;
  c.name = "adafactor";
  c.relative_step = false;
  c.scale_parameter = false;
  c.clip_threshold = 1.0;
  c = c.resolved();
  auto opt = make_optimizer(*f.backend, f.params, f.grads, f.list, c);
  for (int s = 0; s < 3; ++s) {
    const std::vector<float> before = f.values(f.params);
    opt->step(0.5f);
    for (const OptimParam& q : f.list) {
      for (const OptimSegment& seg : q.segments) {
        double sq = 0.0;
        for (int64_t i = seg.offset; i < seg.offset + seg.rows * seg.cols; ++i) {
          const double u = (before[static_cast<size_t>(i)] - f.params.data<float>()[i]) / 0.5;
          sq += u * u;
        }
        EXPECT_LE(std::sqrt(sq / static_cast<double>(seg.rows * seg.cols)), 1.0 + 1e-5) << q.name;
      }
    }
  }
}

TEST(OptimTest, AdamMiniBlockSharesOneDenominator) {
  Fixture f;
  OptimConfig c = config("adam-mini");
  c.weight_decay = 0.0;
  f.params.zero_();  // so the step is read exactly, not through fp32 rounding of theta
  const std::vector<float> before = f.values(f.params), g = f.values(f.grads);
  auto opt = make_optimizer(*f.backend, f.params, f.grads, f.list, c);
  opt->step(1e-2f);
  // At t = 1, m_hat = g, so delta / g = -lr / (sqrt(v_B) + eps): one value per block.
  for (const OptimParam& q : f.list) {
    for (const OptimSegment& s : q.segments) {
      for (int64_t r = 0; r < s.rows; r += s.block_rows) {
        const int64_t b0 = s.offset + r * s.cols, n = s.block_rows * s.cols;
        const double ref = (f.params.data<float>()[b0] - before[static_cast<size_t>(b0)]) / g[static_cast<size_t>(b0)];
        for (int64_t i = b0; i < b0 + n; ++i) {
          EXPECT_NEAR((f.params.data<float>()[i] - before[static_cast<size_t>(i)]) / g[static_cast<size_t>(i)], ref, 1e-4 * std::fabs(ref))
              << q.name << " block at row " << r;
        }
      }
    }
  }
}

TEST(OptimTest, LdAdamAtFullRankIsAdamW) {
  Fixture a, b;
  OptimConfig ld = config("ldadam");
  ld.rank = 64;  // >= min(rows, cols) of every segment
  OptimConfig aw = config("adamw");
  aw.beta1 = ld.beta1, aw.beta2 = ld.beta2, aw.eps = ld.eps, aw.weight_decay = 0.0;
  auto x = make_optimizer(*a.backend, a.params, a.grads, a.list, ld);
  auto y = make_optimizer(*b.backend, b.params, b.grads, b.list, aw);
  for (int s = 0; s < 4; ++s) {
    const Tensor g = test::random_tensor(a.backend->allocator(), {a.params.numel()}, DTYPE_F32, 70 + s);
    std::memcpy(a.grads.raw_data(), g.raw_data(), g.nbytes());
    std::memcpy(b.grads.raw_data(), g.raw_data(), g.nbytes());
    x->step(1e-2f, 0.7f);
    y->step(1e-2f, 0.7f);
    EXPECT_LT(test::max_rel_error(test::values(a.params), test::values(b.params)), 1e-6) << "step " << s;
    EXPECT_EQ(test::values(a.grads), std::vector<double>(static_cast<size_t>(a.grads.numel()), 0.0));  // no error left
  }
}

TEST(OptimTest, LdAdamLowRankKeepsTheErrorInTheGradientBuffer) {
  Fixture f;
  OptimConfig c = config("ldadam");
  c.rank = 2;
  auto opt = make_optimizer(*f.backend, f.params, f.grads, f.list, c);
  ASSERT_TRUE(opt->keeps_gradients());
  opt->step(1e-3f);
  // The hidden matrices keep G - P P^T G (non-zero at rank 2); embeddings and vectors are zeroed.
  double hidden = 0.0, other = 0.0;
  for (const OptimParam& q : f.list) {
    for (int64_t i = q.offset; i < q.offset + q.numel; ++i) (q.hidden ? hidden : other) += std::fabs(f.grads.data<float>()[i]);
  }
  EXPECT_GT(hidden, 1.0);
  EXPECT_EQ(other, 0.0);
}

// Singular values of NS5's output lie in about [0.7, 1.2], within Jordan's Muon [0.5, 1.5]: the
// eigenvalues of O O^T (Jacobi, in double) are the squared singular values.
std::vector<double> symmetric_eigenvalues(std::vector<double> a, int64_t n) {
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0.0;
    for (int64_t p = 0; p < n; ++p)
      for (int64_t q = p + 1; q < n; ++q) off += a[p * n + q] * a[p * n + q];
    if (off < 1e-22) break;
    for (int64_t p = 0; p < n; ++p) {
      for (int64_t q = p + 1; q < n; ++q) {
        if (std::fabs(a[p * n + q]) < 1e-300) continue;
        const double theta = (a[q * n + q] - a[p * n + p]) / (2 * a[p * n + q]);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int64_t k = 0; k < n; ++k) {
          const double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = c * akp - s * akq;
          a[k * n + q] = s * akp + c * akq;
        }
        for (int64_t k = 0; k < n; ++k) {
          const double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = c * apk - s * aqk;
          a[q * n + k] = s * apk + c * aqk;
        }
      }
    }
  }
  std::vector<double> ev;
  for (int64_t i = 0; i < n; ++i) ev.push_back(a[i * n + i]);
  return ev;
}

TEST(OptimTest, NewtonSchulzMapsSingularValuesNearOne) {
  auto backend = make_cpu_backend();
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{24, 8}, {8, 40}, {16, 16}}) {
    const Tensor u = test::random_tensor(backend->allocator(), {rows * cols}, DTYPE_F32, 9);
    Tensor out = Tensor::empty(backend->allocator(), {rows * cols}, DTYPE_F32, MEM_WORKSPACE);
    Tensor x = Tensor::empty(backend->allocator(), {rows * cols}, DTYPE_F32, MEM_WORKSPACE);
    Tensor y = Tensor::empty(backend->allocator(), {rows * cols}, DTYPE_F32, MEM_WORKSPACE);
    const int64_t s = std::min(rows, cols);
    Tensor a = Tensor::empty(backend->allocator(), {s * s}, DTYPE_F32, MEM_WORKSPACE);
    Tensor b = Tensor::empty(backend->allocator(), {s * s}, DTYPE_F32, MEM_WORKSPACE);
    newton_schulz5(*backend, u, out, rows, cols, 5, x, y, a, b);
    // O O^T (rows <= cols) or O^T O, s x s.
    std::vector<double> gram(static_cast<size_t>(s * s), 0.0);
    const float* o = out.data<float>();
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t j = 0; j < s; ++j) {
        double acc = 0.0;
        for (int64_t k = 0; k < std::max(rows, cols); ++k) {
          acc += rows <= cols ? static_cast<double>(o[i * cols + k]) * o[j * cols + k] : static_cast<double>(o[k * cols + i]) * o[k * cols + j];
        }
        gram[static_cast<size_t>(i * s + j)] = acc;
      }
    }
    for (double e : symmetric_eigenvalues(gram, s)) {
      EXPECT_GE(std::sqrt(e), 0.5) << rows << "x" << cols;
      EXPECT_LE(std::sqrt(e), 1.5) << rows << "x" << cols;
    }
  }
}

// Bytes of state: what each optimizer allocates equals docs/optimizers.md's formula, on both
// model families, and the tracker sees exactly that as optimizer state.
TEST(OptimTest, StateBytesMatchTheFormulaForEveryOptimizer) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig mc = model_preset(preset);
    const ParamLayout layout = build_param_layout(mc);
    const int64_t N = layout.total;
    for (const std::string& name : optimizer_names()) {
      auto backend = make_cpu_backend();
      Tensor params = Tensor::zeros(backend->allocator(), {N}, DTYPE_F32, MEM_PARAMETERS);
      Tensor grads = Tensor::zeros(backend->allocator(), {N}, DTYPE_F32, MEM_GRADIENTS);
      const OptimConfig c = config(name);
      const auto list = optim_params(layout, c);
      auto opt = make_optimizer(*backend, params, grads, list, c);
      const int64_t formula = optimizer_state_bytes(list, c);
      EXPECT_EQ(opt->state_bytes(), formula) << preset << " " << name;
      EXPECT_EQ(static_cast<int64_t>(backend->allocator().tracker().current(MEM_OPTIMIZER_STATE)), formula) << preset << " " << name;
      const double per_param = static_cast<double>(formula) / static_cast<double>(N);
      if (name == "adamw" || name == "adam") {
        EXPECT_EQ(formula, 8 * N);
      } else if (name == "lion" || name == "momentum" || name == "nesterov" || name == "adagrad") {
        EXPECT_EQ(formula, 4 * N);
      } else if (name == "sgd") {
        EXPECT_EQ(formula, 0);
      } else if (name == "adafactor" || name == "sm3") {
        EXPECT_LT(per_param, 1.0) << name;  // sublinear
      }
      if (name == "adam-mini") {
        EXPECT_GT(per_param, 4.0);
        EXPECT_LT(per_param, 4.5);  // ~4 B: m plus one float per block
      }
    }
  }
}

TEST(OptimTest, DefaultGroupsSkipDecayOnNormsBiasesAndEmbeddings) {
  OptimConfig c;
  c.weight_decay = 0.1;
  c.lr_scale = "*.mlp.*=2,h.0.*=0.5, wte.*=0.25";
  c = c.resolved();
  const auto list = optim_params(build_param_layout(model_preset("gpt2-tiny")), c);
  for (const OptimParam& q : list) {
    const bool decays = q.name.find(".weight") != std::string::npos && q.name.find("ln_") == std::string::npos &&
                        q.name != "wte.weight" && q.name != "wpe.weight";
    EXPECT_EQ(q.weight_decay, decays ? 0.1f : 0.0f) << q.name;
    float scale = 1.0f;
    if (q.name.find(".mlp.") != std::string::npos) scale = 2.0f;
    else if (q.name.rfind("h.0.", 0) == 0) scale = 0.5f;
    else if (q.name.rfind("wte.", 0) == 0) scale = 0.25f;
    EXPECT_EQ(q.lr_scale, scale) << q.name;  // the first matching pattern wins
    EXPECT_EQ(q.hidden, q.name.find("attn.c_") != std::string::npos || q.name.find("mlp.c_") != std::string::npos
                            ? q.name.find(".weight") != std::string::npos
                            : false)
        << q.name;
  }
  const auto llama = optim_params(build_param_layout(model_preset("llama-tiny")), c);
  for (const OptimParam& q : llama) {
    if (q.name.find("qkv_proj") != std::string::npos) {
      ASSERT_EQ(q.segments.size(), 3u);
      EXPECT_EQ(q.segments[0].block_rows, model_preset("llama-tiny").head_dim());  // Q: one block per head
      EXPECT_EQ(q.segments[2].block_rows, 1);                                       // V: one per neuron
    }
  }
}

TEST(OptimTest, BadConfigNamesTheKey) {
  auto message = [](OptimConfig c) {
    try {
      (void)c.resolved();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  OptimConfig c;
  c.name = "adamx";
  EXPECT_NE(message(c).find("optim.name"), std::string::npos) << message(c);
  c = OptimConfig{};
  c.beta2 = 1.0;
  EXPECT_NE(message(c).find("optim.beta2"), std::string::npos);
  c = OptimConfig{};
  c.lr_scale = "*.mlp.*";
  EXPECT_NE(message(c).find("optim.lr_scale"), std::string::npos);
  c = OptimConfig{};
  c.name = "muon";
  c.muon_scale = "big";
  EXPECT_NE(message(c).find("optim.muon_scale"), std::string::npos);
}

TEST(ScheduleTest, EveryScheduleAtItsKeyPoints) {
  ScheduleConfig s;
  s.max_lr = 1.0, s.min_lr = 0.1, s.warmup = 10, s.total = 110;
  for (const std::string_view name : EnumNames<LrScheduleKind>::names) {
    const std::string kind(name);
    s.kind = parse_enum<LrScheduleKind>(name, "optim.schedule");
    s.validate();
    EXPECT_DOUBLE_EQ(s.lr(0), 0.1) << kind;  // warmup: max (s+1)/W
    EXPECT_DOUBLE_EQ(s.lr(9), 1.0) << kind;
  }
  s.kind = LrScheduleKind::constant;
  EXPECT_DOUBLE_EQ(s.lr(100), 1.0);
  s.kind = LrScheduleKind::linear;
  EXPECT_DOUBLE_EQ(s.lr(60), 0.55);
  s.kind = LrScheduleKind::cosine;
  EXPECT_DOUBLE_EQ(s.lr(10), 1.0);
  EXPECT_NEAR(s.lr(60), 0.55, 1e-12);
  EXPECT_NEAR(s.lr(110), 0.1, 1e-12);
  s.kind = LrScheduleKind::wsd;  // decay over the last 22 steps (0.2 x 110), from step 88
  EXPECT_DOUBLE_EQ(s.lr(87), 1.0);
  EXPECT_DOUBLE_EQ(s.lr(99), 0.1 + 0.9 * (1.0 - 11.0 / 22.0));
  s.wsd_shape = WsdShape::sqrt;
  EXPECT_DOUBLE_EQ(s.lr(99), 0.1 + 0.9 * (1.0 - std::sqrt(0.5)));
  s.kind = LrScheduleKind::step;
  s.step_size = 30, s.gamma = 0.5;
  EXPECT_DOUBLE_EQ(s.lr(39), 1.0);
  EXPECT_DOUBLE_EQ(s.lr(40), 0.5);
  EXPECT_DOUBLE_EQ(s.lr(100), 0.125);
  s.kind = LrScheduleKind::exponential;
  s.gamma = 0.9;
  EXPECT_NEAR(s.lr(12), 0.81, 1e-12);
  s.kind = LrScheduleKind::inverse_sqrt;
  EXPECT_NEAR(s.lr(39), std::sqrt(10.0 / 40.0), 1e-12);
  EXPECT_THROW(parse_enum<LrScheduleKind>("triangle", "optim.schedule"), Error);
}

std::vector<int32_t> tokens(int64_t n, int64_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + i / 11) % vocab);
  return t;
}

// For every optimizer: 4 steps straight equal 2 steps, a copy of state() and the step counter
// into a fresh trainer, then 2 more steps, bit for bit (what a checkpoint resume does).
TEST(OptimTest, EveryOptimizerResumesBitwiseFromItsState) {
  ModelConfig mc = model_preset("gpt2-tiny");
  for (const std::string& name : optimizer_names()) {
    TrainConfig tc;
    tc.batch_size = 2, tc.seq_len = 16, tc.steps = 4, tc.schedule.warmup = 1, tc.schedule.max_lr = 1e-2;
    tc.optim.name = name;
    if (name == "ldadam") tc.optim.rank = 4;
    // Straight run: 4 steps.
    auto b1 = make_cpu_backend();
    Transformer m1(*b1, mc);
    m1.init_weights(3);
    Trainer t1(*b1, m1, tc);
    RandomWindowSource d1(tokens(4000, mc.vocab_size), 11);
    for (int s = 0; s < 4; ++s) t1.train_step(d1);
    // Interrupted: 2 steps, then a fresh model and trainer take the state.
    auto b2 = make_cpu_backend();
    Transformer m2(*b2, mc);
    m2.init_weights(3);
    Trainer t2(*b2, m2, tc);
    RandomWindowSource d2(tokens(4000, mc.vocab_size), 11);
    for (int s = 0; s < 2; ++s) t2.train_step(d2);
    auto b3 = make_cpu_backend();
    Transformer m3(*b3, mc);
    m3.init_weights(99);  // different weights: everything must come from the copy
    Trainer t3(*b3, m3, tc);
    std::memcpy(m3.params().raw_data(), m2.params().raw_data(), m2.params().nbytes());
    ASSERT_EQ(t2.optimizer().state().size(), t3.optimizer().state().size()) << name;
    for (size_t i = 0; i < t2.optimizer().state().size(); ++i) {
      const Tensor& src = t2.optimizer().state()[i].second;
      std::memcpy(t3.optimizer().state()[i].second.raw_data(), src.raw_data(), src.nbytes());
    }
    t3.restore(2, t2.optimizer().steps_taken());
    for (int s = 0; s < 2; ++s) t3.train_step(d2);
    EXPECT_EQ(std::memcmp(m1.params().raw_data(), m3.params().raw_data(), m1.params().nbytes()), 0) << name;
  }
}

}  // namespace
}  // namespace loom
