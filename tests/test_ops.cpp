// Every op of the CPU backend: forward against a naive reference written here, backward by
// float64 central differences, on odd shapes (T, C, V not multiples of anything).
// Tolerances: f32 forward vs naive double: 2e-6 relative to the output's scale (1e-5 for GEMMs
// with K up to 37); f64 finite differences: 1e-6.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "loom/backend/backend.h"
#include "loom/backend/cpu/cpu_math.h"
#include "loom/core/error.h"
#include "test_util.h"

namespace loom {
namespace {

using test::expect_gradient_matches;
using test::max_rel_error;
using test::random_tensor;
using test::random_tokens;
using test::values;
using test::weighted_sum;

constexpr double kFdTol = 1e-6;

class OpsTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend = make_cpu_backend();
  Allocator& alloc = backend->allocator();
  Tensor f64(Shape shape, uint64_t seed, double scale = 1.0) { return random_tensor(alloc, std::move(shape), DTYPE_F64, seed, scale); }
  Tensor f32(Shape shape, uint64_t seed, double scale = 1.0) { return random_tensor(alloc, std::move(shape), DTYPE_F32, seed, scale); }
  Tensor empty(Shape shape, DType dtype = DTYPE_F64) { return Tensor::empty(alloc, std::move(shape), dtype, MEM_WORKSPACE); }
  Tensor zeros(Shape shape, DType dtype = DTYPE_F64) { return Tensor::zeros(alloc, std::move(shape), dtype, MEM_WORKSPACE); }
};

// ---------------------------------------------------------------- GEMM

std::vector<double> naive_gemm(const std::vector<double>& a, const std::vector<double>& b, std::vector<double> c,
                               int64_t batch, int64_t m, int64_t n, int64_t k, bool ta, bool tb, double alpha,
                               double beta, const std::vector<double>* bias) {
  for (int64_t z = 0; z < batch; ++z) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t p = 0; p < k; ++p) {
          const double av = ta ? a[z * m * k + p * m + i] : a[z * m * k + i * k + p];
          const double bv = tb ? b[z * k * n + j * k + p] : b[z * k * n + p * n + j];
          acc += av * bv;
        }
        double& out = c[z * m * n + i * n + j];
        out = alpha * acc + beta * out + (bias ? (*bias)[j] : 0.0);
      }
    }
  }
  return c;
}

TEST_F(OpsTest, GemmAllTransposesBatchedWithBiasMatchesNaive) {
  const int64_t batch = 3, m = 7, n = 5, k = 37;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (DType dtype : {DTYPE_F32, DTYPE_F64}) {
        Tensor a = random_tensor(alloc, ta ? Shape{batch, k, m} : Shape{batch, m, k}, dtype, 1);
        Tensor b = random_tensor(alloc, tb ? Shape{batch, n, k} : Shape{batch, k, n}, dtype, 2);
        Tensor c = random_tensor(alloc, {batch, m, n}, dtype, 3);
        Tensor bias = random_tensor(alloc, {n}, dtype, 4);
        const std::vector<double> bias_v = values(bias);
        const std::vector<double> expected =
            naive_gemm(values(a), values(b), values(c), batch, m, n, k, ta, tb, 0.5, 0.25, &bias_v);
        GemmSpec spec{ta, tb, 0.5f, 0.25f, batch};
        backend->gemm(a, b, c, spec, &bias);
        EXPECT_LT(max_rel_error(values(c), expected), dtype == DTYPE_F32 ? 1e-5 : 1e-13)
            << "trans_a " << ta << " trans_b " << tb << " dtype " << dtype_name(dtype);
      }
    }
  }
}

TEST_F(OpsTest, GemmRejectsShapesThatDoNotChain) {
  Tensor a = f32({4, 3}, 1), b = f32({5, 2}, 2), c = f32({4, 2}, 3);
  EXPECT_THROW(backend->gemm(a, b, c, GemmSpec{}), Error);
}

// ---------------------------------------------------------------- elementwise and reductions

TEST_F(OpsTest, AddScaleSumAndSumSquaresMatchNaive) {
  Tensor a = f32({13, 7}, 1), b = f32({13, 7}, 2), out = empty({13, 7}, DTYPE_F32);
  backend->add(a, b, out);
  const auto av = values(a), bv = values(b), ov = values(out);
  double s = 0, ss = 0;
  for (size_t i = 0; i < av.size(); ++i) {
    EXPECT_EQ(ov[i], static_cast<double>(static_cast<float>(av[i]) + static_cast<float>(bv[i])));
    s += av[i];
    ss += av[i] * av[i];
  }
  EXPECT_NEAR(backend->sum(a), s, 1e-12);
  EXPECT_NEAR(backend->sum_squares(a), ss, 1e-12);
  backend->scale_inplace(a, 0.5);
  EXPECT_EQ(values(a)[5], static_cast<double>(static_cast<float>(av[5]) * 0.5f));
}

TEST_F(OpsTest, BiasBackwardAccumulatesColumnSums) {
  Tensor dout = f64({3, 5, 67}, 1), dbias = f64({67}, 2);  // 67 columns: two column blocks, one ragged
  const auto before = values(dbias), d = values(dout);
  backend->bias_backward(dout, dbias);
  const auto after = values(dbias);
  for (int64_t c = 0; c < 67; ++c) {
    double expected = before[c];
    for (int64_t r = 0; r < 15; ++r) expected += d[r * 67 + c];
    EXPECT_NEAR(after[c], expected, 1e-12);
  }
}

TEST_F(OpsTest, CastToBf16RoundsToNearestEven) {
  Tensor x = f32({1000}, 9, 100.0), y = empty({1000}, DTYPE_BF16), back = empty({1000}, DTYPE_F32);
  backend->cast(x, y);
  backend->cast(y, back);
  for (int64_t i = 0; i < 1000; ++i) {
    EXPECT_EQ(y.data<bf16>()[i].bits, f32_to_bf16(x.data<float>()[i]).bits);
    EXPECT_LE(std::abs(back.data<float>()[i] - x.data<float>()[i]), std::abs(x.data<float>()[i]) * (1.0 / 256));
  }
}

// ---------------------------------------------------------------- embedding

TEST_F(OpsTest, EmbeddingForwardMatchesNaiveAndBackwardMatchesFiniteDifferences) {
  const int64_t B = 2, T = 5, V = 11, C = 67, Tmax = 7;
  Tensor tokens = random_tokens(alloc, {B, T}, V, 3);
  Tensor table = f64({V, C}, 1), pos = f64({Tmax, C}, 2), out = empty({B, T, C}), w = f64({B, T, C}, 4);
  backend->embedding_forward(tokens, table, &pos, out);
  const auto tv = values(table), pv = values(pos), ov = values(out);
  for (int64_t n = 0; n < B * T; ++n) {
    for (int64_t c = 0; c < C; ++c) {
      EXPECT_EQ(ov[n * C + c], tv[tokens.data<int32_t>()[n] * C + c] + pv[(n % T) * C + c]);
    }
  }
  Tensor dtable = zeros({V, C}), dpos = zeros({Tmax, C});
  backend->embedding_backward(tokens, w, dtable, &dpos);
  auto loss = [&] {
    backend->embedding_forward(tokens, table, &pos, out);
    return weighted_sum(out, w);
  };
  expect_gradient_matches(table, values(dtable), loss, kFdTol, "dtable");
  expect_gradient_matches(pos, values(dpos), loss, kFdTol, "dpositions");
}

TEST_F(OpsTest, EmbeddingRejectsOutOfRangeToken) {
  Tensor tokens = random_tokens(alloc, {1, 3}, 5, 1), table = f32({5, 4}, 1), out = empty({1, 3, 4}, DTYPE_F32);
  tokens.data<int32_t>()[2] = 5;
  EXPECT_THROW(backend->embedding_forward(tokens, table, nullptr, out), Error);
}

// ---------------------------------------------------------------- norms

TEST_F(OpsTest, LayerNormForwardMatchesNaive) {
  const int64_t N = 9, C = 67;
  Tensor x = f32({N, C}, 1, 3.0), w = f32({C}, 2), b = f32({C}, 3);
  Tensor out = empty({N, C}, DTYPE_F32), mean = empty({N}, DTYPE_F32), rstd = empty({N}, DTYPE_F32);
  backend->layernorm_forward(x, w, b, out, mean, rstd, 1e-5f);
  const auto xv = values(x), wv = values(w), bv = values(b);
  std::vector<double> expected(N * C);
  for (int64_t r = 0; r < N; ++r) {
    double m = 0, var = 0;
    for (int64_t c = 0; c < C; ++c) m += xv[r * C + c] / C;
    for (int64_t c = 0; c < C; ++c) var += (xv[r * C + c] - m) * (xv[r * C + c] - m) / C;
    for (int64_t c = 0; c < C; ++c) expected[r * C + c] = (xv[r * C + c] - m) / std::sqrt(var + 1e-5) * wv[c] + bv[c];
  }
  EXPECT_LT(max_rel_error(values(out), expected), 2e-6);
}

TEST_F(OpsTest, LayerNormBackwardMatchesFiniteDifferences) {
  const int64_t N = 7, C = 13;
  Tensor x = f64({N, C}, 1, 2.0), w = f64({C}, 2), b = f64({C}, 3), dout = f64({N, C}, 4);
  Tensor out = empty({N, C}), mean = empty({N}), rstd = empty({N});
  Tensor dx = empty({N, C}), dw = zeros({C}), db = zeros({C});
  backend->layernorm_forward(x, w, b, out, mean, rstd, 1e-5f);
  backend->layernorm_backward(dout, x, w, mean, rstd, dx, dw, db);
  auto loss = [&] {
    backend->layernorm_forward(x, w, b, out, mean, rstd, 1e-5f);
    return weighted_sum(out, dout);
  };
  expect_gradient_matches(x, values(dx), loss, kFdTol, "dx");
  expect_gradient_matches(w, values(dw), loss, kFdTol, "dweight");
  expect_gradient_matches(b, values(db), loss, kFdTol, "dbias");
}

TEST_F(OpsTest, RmsNormForwardMatchesNaive) {
  const int64_t N = 9, C = 67;
  Tensor x = f32({N, C}, 1, 3.0), w = f32({C}, 2), out = empty({N, C}, DTYPE_F32), rstd = empty({N}, DTYPE_F32);
  backend->rmsnorm_forward(x, w, out, rstd, 1e-5f);
  const auto xv = values(x), wv = values(w);
  std::vector<double> expected(N * C);
  for (int64_t r = 0; r < N; ++r) {
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += xv[r * C + c] * xv[r * C + c] / C;
    for (int64_t c = 0; c < C; ++c) expected[r * C + c] = xv[r * C + c] / std::sqrt(ms + 1e-5) * wv[c];
  }
  EXPECT_LT(max_rel_error(values(out), expected), 2e-6);
}

TEST_F(OpsTest, RmsNormBackwardMatchesFiniteDifferences) {
  const int64_t N = 7, C = 13;
  Tensor x = f64({N, C}, 1, 2.0), w = f64({C}, 2), dout = f64({N, C}, 4);
  Tensor out = empty({N, C}), rstd = empty({N}), dx = empty({N, C}), dw = zeros({C});
  backend->rmsnorm_forward(x, w, out, rstd, 1e-5f);
  backend->rmsnorm_backward(dout, x, w, rstd, dx, dw);
  auto loss = [&] {
    backend->rmsnorm_forward(x, w, out, rstd, 1e-5f);
    return weighted_sum(out, dout);
  };
  expect_gradient_matches(x, values(dx), loss, kFdTol, "dx");
  expect_gradient_matches(w, values(dw), loss, kFdTol, "dweight");
}

// Qwen3's q/k norm: heads [1, 3) of 5 in each row normed in place, the others untouched, the
// heads before the norm kept in `in`.
TEST_F(OpsTest, HeadRmsNormForwardMatchesNaiveOnItsHeadsOnly) {
  const int64_t B = 2, T = 3, hd = 6, first = 1, n = 2, W = 5 * hd;
  Tensor x = f32({B, T, W}, 1, 3.0), w = f32({hd}, 2), in = empty({B, T, n * hd}, DTYPE_F32),
         rstd = empty({B, T, n}, DTYPE_F32);
  const auto before = values(x), wv = values(w);
  backend->head_rmsnorm_forward(x, w, first, n, hd, 1e-6f, in, rstd);
  std::vector<double> expected = before, kept(static_cast<size_t>(B * T * n * hd));
  for (int64_t r = 0; r < B * T; ++r) {
    for (int64_t h = first; h < first + n; ++h) {
      const double* v = before.data() + r * W + h * hd;
      double ms = 0;
      for (int64_t c = 0; c < hd; ++c) ms += v[c] * v[c] / hd;
      for (int64_t c = 0; c < hd; ++c) {
        expected[static_cast<size_t>(r * W + h * hd + c)] = v[c] / std::sqrt(ms + 1e-6) * wv[c];
        kept[static_cast<size_t>((r * n + h - first) * hd + c)] = v[c];
      }
    }
  }
  EXPECT_LT(max_rel_error(values(x), expected), 2e-6);
  EXPECT_EQ(values(in), kept);
}

TEST_F(OpsTest, HeadRmsNormBackwardMatchesFiniteDifferences) {
  const int64_t B = 2, T = 2, hd = 4, first = 1, n = 2, W = 4 * hd;
  Tensor x = f64({B, T, W}, 1, 2.0), w = f64({hd}, 2), dout = f64({B, T, W}, 4), y = empty({B, T, W});
  Tensor in = empty({B, T, n * hd}), rstd = empty({B, T, n}), dx = empty({B, T, W}), dw = zeros({hd});
  backend->copy(x, y);
  backend->head_rmsnorm_forward(y, w, first, n, hd, 1e-5f, in, rstd);
  backend->copy(dout, dx);
  backend->head_rmsnorm_backward(dx, in, w, rstd, first, n, hd, dw);
  auto loss = [&] {
    backend->copy(x, y);
    backend->head_rmsnorm_forward(y, w, first, n, hd, 1e-5f, in, rstd);
    return weighted_sum(y, dout);
  };
  expect_gradient_matches(x, values(dx), loss, kFdTol, "dx");  // the untouched heads pass dout through
  expect_gradient_matches(w, values(dw), loss, kFdTol, "dweight");
}

// ---------------------------------------------------------------- activations

TEST_F(OpsTest, GeluForwardMatchesNaiveAcrossRange) {
  Tensor x = f32({1001}, 1, 12.0), out = empty({1001}, DTYPE_F32);
  backend->gelu_forward(x, out);
  const auto xv = values(x);
  std::vector<double> expected(xv.size());
  for (size_t i = 0; i < xv.size(); ++i) {
    const double v = xv[i];
    expected[i] = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
  }
  EXPECT_LT(max_rel_error(values(out), expected), 2e-6);
}

TEST_F(OpsTest, GeluBackwardMatchesFiniteDifferences) {
  Tensor x = f64({3, 37}, 1, 4.0), dout = f64({3, 37}, 2), out = empty({3, 37}), dx = empty({3, 37});
  backend->gelu_backward(x, dout, dx);
  auto loss = [&] {
    backend->gelu_forward(x, out);
    return weighted_sum(out, dout);
  };
  expect_gradient_matches(x, values(dx), loss, kFdTol, "dx");
}

TEST_F(OpsTest, GeluBackwardF32MatchesF64) {
  Tensor x = f32({501}, 1, 8.0), dout = f32({501}, 2), dx = empty({501}, DTYPE_F32);
  Tensor x64 = empty({501}), dout64 = empty({501}), dx64 = empty({501});
  backend->cast(x, x64);
  backend->cast(dout, dout64);
  backend->gelu_backward(x, dout, dx);
  backend->gelu_backward(x64, dout64, dx64);
  EXPECT_LT(max_rel_error(values(dx), values(dx64)), 2e-6);
}

// SwiGLU: silu(g) u; GeGLU (Gemma's gelu_pytorch_tanh): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) u;
// sigmoid (Qwen3-Next's gates): sigmoid(g) u.
TEST_F(OpsTest, GluForwardMatchesNaive) {
  const int64_t N = 5, F = 19;
  for (GateActivation act : {GateActivation::silu, GateActivation::gelu_tanh, GateActivation::sigmoid}) {
    Tensor x = f32({N, 2 * F}, 1, 6.0), out = empty({N, F}, DTYPE_F32);
    backend->glu_forward(x, out, act);
    const auto xv = values(x);
    std::vector<double> expected(N * F);
    for (int64_t r = 0; r < N; ++r) {
      for (int64_t j = 0; j < F; ++j) {
        const double g = xv[r * 2 * F + j], u = xv[r * 2 * F + F + j];
        const double a = act == GateActivation::silu      ? g / (1 + std::exp(-g))
                         : act == GateActivation::sigmoid ? 1 / (1 + std::exp(-g))
                                                          : 0.5 * g * (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g)));
        expected[r * F + j] = a * u;
      }
    }
    EXPECT_LT(max_rel_error(values(out), expected), 2e-6) << enum_name(act);
  }
}

TEST_F(OpsTest, GluBackwardMatchesFiniteDifferences) {
  const int64_t N = 5, F = 7;
  for (GateActivation act : {GateActivation::silu, GateActivation::gelu_tanh, GateActivation::sigmoid}) {
    Tensor x = f64({N, 2 * F}, 1, 4.0), dout = f64({N, F}, 2), out = empty({N, F}), dx = empty({N, 2 * F});
    backend->glu_backward(x, dout, dx, act);
    auto loss = [&] {
      backend->glu_forward(x, out, act);
      return weighted_sum(out, dout);
    };
    expect_gradient_matches(x, values(dx), loss, kFdTol, "dx");
  }
}

// GPT-OSS's clamped SwiGLU against its formula (transformers' GptOssExperts), values on both sides
// of the clamps at +-7, and its backward by finite differences away from the clamps' kinks.
TEST_F(OpsTest, GluSwigluOaiClampsAndMatchesItsFormula) {
  const int64_t N = 6, F = 11;
  Tensor x = f64({N, 2 * F}, 5, 12.0), out = empty({N, F});
  backend->glu_forward(x, out, GateActivation::swiglu_oai);
  const auto xv = values(x);
  std::vector<double> expected(N * F);
  int clamped = 0;
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t j = 0; j < F; ++j) {
      const double g = std::min(xv[r * 2 * F + j], 7.0), u = std::clamp(xv[r * 2 * F + F + j], -7.0, 7.0);
      clamped += (xv[r * 2 * F + j] > 7.0) + (std::abs(xv[r * 2 * F + F + j]) > 7.0);
      expected[r * F + j] = g / (1 + std::exp(-1.702 * g)) * (u + 1);
    }
  }
  EXPECT_GT(clamped, 10);  // both clamps exercised
  EXPECT_LT(max_rel_error(values(out), expected), 1e-14);
  Tensor y = f64({N, 2 * F}, 6, 4.0), dout = f64({N, F}, 7), o2 = empty({N, F}), dx = empty({N, 2 * F});
  for (int64_t i = 0; i < y.numel(); ++i) {  // keep every value a finite-difference step from the kinks
    double& v = y.data<double>()[i];
    if (std::abs(std::abs(v) - 7.0) < 1e-3) v += 0.01;
  }
  backend->glu_backward(y, dout, dx, GateActivation::swiglu_oai);
  auto loss = [&] {
    backend->glu_forward(y, o2, GateActivation::swiglu_oai);
    return weighted_sum(o2, dout);
  };
  expect_gradient_matches(y, values(dx), loss, kFdTol, "dx");
}

// Attention sinks (GPT-OSS): flash attention's output scaled by sigmoid(lse - s_h) equals the
// softmax with the sink logit in its denominator, written naively; and the backward (the sink op
// turning dO into dO', then flash's backward given the true O) gives d(qkv) and d(sinks) by finite
// differences, with and without a window.
TEST_F(OpsTest, AttentionSinksMatchTheSinkColumnSoftmaxAndFiniteDifferences) {
  const int64_t B = 2, T = 6, H = 4, KV = 2, hd = 4, W = (H + 2 * KV) * hd;
  for (const int64_t window : {int64_t{0}, int64_t{3}}) {
    Tensor qkv = f64({B, T, W}, 21, 0.8), sinks = f64({H}, 22, 1.5), w = f64({B, T, H * hd}, 23);
    Tensor out = empty({B, T, H * hd}), lse = empty({B, H, T});
    auto forward = [&] {
      backend->flash_attention_forward(qkv, out, lse, H, KV, window);
      backend->attention_sink_forward(out, lse, sinks, H);
    };
    forward();
    const auto q = values(qkv), o = values(out), s = values(sinks);
    double worst = 0;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t g = h / (H / KV);
        for (int64_t i = 0; i < T; ++i) {
          std::vector<double> x;
          double m = s[h];
          for (int64_t j = 0; j <= i; ++j) {
            const bool visible = window == 0 || j > i - window;
            double d = 0;
            for (int64_t e = 0; e < hd; ++e) d += q[(b * T + i) * W + h * hd + e] * q[(b * T + j) * W + (H + g) * hd + e];
            x.push_back(visible ? d / std::sqrt(static_cast<double>(hd)) : -INFINITY);
            if (visible) m = std::max(m, x.back());
          }
          double z = std::exp(s[h] - m);
          for (double v : x) z += std::exp(v - m);
          for (int64_t e = 0; e < hd; ++e) {
            double acc = 0;
            for (int64_t j = 0; j <= i; ++j) acc += std::exp(x[j] - m) / z * q[(b * T + j) * W + (H + KV + g) * hd + e];
            worst = std::max(worst, std::abs(acc - o[(b * T + i) * H * hd + h * hd + e]));
          }
        }
      }
    }
    EXPECT_LT(worst, 1e-13) << "window " << window;
    Tensor dout = empty({B, T, H * hd}), dqkv = empty({B, T, W}), dsinks = Tensor::zeros(alloc, {H}, DTYPE_F64, MEM_WORKSPACE);
    backend->copy(w, dout);
    backend->attention_sink_backward(dout, out, lse, sinks, dsinks, H);
    backend->flash_attention_backward(dout, qkv, out, lse, dqkv, H, KV, window);
    auto loss = [&] {
      forward();
      return weighted_sum(out, w);
    };
    expect_gradient_matches(qkv, values(dqkv), loss, kFdTol, "dqkv");
    expect_gradient_matches(sinks, values(dsinks), loss, kFdTol, "dsinks");
  }
}

// ---------------------------------------------------------------- RoPE

TEST_F(OpsTest, RopeForwardRotatesHalvesByPositionAngles) {
  const int64_t B = 2, T = 5, hd = 6, heads = 3, W = 5 * hd;  // the last 2 heads (e.g. v) stay untouched
  Tensor x = f64({B, T, W}, 1);
  const auto before = values(x);
  backend->rope_forward(x, hd, heads, RopeSpec{10000.0}, 3);
  const auto after = values(x);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < 5; ++h) {
        for (int64_t j = 0; j < hd / 2; ++j) {
          const int64_t i0 = (b * T + t) * W + h * hd + j, i1 = i0 + hd / 2;
          double e0 = before[i0], e1 = before[i1];
          if (h < heads) {
            const double angle = (3 + t) * std::pow(10000.0, -2.0 * j / hd);
            e0 = before[i0] * std::cos(angle) - before[i1] * std::sin(angle);
            e1 = before[i1] * std::cos(angle) + before[i0] * std::sin(angle);
          }
          EXPECT_NEAR(after[i0], e0, 1e-14);
          EXPECT_NEAR(after[i1], e1, 1e-14);
        }
      }
    }
  }
}

// Partial rotary (Qwen3-Next's partial_rotary_factor): the first rotary_dim = 4 of each head's 10
// dims rotate as pairs (j, j + 2) with d = 4 in the frequencies; the other 6 pass unchanged.
TEST_F(OpsTest, RopePartialRotatesTheFirstRotaryDimsOnly) {
  const int64_t T = 4, hd = 10, heads = 2, rd = 4, W = 3 * hd;
  Tensor x = f64({1, T, W}, 7);
  const auto before = values(x);
  RopeSpec spec{10000.0};
  spec.rotary_dim = rd;
  backend->rope_forward(x, hd, heads, spec, 2);
  const auto after = values(x);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < 3; ++h) {
      for (int64_t i = 0; i < hd; ++i) {
        const int64_t at = t * W + h * hd + i;
        double e = before[at];
        if (h < heads && i < rd) {
          const int64_t j = i % (rd / 2), other = i < rd / 2 ? at + rd / 2 : at - rd / 2;
          const double angle = (2 + t) * std::pow(10000.0, -2.0 * j / rd);
          e = i < rd / 2 ? before[at] * std::cos(angle) - before[other] * std::sin(angle)
                         : before[at] * std::cos(angle) + before[other] * std::sin(angle);
        }
        EXPECT_NEAR(after[at], e, 1e-14) << "t " << t << " head " << h << " dim " << i;
      }
    }
  }
}

// YaRN without truncation (GPT-OSS's truncate = false): the ramp's ends are not rounded, so a pair
// between them takes a fractional blend — different from the truncated ramp's.
TEST_F(OpsTest, RopeYarnWithoutTruncationKeepsTheRampsFractionalEnds) {
  RopeSpec r{150000.0, ROPE_SCALING_YARN, 32.0, 1.0, 4.0, 4096.0, 32.0, 1.0, 1.0};
  const int64_t d = 64;
  const double two_pi = 2 * M_PI, log_theta = 2 * std::log(150000.0);
  const double low = std::max(0.0, d * std::log(4096.0 / (32.0 * two_pi)) / log_theta);
  const double high = std::min(d - 1.0, d * std::log(4096.0 / (1.0 * two_pi)) / log_theta);
  r.yarn_truncate = false;
  int differ = 0;
  for (int64_t j = 0; j < d / 2; ++j) {
    const double base = std::pow(150000.0, -2.0 * j / d);
    const double ramp = std::clamp((j - low) / (high - low), 0.0, 1.0);
    EXPECT_NEAR(rope_inv_freq(r, j, d), base / 32.0 * ramp + base * (1 - ramp), 1e-15 * base) << j;
    RopeSpec t = r;
    t.yarn_truncate = true;
    differ += rope_inv_freq(t, j, d) != rope_inv_freq(r, j, d);
  }
  EXPECT_GT(differ, 0);
}

// Llama 3.1's rescaled frequencies, written as its reference does (torch.where over the three
// bands), linear scaling and YaRN (the ramp between the rounded correction dimensions, cos and
// sin times the attention factor), against the op at positions past the original context.
// LongRoPE (Phi-3 128k): pair j's frequency divided by short_factor[j] while the rotated span ends
// within the original context (8), by long_factor[j] once it reaches past it, cos and sin times
// the amplitude: a span [3, 8) takes the short factors, [3, 9) the long ones, and the one-row spans
// decoding rotates choose by their own position.
TEST_F(OpsTest, RopeLongRopePicksShortOrLongFactorsBySpan) {
  const int64_t hd = 6, heads = 1;
  RopeSpec r{10000.0, ROPE_SCALING_LONGROPE};
  r.original_context = 8.0, r.amplitude = 1.25;
  const float short_f[3] = {1.0f, 1.5f, 2.0f}, long_f[3] = {1.0f, 4.0f, 16.0f};
  std::copy(short_f, short_f + 3, r.short_factor);
  std::copy(long_f, long_f + 3, r.long_factor);
  for (const int64_t T : {int64_t{5}, int64_t{6}, int64_t{1}}) {
    const int64_t offset = T == 1 ? 8 : 3;  // a decoding row at position 8: past the context, long
    const bool use_long = offset + T > 8;
    Tensor x = f64({1, T, hd}, 7);
    const auto before = values(x);
    backend->rope_forward(x, hd, heads, r, offset);
    const auto after = values(x);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < hd / 2; ++j) {
        const double f = (use_long ? long_f : short_f)[j];
        const double angle = (offset + t) * std::pow(10000.0, -2.0 * j / hd) / f;
        const int64_t i0 = t * hd + j, i1 = i0 + hd / 2;
        EXPECT_NEAR(after[i0], 1.25 * (before[i0] * std::cos(angle) - before[i1] * std::sin(angle)), 1e-12) << T;
        EXPECT_NEAR(after[i1], 1.25 * (before[i1] * std::cos(angle) + before[i0] * std::sin(angle)), 1e-12) << T;
      }
    }
  }
}

TEST_F(OpsTest, RopeScalingLlama3LinearAndYarnMatchTheirFormulas) {
  const int64_t T = 3, hd = 16, pos = 200;
  const double theta = 10000.0, factor = 8.0, low = 1.0, high = 4.0, context = 64.0;
  auto llama3 = [&](int64_t j) {
    const double inv = 1.0 / std::pow(theta, static_cast<double>(2 * j) / hd);
    const double wavelen = 2.0 * M_PI / inv;
    const double scaled = wavelen > context / low ? inv / factor : inv;
    const double smooth = (context / wavelen - low) / (high - low);
    const double smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled;
    const bool medium = !(wavelen < context / high) && !(wavelen > context / low);
    return medium ? smoothed : scaled;
  };
  int bands[3] = {0, 0, 0};  // kept, blended, divided: each must occur
  for (int64_t j = 0; j < hd / 2; ++j) {
    const double inv = 1.0 / std::pow(theta, static_cast<double>(2 * j) / hd), f = llama3(j);
    bands[f == inv ? 0 : (std::abs(f - inv / factor) < 1e-18 ? 2 : 1)]++;
  }
  ASSERT_TRUE(bands[0] > 0 && bands[1] > 0 && bands[2] > 0);
  // YaRN with beta 32 / 1 over a context of 64: correction dims floor(-0.37) -> 0 and ceil(2.3) = 3.
  auto yarn = [&](int64_t j) {
    const double inv = 1.0 / std::pow(theta, static_cast<double>(2 * j) / hd);
    auto corr = [&](double rotations) { return hd * std::log(context / (rotations * 2.0 * M_PI)) / (2.0 * std::log(theta)); };
    const double lo = std::max(std::floor(corr(32.0)), 0.0), hi = std::min(std::ceil(corr(1.0)), double(hd - 1));
    const double ramp = std::clamp((static_cast<double>(j) - lo) / (hi - lo), 0.0, 1.0);
    return inv / factor * ramp + inv * (1.0 - ramp);
  };
  EXPECT_EQ(yarn(0), 1.0);  // the fastest pair keeps its frequency, the slowest is divided
  EXPECT_NEAR(yarn(hd / 2 - 1), 1.0 / std::pow(theta, static_cast<double>(hd - 2) / hd) / factor, 1e-18);
  const double amplitude = 1.2;
  const RopeSpec specs[] = {{theta, ROPE_SCALING_LLAMA3, factor, low, high, context},
                            {theta, ROPE_SCALING_LINEAR, factor, low, high, context},
                            {theta, ROPE_SCALING_YARN, factor, low, high, context, 32.0, 1.0, amplitude}};
  for (const RopeSpec& spec : specs) {
    Tensor x = f64({1, T, hd}, 3);
    const auto before = values(x);
    backend->rope_forward(x, hd, 1, spec, pos);
    const auto after = values(x);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < hd / 2; ++j) {
        const double inv = spec.scaling == ROPE_SCALING_LLAMA3 ? llama3(j)
                           : spec.scaling == ROPE_SCALING_YARN ? yarn(j)
                                                               : 1.0 / std::pow(theta, static_cast<double>(2 * j) / hd) / factor;
        const double angle = static_cast<double>(pos + t) * inv, a = spec.amplitude;
        const int64_t i0 = t * hd + j, i1 = i0 + hd / 2;
        EXPECT_NEAR(after[i0], a * (before[i0] * std::cos(angle) - before[i1] * std::sin(angle)), 1e-12) << j;
        EXPECT_NEAR(after[i1], a * (before[i1] * std::cos(angle) + before[i0] * std::sin(angle)), 1e-12) << j;
      }
    }
  }
}

TEST_F(OpsTest, RopeBackwardMatchesFiniteDifferences) {
  const int64_t B = 2, T = 5, hd = 4, W = 3 * hd;
  Tensor x = f64({B, T, W}, 1), dout = f64({B, T, W}, 2), y = empty({B, T, W});
  Tensor dx = empty({B, T, W});
  backend->copy(dout, dx);
  // llama3 scaling, and YaRN's amplitude (the backward is the transpose: the inverse rotation times it).
  for (const RopeSpec& rope : {RopeSpec{500.0, ROPE_SCALING_LLAMA3, 4.0, 1.0, 2.0, 40.0},
                               RopeSpec{500.0, ROPE_SCALING_YARN, 4.0, 1.0, 4.0, 40.0, 32.0, 1.0, 1.3}}) {
    backend->copy(dout, dx);
    backend->rope_backward(dx, hd, 2, rope, 0);
    auto loss = [&] {
      backend->copy(x, y);
      backend->rope_forward(y, hd, 2, rope, 0);
      return weighted_sum(y, dout);
    };
    expect_gradient_matches(x, values(dx), loss, kFdTol, "dx");
  }
}

// ---------------------------------------------------------------- attention

std::vector<double> naive_attention(const std::vector<double>& qkv, int64_t B, int64_t T, int64_t H, int64_t KV,
                                    int64_t hd) {
  const int64_t W = (H + 2 * KV) * hd;
  std::vector<double> out(B * T * H * hd, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / KV);
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> s(i + 1);
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d) dot += qkv[(b * T + i) * W + h * hd + d] * qkv[(b * T + j) * W + (H + g) * hd + d];
          s[j] = dot / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[j]);
        }
        for (auto& v : s) sum += (v = std::exp(v - mx));
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t d = 0; d < hd; ++d) {
            out[(b * T + i) * H * hd + h * hd + d] += s[j] / sum * qkv[(b * T + j) * W + (H + KV + g) * hd + d];
          }
        }
      }
    }
  }
  return out;
}

TEST_F(OpsTest, AttentionForwardMatchesNaiveForMhaAndGqa) {
  for (auto [H, KV] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}, {3, 1}}) {
    const int64_t B = 2, T = 13, hd = 8;
    Tensor qkv = f32({B, T, (H + 2 * KV) * hd}, 1, 2.0);
    Tensor out = empty({B, T, H * hd}, DTYPE_F32), probs = empty({B, H, T, T}, DTYPE_F32);
    backend->attention_forward(qkv, out, probs, H, KV, 0);
    EXPECT_LT(max_rel_error(values(out), naive_attention(values(qkv), B, T, H, KV, hd)), 2e-6) << "H " << H << " KV " << KV;
    const float* p = probs.data<float>();
    double row_sum = 0;
    for (int64_t j = 0; j < T; ++j) row_sum += p[(T - 2) * T + j];
    EXPECT_NEAR(row_sum, 1.0, 1e-6);
    EXPECT_EQ(p[(T - 2) * T + (T - 1)], 0.0f);  // causal: no weight on the future
  }
}

TEST_F(OpsTest, AttentionBackwardMatchesFiniteDifferencesWithGqa) {
  const int64_t B = 2, T = 7, H = 4, KV = 2, hd = 3;
  Tensor qkv = f64({B, T, (H + 2 * KV) * hd}, 1, 1.5), dout = f64({B, T, H * hd}, 2);
  Tensor out = empty({B, T, H * hd}), probs = empty({B, H, T, T}), dqkv = f64({B, T, (H + 2 * KV) * hd}, 3);
  backend->attention_forward(qkv, out, probs, H, KV, 0);
  backend->attention_backward(dout, qkv, out, probs, dqkv, H, KV, 0);
  auto loss = [&] {
    backend->attention_forward(qkv, out, probs, H, KV, 0);
    return weighted_sum(out, dout);
  };
  expect_gradient_matches(qkv, values(dqkv), loss, kFdTol, "dqkv");
}

// The f32 path (oneDNN GEMMs) against the f64 path (the finite-difference-checked one), GQA.
TEST_F(OpsTest, AttentionF32MatchesF64ForwardAndBackward) {
  const int64_t B = 2, T = 37, H = 6, KV = 2, hd = 16, W = (H + 2 * KV) * hd;
  Tensor qkv = f32({B, T, W}, 1, 2.0), dout = f32({B, T, H * hd}, 2);
  Tensor out = empty({B, T, H * hd}, DTYPE_F32), probs = empty({B, H, T, T}, DTYPE_F32), dqkv = empty({B, T, W}, DTYPE_F32);
  Tensor qkv64 = empty({B, T, W}), dout64 = empty({B, T, H * hd}), out64 = empty({B, T, H * hd});
  Tensor probs64 = empty({B, H, T, T}), dqkv64 = empty({B, T, W});
  backend->cast(qkv, qkv64);
  backend->cast(dout, dout64);
  backend->attention_forward(qkv, out, probs, H, KV, 0);
  backend->attention_backward(dout, qkv, out, probs, dqkv, H, KV, 0);
  backend->attention_forward(qkv64, out64, probs64, H, KV, 0);
  backend->attention_backward(dout64, qkv64, out64, probs64, dqkv64, H, KV, 0);
  EXPECT_LT(max_rel_error(values(out), values(out64)), 2e-6);
  EXPECT_LT(max_rel_error(values(dqkv), values(dqkv64)), 1e-5);
}

// ---------------------------------------------------------------- sliding-window attention

// Sliding-window attention (Beltagy et al. 2020; Jiang et al. 2023) written the slow way, in
// double: the (T, T) score matrix with -inf outside i - W < j <= i, a softmax over each full
// row, out = P V; the backward from P: dP = dO V^T, dS = scale P o (dP - rowsum(P o dP)),
// dQ = dS K, dK = dS^T Q, dV = P^T dO (summed over the group's query heads).
struct NaiveWindowAttention {
  std::vector<double> out, probs, dqkv;
};

NaiveWindowAttention naive_window_attention(const std::vector<double>& qkv, const std::vector<double>& dout, int64_t B,
                                            int64_t T, int64_t H, int64_t KV, int64_t hd, int64_t window) {
  const int64_t W = (H + 2 * KV) * hd, OW = H * hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  NaiveWindowAttention r{std::vector<double>(B * T * OW, 0.0), std::vector<double>(B * H * T * T, 0.0),
                         std::vector<double>(B * T * W, 0.0)};
  auto q = [&](int64_t b, int64_t t, int64_t h, int64_t d) { return qkv[(b * T + t) * W + h * hd + d]; };
  auto k = [&](int64_t b, int64_t t, int64_t g, int64_t d) { return qkv[(b * T + t) * W + (H + g) * hd + d]; };
  auto v = [&](int64_t b, int64_t t, int64_t g, int64_t d) { return qkv[(b * T + t) * W + (H + KV + g) * hd + d]; };
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / KV);
      double* P = r.probs.data() + (b * H + h) * T * T;
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> s(T);
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < T; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d) dot += q(b, i, h, d) * k(b, j, g, d);
          s[j] = (j <= i && j > i - window) ? dot * scale : -INFINITY;
          mx = std::max(mx, s[j]);
        }
        for (auto& x : s) sum += (x = std::exp(x - mx));
        for (int64_t j = 0; j < T; ++j) P[i * T + j] = s[j] / sum;
      }
      for (int64_t i = 0; i < T; ++i) {
        for (int64_t j = 0; j < T; ++j) {
          for (int64_t d = 0; d < hd; ++d) r.out[(b * T + i) * OW + h * hd + d] += P[i * T + j] * v(b, j, g, d);
        }
      }
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> dp(T);
        double rowsum = 0;
        for (int64_t j = 0; j < T; ++j) {
          for (int64_t d = 0; d < hd; ++d) dp[j] += dout[(b * T + i) * OW + h * hd + d] * v(b, j, g, d);
          rowsum += P[i * T + j] * dp[j];
        }
        for (int64_t j = 0; j < T; ++j) {
          const double ds = scale * P[i * T + j] * (dp[j] - rowsum);
          for (int64_t d = 0; d < hd; ++d) {
            r.dqkv[(b * T + i) * W + h * hd + d] += ds * k(b, j, g, d);
            r.dqkv[(b * T + j) * W + (H + g) * hd + d] += ds * q(b, i, h, d);
            r.dqkv[(b * T + j) * W + (H + KV + g) * hd + d] += P[i * T + j] * dout[(b * T + i) * OW + h * hd + d];
          }
        }
      }
    }
  }
  return r;
}

// "1.23e-07": an error figure for RecordProperty (--gtest_output=json shows it).
std::string scientific(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2e", x);
  return buf;
}

// f32 kernels against the double masked softmax: out, the (T, T) probabilities (0 outside the
// window) and dqkv, for GPT-2's MHA and Llama's GQA head layouts, windows 1, 3 and T - 1.
TEST_F(OpsTest, AttentionWindowMatchesNaiveMaskedSoftmaxForMhaAndGqa) {
  const int64_t B = 2, T = 45, hd = 8;  // T > 32: several tiles of query rows
  double worst_out = 0, worst_probs = 0, worst_grad = 0;
  for (auto [H, KV] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}}) {
    for (int64_t window : {int64_t{1}, int64_t{3}, T - 1}) {
      Tensor qkv = f32({B, T, (H + 2 * KV) * hd}, 1, 2.0), dout = f32({B, T, H * hd}, 2);
      Tensor out = empty({B, T, H * hd}, DTYPE_F32), probs = empty({B, H, T, T}, DTYPE_F32);
      Tensor dqkv = empty({B, T, (H + 2 * KV) * hd}, DTYPE_F32);
      backend->attention_forward(qkv, out, probs, H, KV, window);
      backend->attention_backward(dout, qkv, out, probs, dqkv, H, KV, window);
      const NaiveWindowAttention ref = naive_window_attention(values(qkv), values(dout), B, T, H, KV, hd, window);
      const double e_out = max_rel_error(values(out), ref.out), e_probs = max_rel_error(values(probs), ref.probs);
      const double e_grad = max_rel_error(values(dqkv), ref.dqkv);
      EXPECT_LT(e_out, 2e-6) << "H " << H << " KV " << KV << " window " << window;
      EXPECT_LT(e_probs, 2e-6) << "H " << H << " KV " << KV << " window " << window;
      EXPECT_LT(e_grad, 1e-5) << "H " << H << " KV " << KV << " window " << window;
      worst_out = std::max(worst_out, e_out), worst_probs = std::max(worst_probs, e_probs);
      worst_grad = std::max(worst_grad, e_grad);
      EXPECT_EQ(probs.data<float>()[(T - 1) * T + (T - 1 - window)], 0.0f) << "window " << window;  // just outside
    }
  }
  RecordProperty("max_rel_error_out", scientific(worst_out));
  RecordProperty("max_rel_error_probs", scientific(worst_probs));
  RecordProperty("max_rel_error_dqkv", scientific(worst_grad));
}

TEST_F(OpsTest, AttentionWindowBackwardMatchesFiniteDifferences) {
  const int64_t B = 1, T = 37, hd = 3;  // T > 32: several tiles of query rows
  for (auto [H, KV] : {std::pair<int64_t, int64_t>{3, 3}, {4, 2}}) {
    for (int64_t window : {int64_t{1}, int64_t{3}, T - 1}) {
      Tensor qkv = f64({B, T, (H + 2 * KV) * hd}, 1, 1.5), dout = f64({B, T, H * hd}, 2);
      Tensor out = empty({B, T, H * hd}), probs = empty({B, H, T, T}), dqkv = f64({B, T, (H + 2 * KV) * hd}, 3);
      backend->attention_forward(qkv, out, probs, H, KV, window);
      backend->attention_backward(dout, qkv, out, probs, dqkv, H, KV, window);
      auto loss = [&] {
        backend->attention_forward(qkv, out, probs, H, KV, window);
        return weighted_sum(out, dout);
      };
      SCOPED_TRACE("H " + std::to_string(H) + " KV " + std::to_string(KV) + " window " + std::to_string(window));
      expect_gradient_matches(qkv, values(dqkv), loss, kFdTol, "dqkv");
    }
  }
}

// A window that covers the whole sequence is full causal attention, bit for bit.
TEST_F(OpsTest, AttentionWindowOfSeqLenOrMoreEqualsFullAttentionBitwise) {
  const int64_t B = 2, T = 13, H = 6, KV = 2, hd = 8, W = (H + 2 * KV) * hd;
  Tensor qkv = f32({B, T, W}, 1, 2.0), dout = f32({B, T, H * hd}, 2);
  auto run = [&](int64_t window) {
    Tensor out = empty({B, T, H * hd}, DTYPE_F32), probs = empty({B, H, T, T}, DTYPE_F32), dqkv = empty({B, T, W}, DTYPE_F32);
    backend->attention_forward(qkv, out, probs, H, KV, window);
    backend->attention_backward(dout, qkv, out, probs, dqkv, H, KV, window);
    return std::vector<std::vector<double>>{values(out), values(probs), values(dqkv)};
  };
  const auto full = run(0);
  EXPECT_EQ(run(T), full);
  EXPECT_EQ(run(T + 5), full);
  EXPECT_NE(run(T - 1), full);
}

// The full causal kernels run in blocks of 64 query rows over keys [0, i1) (cpu_kernels.h
// kCausalRows): at T = 150 (blocks of 64, 64, 22) forward and backward, fp32 and f64, against the
// naive double attention (window >= T: full causal), GQA and MHA.
TEST_F(OpsTest, AttentionCausalBlocksMatchNaive) {
  const int64_t B = 2, T = 150, hd = 16;
  for (auto [H, KV] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}}) {
    for (const DType dtype : {DTYPE_F32, DTYPE_F64}) {
      Tensor qkv32 = f32({B, T, (H + 2 * KV) * hd}, 1, 2.0), dout32 = f32({B, T, H * hd}, 2);
      Tensor qkv = empty({B, T, (H + 2 * KV) * hd}, dtype), dout = empty({B, T, H * hd}, dtype);
      backend->cast(qkv32, qkv), backend->cast(dout32, dout);
      Tensor out = empty({B, T, H * hd}, dtype), probs = empty({B, H, T, T}, dtype);
      Tensor dqkv = empty({B, T, (H + 2 * KV) * hd}, dtype);
      backend->attention_forward(qkv, out, probs, H, KV, 0);
      backend->attention_backward(dout, qkv, out, probs, dqkv, H, KV, 0);
      const NaiveWindowAttention ref = naive_window_attention(values(qkv), values(dout), B, T, H, KV, hd, T);
      const bool f = dtype == DTYPE_F32;
      EXPECT_LT(max_rel_error(values(out), ref.out), f ? 2e-6 : 1e-12) << H << " " << KV << " " << f;
      EXPECT_LT(max_rel_error(values(probs), ref.probs), f ? 2e-6 : 1e-12) << H << " " << KV << " " << f;
      EXPECT_LT(max_rel_error(values(dqkv), ref.dqkv), f ? 1e-5 : 1e-12) << H << " " << KV << " " << f;
    }
  }
}

// precision.attention = bf16 (Backend::attention_forward_bf16 / _backward_bf16) against the
// naive double attention at T = 150 (three row blocks), MHA and GQA. Every GEMM operand is
// rounded to bf16 (unit roundoff u = 2^-8): a product of two rounded operands is off by up to
// 2u relative, so S, O and each backward product are within a few u of the largest entry, and
// the softmax turns S's absolute error into P's relative one. Bounds: out and probs 1e-2 (2.5u),
// dqkv 2e-2 (5u: two rounded products in a row) of the largest; measured 4.6e-3, 3.0e-3 and
// 4.2e-3. Above 1e-4, so the fp32 kernels would fail the last check (bf16 really ran). The
// results do not depend on the thread count.
TEST_F(OpsTest, AttentionBf16GemmsTrackTheDoubleAttention) {
  const int64_t B = 2, T = 150, hd = 16;
  for (auto [H, KV] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}}) {
    const int64_t W = (H + 2 * KV) * hd;
    Tensor qkv = f32({B, T, W}, 1, 2.0), dout = f32({B, T, H * hd}, 2);
    const NaiveWindowAttention ref = naive_window_attention(values(qkv), values(dout), B, T, H, KV, hd, T);
    std::vector<std::vector<double>> runs;
    for (const int threads : {1, 3}) {
      const int was = omp_get_max_threads();
      omp_set_num_threads(threads);
      Tensor out = empty({B, T, H * hd}, DTYPE_F32), probs = empty({B, H, T, T}, DTYPE_F32), dqkv = empty({B, T, W}, DTYPE_F32);
      backend->attention_forward_bf16(qkv, out, probs, H, KV);
      backend->attention_backward_bf16(dout, qkv, out, probs, dqkv, H, KV);
      omp_set_num_threads(was);
      const double e_out = max_rel_error(values(out), ref.out), e_probs = max_rel_error(values(probs), ref.probs);
      const double e_grad = max_rel_error(values(dqkv), ref.dqkv);
      std::printf("bf16 attention H %lld KV %lld, %d threads: out %.1e, probs %.1e, dqkv %.1e of the largest\n",
                  static_cast<long long>(H), static_cast<long long>(KV), threads, e_out, e_probs, e_grad);
      EXPECT_LT(e_out, 1e-2);
      EXPECT_LT(e_probs, 1e-2);
      EXPECT_LT(e_grad, 2e-2);
      EXPECT_GT(e_grad, 1e-4);
      std::vector<double> all = values(out);
      for (const double v : values(dqkv)) all.push_back(v);
      runs.push_back(all);
    }
    EXPECT_EQ(runs[0], runs[1]) << "1 and 3 threads";
  }
}

TEST_F(OpsTest, AttentionRejectsNegativeWindow) {
  const int64_t B = 1, T = 4, H = 2, KV = 2, hd = 4;
  Tensor qkv = f32({B, T, (H + 2 * KV) * hd}, 1), out = empty({B, T, H * hd}, DTYPE_F32);
  Tensor probs = empty({B, H, T, T}, DTYPE_F32);
  EXPECT_THROW(backend->attention_forward(qkv, out, probs, H, KV, -1), Error);
}

// ---------------------------------------------------------------- cross-entropy

TEST_F(OpsTest, CrossEntropyForwardMatchesNaive) {
  const int64_t N = 9, V = 1001;
  Tensor logits = f32({N, V}, 1, 20.0), losses = empty({N}, DTYPE_F32), lse = empty({N}, DTYPE_F32);
  Tensor targets = random_tokens(alloc, {N}, V, 2);
  backend->cross_entropy_forward(logits, targets, losses, lse);
  const auto x = values(logits);
  std::vector<double> expected(N);
  for (int64_t r = 0; r < N; ++r) {
    double mx = -1e300, sum = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, x[r * V + v]);
    for (int64_t v = 0; v < V; ++v) sum += std::exp(x[r * V + v] - mx);
    expected[r] = mx + std::log(sum) - x[r * V + targets.data<int32_t>()[r]];
  }
  EXPECT_LT(max_rel_error(values(losses), expected), 2e-6);
}

TEST_F(OpsTest, CrossEntropyBackwardMatchesFiniteDifferencesInPlace) {
  const int64_t N = 5, V = 11;
  Tensor logits = f64({N, V}, 1, 3.0), losses = empty({N}), lse = empty({N}), weights = f64({N}, 5);
  Tensor targets = random_tokens(alloc, {N}, V, 2);
  auto loss = [&] {
    backend->cross_entropy_forward(logits, targets, losses, lse);
    return weighted_sum(losses, weights);
  };
  // With per-row weights w_r the gradient is w_r (softmax - onehot): run the fused backward row by row.
  loss();
  Tensor dlogits = empty({N, V});
  backend->copy(logits, dlogits);
  for (int64_t r = 0; r < N; ++r) {
    backend->cross_entropy_backward(dlogits.slice0(r, r + 1), targets.slice0(r, r + 1), lse.slice0(r, r + 1),
                                    static_cast<float>(weights.data<double>()[r]), dlogits.slice0(r, r + 1));
  }
  // dloss is passed as float: compare at float precision of the weight.
  expect_gradient_matches(logits, values(dlogits), loss, 1e-6, "dlogits");
}

// cpu::max_of (the vectorized row maximum of softmax and cross-entropy) is the maximum for every
// length around its lane blocks, NaNs after the first element skipped as std::max skips them.
TEST_F(OpsTest, RowMaximumIsTheMaximumSkippingNaNs) {
  for (const int64_t n : {1, 7, 15, 16, 17, 31, 32, 33, 100, 1003}) {
    std::vector<float> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = std::sin(0.37f * static_cast<float>(i * i)) * 50.0f;
    float expected = x[0];
    for (float v : x) expected = std::max(expected, v);
    EXPECT_EQ(cpu::max_of(x.data(), n), expected) << n;
    if (n > 5) {
      x[5] = NAN;
      EXPECT_EQ(cpu::max_of(x.data(), n), n > 5 ? [&] { float m = x[0]; for (float v : x) m = std::max(m, v); return m; }() : 0.0f) << n;
    }
    std::vector<double> d(x.begin(), x.end());
    double de = d[0];
    for (double v : d) de = std::max(de, v);
    EXPECT_EQ(cpu::max_of(d.data(), n), de) << n;
  }
}

// cast to bf16 (vectorized, branch-free) rounds exactly as core/dtype.h's f32_to_bf16: random
// values over many binades, ties to even both ways, the largest finite value (rounds to inf),
// infinities, signed zeros, subnormals and NaNs (kept quiet).
TEST_F(OpsTest, CastToBf16RoundsAsF32ToBf16) {
  const Tensor random = f32({5000}, 3, 1e3);
  std::vector<float> x(random.data<float>(), random.data<float>() + random.numel());
  for (int e = -140; e < 128; e += 7) x.push_back(std::ldexp(1.2345f, e));
  for (const uint32_t bits : {0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0x7f800000u, 0xff800000u, 0x80000000u, 0u,
                              0x00000001u, 0x807fffffu, 0x7fc00000u, 0x7f800001u, 0xffa00000u, 0x3f80ffffu}) {
    float v;
    std::memcpy(&v, &bits, sizeof(v));
    x.push_back(v);
  }
  const int64_t n = static_cast<int64_t>(x.size());
  Tensor src = empty({n}, DTYPE_F32), dst = empty({n}, DTYPE_BF16);
  backend->write(src, x.data());
  backend->cast(src, dst);
  const bf16* got = dst.data<bf16>();
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; ++i) mismatches += got[i].bits != f32_to_bf16(x[static_cast<size_t>(i)]).bits;
  EXPECT_EQ(mismatches, 0);
}

// The loss and its gradient in one call are bitwise the two ops (and the cast, for a bf16
// gradient), masked rows included, whatever the thread count's row split; a gradient neither
// in place nor bf16 is refused.
TEST_F(OpsTest, CrossEntropyLossAndGradIsBitwiseTheForwardThenTheBackward) {
  const int64_t N = 37, V = 1003;
  for (const bool to_bf16 : {false, true}) {
    const Tensor logits = f32({N, V}, 1, 8.0);
    Tensor targets = random_tokens(alloc, {N}, V, 2);
    targets.data<int32_t>()[3] = kIgnoreTarget, targets.data<int32_t>()[N - 1] = kIgnoreTarget;
    Tensor ref = empty({N, V}, DTYPE_F32), fused = empty({N, V}, DTYPE_F32);
    backend->copy(logits, ref), backend->copy(logits, fused);
    Tensor losses = empty({N}, DTYPE_F32), lse = empty({N}, DTYPE_F32), losses2 = empty({N}, DTYPE_F32),
           lse2 = empty({N}, DTYPE_F32);
    backend->cross_entropy_forward(ref, targets, losses, lse);
    backend->cross_entropy_backward(ref, targets, lse, 0.0123f, ref);
    Tensor expected = ref, got = fused;
    if (to_bf16) {
      expected = empty({N, V}, DTYPE_BF16), got = empty({N, V}, DTYPE_BF16);
      backend->cast(ref, expected);
    }
    backend->cross_entropy_loss_and_grad(fused, targets, losses2, lse2, 0.0123f, got);
    EXPECT_EQ(values(losses2), values(losses));
    EXPECT_EQ(values(lse2), values(lse));
    if (to_bf16) {
      const uint16_t* a = reinterpret_cast<const uint16_t*>(got.raw_data());
      const uint16_t* b = reinterpret_cast<const uint16_t*>(expected.raw_data());
      EXPECT_TRUE(std::equal(a, a + N * V, b)) << "bf16 gradient";
    } else {
      EXPECT_EQ(values(got), values(expected));
    }
    EXPECT_EQ(values(losses)[3], 0.0);  // a masked row: no loss ...
    EXPECT_EQ(values(ref)[3 * V + 5], 0.0);  // ... and no gradient
  }
  Tensor logits = f32({2, 5}, 1), other = f32({2, 5}, 2), losses = empty({2}, DTYPE_F32), lse = empty({2}, DTYPE_F32);
  EXPECT_THROW(backend->cross_entropy_loss_and_grad(logits, random_tokens(alloc, {2}, 5, 1), losses, lse, 1.0f, other),
               Error);
}

TEST_F(OpsTest, CrossEntropyRejectsTargetOutsideVocab) {
  Tensor logits = f32({2, 5}, 1), losses = empty({2}, DTYPE_F32), lse = empty({2}, DTYPE_F32);
  Tensor targets = random_tokens(alloc, {2}, 5, 1);
  targets.data<int32_t>()[1] = -1;
  EXPECT_THROW(backend->cross_entropy_forward(logits, targets, losses, lse), Error);
}

// ---------------------------------------------------------------- AdamW

TEST_F(OpsTest, AdamWStepWithGradScaleMatchesNaiveFloat64) {
  const int64_t n = 101;
  Tensor p = f32({n}, 1), g = f32({n}, 2), m = zeros({n}, DTYPE_F32), v = zeros({n}, DTYPE_F32);
  std::vector<double> pr = values(p), mr(n, 0.0), vr(n, 0.0);
  const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  for (int64_t step = 1; step <= 3; ++step) {
    backend->adamw_step(p, g, m, v, AdamWHyper{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, step});
    std::vector<double> gv = values(g);
    for (double& x : gv) x *= 0.5;  // grad_scale (fused clipping)
    for (int64_t i = 0; i < n; ++i) {
      pr[i] -= lr * wd * pr[i];
      mr[i] = b1 * mr[i] + (1 - b1) * gv[i];
      vr[i] = b2 * vr[i] + (1 - b2) * gv[i] * gv[i];
      pr[i] -= lr * (mr[i] / (1 - std::pow(b1, step))) / (std::sqrt(vr[i] / (1 - std::pow(b2, step))) + eps);
    }
  }
  EXPECT_LT(max_rel_error(values(p), pr), 1e-6);
}

}  // namespace
}  // namespace loom
