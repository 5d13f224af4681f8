// Qwen3-Next's linear-attention helpers on the CPU backend (backend.h): the causal depthwise
// convolution with SiLU (Backend::causal_conv1d_silu_forward / _backward: transformers'
// Qwen3NextGatedDeltaNet conv1d + F.silu, with a carried (B, K-1, C) state) and the gated delta
// rule's gates (Backend::delta_gates_forward / _backward: beta = sigmoid(b), g = -exp(a_log)
// softplus(a + dt_bias), torch's softplus threshold 20).
//   1. conv against a naive double loop (f64 within 1e-12, f32 within 5e-6 absolute), K = 4,
//      T in {1, 2, 7} (T < K-1 included), with and without an initial state; final_state exactly
//      the last K-1 rows of [initial; x] (zeros before position 0 without an initial state);
//   2. conv split sequences (context parallelism's pieces, decoding token by token) equal the
//      whole run: forward bitwise, and the backward's pieces, with the second piece's dinitial
//      routed into the first piece's dx / dinitial through the final state, within 1e-12 (f64);
//   3. conv backward against f64 central differences for x, weight and initial (1e-7), dx and
//      dinitial overwritten, dweight accumulated;
//   4. gates against the formulas (f64 1e-14, f32 1e-6 relative; both softplus branches:
//      a + dt_bias from -30 to 100), the backward against the derivative formulas and f64
//      central differences (1e-7), da_log and ddt_bias accumulated;
//   5. bad operands: one-line errors naming the tensor and the expected shape;
//   6. the strict backend (tests/strict_backend.h) forwards the four ops to the CPU kernels.
// The broken variants each test is written to catch (those marked [run] were built and run
// against these tests, with the failures noted):
//  - conv taps reversed (weight[c, K-1-i], the cross-correlation / convolution mix-up):
//    ConvMatchesNaive (y), ConvBackwardMatchesFiniteDifferences does not (it is consistent);
//  - initial ignored, or its rows taken in the wrong order: ConvMatchesNaive (with initial),
//    ConvSplitSequenceMatchesWhole;
//  - final_state taken as x's last K-1 rows even when T < K-1 (reading before x), or not mixing
//    initial's rows: ConvMatchesNaive's final state at T = 1 and 2, ConvSplitSequenceMatchesWhole
//    (decoding token by token);
//  - SiLU's derivative as s (1 - s) z or missing the s term: ConvBackwardMatchesFiniteDifferences
//    (x, weight, initial);
//  - [run] dweight overwritten instead of accumulated: ConvBackwardMatchesFiniteDifferences (off by
//    the 0.25 it starts from) and ConvSplitSequenceMatchesWhole's backward (two pieces into one
//    dweight: 0.78 to 1.1 relative);
//  - dinitial missing the taps of later outputs (only t = 0): ConvBackwardMatchesFiniteDifferences;
//  - [run] softplus without torch's threshold: GatesMatchFormulas (f64: g 1.5e-11 relative to the
//    largest, 6e-11 per element at 20.5 and 5.6e-13 at 25; f32: exp(100) overflows, g inf);
//    its derivative as sigmoid above
//    20: GatesMatchFormulas's backward (1 - sigmoid(25) = 1.4e-11 relative in f64);
//  - da_log as dg * softplus (missing -exp(a_log)) or ddt_bias without the exp(a_log) factor:
//    GatesBackwardMatchesFiniteDifferences, GatesMatchFormulas;
//  - b and a swapped in ba: GatesMatchFormulas.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/error.h"
#include "loom/core/philox.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

using test::error_of;
using test::max_rel_error;
using test::values;
using test::weighted_sum;

CpuAllocator& host() {
  static CpuAllocator allocator;
  return allocator;
}

Tensor tensor_of(Shape shape, DType dtype, const std::vector<double>& x) {
  Tensor t = Tensor::empty(host(), std::move(shape), dtype, MEM_WORKSPACE);
  EXPECT_EQ(t.numel(), static_cast<int64_t>(x.size()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dtype == DTYPE_F64) t.data<double>()[i] = x[static_cast<size_t>(i)];
    else t.data<float>()[i] = static_cast<float>(x[static_cast<size_t>(i)]);
  }
  return t;
}

// n values uniform in [lo, hi).
std::vector<double> uniform(int64_t n, uint64_t seed, double lo, double hi) {
  std::vector<float> u(static_cast<size_t>(n));
  philox_fill_uniform(u.data(), n, seed, 11, 0);
  std::vector<double> x(u.begin(), u.end());
  for (double& v : x) v = lo + (hi - lo) * v;
  return x;
}

Tensor random_tensor(Shape shape, DType dtype, uint64_t seed, double lo, double hi) {
  return tensor_of(shape, dtype, uniform(shape_numel(shape), seed, lo, hi));
}

Tensor filled(Shape shape, DType dtype, double value) {
  return tensor_of(shape, dtype, std::vector<double>(static_cast<size_t>(shape_numel(shape)), value));
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// Rows [t0, t1) of a (B, T, C) tensor, copied.
Tensor slice_time(const Tensor& x, int64_t t0, int64_t t1) {
  const int64_t B = x.dim(0), T = x.dim(1), C = x.dim(2);
  const std::vector<double> v = values(x);
  std::vector<double> out;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t c = 0; c < C; ++c) out.push_back(v[static_cast<size_t>((b * T + t) * C + c)]);
    }
  }
  return tensor_of({B, t1 - t0, C}, x.dtype(), out);
}

// ---- the convolution's reference: x' = [initial; x] (zeros without initial), in double

struct ConvRef {
  std::vector<double> y, final_state;
};

ConvRef naive_conv(const Tensor& x, const Tensor& weight, const Tensor& initial) {
  const int64_t B = x.dim(0), T = x.dim(1), C = x.dim(2), K = weight.dim(1);
  const std::vector<double> xv = values(x), w = values(weight);
  const std::vector<double> iv = initial.defined() ? values(initial) : std::vector<double>();
  const auto xp = [&](int64_t b, int64_t s, int64_t c) {  // x' row s in [-(K-1), T)
    if (s >= 0) return xv[static_cast<size_t>((b * T + s) * C + c)];
    return iv.empty() ? 0.0 : iv[static_cast<size_t>((b * (K - 1) + K - 1 + s) * C + c)];
  };
  ConvRef r;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t c = 0; c < C; ++c) {
        double z = 0;
        for (int64_t i = 0; i < K; ++i) z += w[static_cast<size_t>(c * K + i)] * xp(b, t - K + 1 + i, c);
        r.y.push_back(z / (1 + std::exp(-z)));
      }
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < K - 1; ++j) {
      for (int64_t c = 0; c < C; ++c) r.final_state.push_back(xp(b, T - K + 1 + j, c));
    }
  }
  return r;
}

struct ConvOut {
  Tensor y, final_state;
};

ConvOut run_conv(Backend& be, const Tensor& x, const Tensor& weight, const Tensor& initial) {
  const int64_t B = x.dim(0), C = x.dim(2), K = weight.dim(1);
  ConvOut o{filled(x.shape(), x.dtype(), 1e30), filled({B, K - 1, C}, x.dtype(), 1e30)};
  be.causal_conv1d_silu_forward(x, weight, initial, o.y, o.final_state);
  return o;
}

// ---- 1. conv against the naive loop

TEST(LinearAttentionOps, ConvMatchesNaive) {
  auto be = make_cpu_backend();
  const int64_t B = 2, C = 5, K = 4;
  double worst[2] = {0, 0};
  for (DType dtype : {DTYPE_F64, DTYPE_F32}) {
    const int di = dtype == DTYPE_F64 ? 0 : 1;
    const double tol = dtype == DTYPE_F64 ? 1e-12 : 5e-6;
    const Tensor w = random_tensor({C, K}, dtype, 1, -0.6, 0.6);
    for (int64_t T : {int64_t{1}, int64_t{2}, int64_t{7}}) {
      const Tensor x = random_tensor({B, T, C}, dtype, 2 + T, -2.0, 2.0);
      const Tensor s0 = random_tensor({B, K - 1, C}, dtype, 3 + T, -2.0, 2.0);
      for (bool with_initial : {false, true}) {
        const std::string what = str_cat(dtype_name(dtype), " T ", T, " initial ", with_initial, " ");
        const Tensor initial = with_initial ? s0 : Tensor();
        const ConvOut o = run_conv(*be, x, w, initial);
        const ConvRef ref = naive_conv(x, w, initial);
        const double ey = max_abs_diff(values(o.y), ref.y);
        EXPECT_LE(ey, tol) << what << "y";
        worst[di] = std::max(worst[di], ey);
        // The final state is a copy: exact. Without an initial state and T < K-1 its first rows are
        // zeros; with one, T < K-1 mixes initial's last rows and x's.
        EXPECT_EQ(values(o.final_state), ref.final_state) << what << "final state";
        if (T == 1) {
          const std::vector<double> f = values(o.final_state), xv = values(x), sv = values(s0);
          for (int64_t c = 0; c < C; ++c) {
            EXPECT_EQ(f[static_cast<size_t>(0 * C + c)], with_initial ? sv[static_cast<size_t>(1 * C + c)] : 0.0);
            EXPECT_EQ(f[static_cast<size_t>(1 * C + c)], with_initial ? sv[static_cast<size_t>(2 * C + c)] : 0.0);
            EXPECT_EQ(f[static_cast<size_t>(2 * C + c)], xv[static_cast<size_t>(c)]);
          }
        }
        // An undefined final state is not written; y is the same.
        Tensor y2 = filled(x.shape(), dtype, 0.0);
        be->causal_conv1d_silu_forward(x, w, initial, y2, Tensor());
        EXPECT_EQ(values(y2), values(o.y)) << what;
      }
      // No initial state is zeros.
      const ConvOut zero_init = run_conv(*be, x, w, filled({B, K - 1, C}, dtype, 0.0));
      const ConvOut no_init = run_conv(*be, x, w, Tensor());
      EXPECT_EQ(values(zero_init.y), values(no_init.y));
    }
  }
  std::printf("[linear_attention_ops] conv vs naive: y %.2e (f64), %.2e (f32) (max abs); final state exact\n", worst[0],
              worst[1]);
}

// ---- 2. split sequences equal the whole

// The backward of two pieces [0, T1) and [T1, T) of one sequence: the second piece's dinitial is
// the gradient of the first piece's final state, whose row j is x'_1 row T1 - K + 1 + j (x'_1 =
// [initial; x_1]), so it is added to the first piece's dx (or dinitial, for rows before 0).
TEST(LinearAttentionOps, ConvSplitSequenceMatchesWhole) {
  auto be = make_cpu_backend();
  const int64_t B = 2, T = 9, C = 6, K = 4;
  double worst_bwd = 0;
  for (DType dtype : {DTYPE_F32, DTYPE_F64}) {
    const Tensor w = random_tensor({C, K}, dtype, 21, -0.6, 0.6);
    const Tensor x = random_tensor({B, T, C}, dtype, 22, -2.0, 2.0);
    const Tensor s0 = random_tensor({B, K - 1, C}, dtype, 23, -2.0, 2.0);
    for (bool with_initial : {true, false}) {
      const Tensor initial = with_initial ? s0 : Tensor();
      const ConvOut whole = run_conv(*be, x, w, initial);
      for (int64_t split : {int64_t{1}, int64_t{2}, int64_t{5}}) {
        const std::string what = str_cat(dtype_name(dtype), " split ", split, " initial ", with_initial, " ");
        const ConvOut a = run_conv(*be, slice_time(x, 0, split), w, initial);
        const ConvOut b = run_conv(*be, slice_time(x, split, T), w, a.final_state);
        EXPECT_EQ(values(a.y), values(slice_time(whole.y, 0, split))) << what << "first y";
        EXPECT_EQ(values(b.y), values(slice_time(whole.y, split, T))) << what << "second y";
        EXPECT_EQ(values(b.final_state), values(whole.final_state)) << what << "final state";
      }
      // Decoding: one position at a time, each step's final state the next one's initial.
      Tensor state = initial;
      for (int64_t t = 0; t < T; ++t) {
        const ConvOut step = run_conv(*be, slice_time(x, t, t + 1), w, state);
        EXPECT_EQ(values(step.y), values(slice_time(whole.y, t, t + 1))) << dtype_name(dtype) << " step " << t;
        state = step.final_state;
      }
      EXPECT_EQ(values(state), values(whole.final_state)) << dtype_name(dtype) << " decoded final state";
    }
    if (dtype != DTYPE_F64) continue;
    // The backward, f64, with an initial state.
    const Tensor dy = random_tensor({B, T, C}, dtype, 24, -1.0, 1.0);
    Tensor dx = filled(x.shape(), dtype, 1e30), dw = filled({C, K}, dtype, 0.0), ds0 = filled(s0.shape(), dtype, 1e30);
    be->causal_conv1d_silu_backward(x, w, s0, dy, dx, dw, ds0);
    for (int64_t split : {int64_t{1}, int64_t{2}, int64_t{5}}) {
      const Tensor x1 = slice_time(x, 0, split), x2 = slice_time(x, split, T);
      const ConvOut a = run_conv(*be, x1, w, s0);
      Tensor dx1 = filled(x1.shape(), dtype, 1e30), dx2 = filled(x2.shape(), dtype, 1e30);
      Tensor di1 = filled(s0.shape(), dtype, 1e30), di2 = filled(s0.shape(), dtype, 1e30);
      Tensor dw_pieces = filled({C, K}, dtype, 0.0);  // both pieces accumulate into it
      be->causal_conv1d_silu_backward(x2, w, a.final_state, slice_time(dy, split, T), dx2, dw_pieces, di2);
      be->causal_conv1d_silu_backward(x1, w, s0, slice_time(dy, 0, split), dx1, dw_pieces, di1);
      double* g1 = dx1.data<double>();
      double* gi = di1.data<double>();
      const double* g2 = di2.data<double>();
      for (int64_t bb = 0; bb < B; ++bb) {
        for (int64_t j = 0; j < K - 1; ++j) {
          const int64_t s = split - K + 1 + j;
          for (int64_t c = 0; c < C; ++c) {
            const double g = g2[(bb * (K - 1) + j) * C + c];
            if (s >= 0) g1[(bb * split + s) * C + c] += g;
            else gi[(bb * (K - 1) + K - 1 + s) * C + c] += g;
          }
        }
      }
      const double e1 = max_rel_error(values(dx1), values(slice_time(dx, 0, split)));
      const double e2 = max_rel_error(values(dx2), values(slice_time(dx, split, T)));
      const double e3 = max_rel_error(values(di1), values(ds0));
      const double e4 = max_rel_error(values(dw_pieces), values(dw));
      EXPECT_LT(std::max({e1, e2, e3, e4}), 1e-12) << "split " << split << ": dx " << e1 << " " << e2 << " dinitial "
                                                   << e3 << " dweight " << e4;
      worst_bwd = std::max({worst_bwd, e1, e2, e3, e4});
    }
  }
  std::printf("[linear_attention_ops] conv split / decoded vs whole: forward exact; f64 backward %.2e (max rel)\n",
              worst_bwd);
}

// ---- 3. conv backward: central differences

TEST(LinearAttentionOps, ConvBackwardMatchesFiniteDifferences) {
  auto be = make_cpu_backend();
  const int64_t B = 2, C = 3, K = 4;
  double worst = 0;
  for (int64_t T : {int64_t{1}, int64_t{2}, int64_t{7}}) {
    const Tensor w = random_tensor({C, K}, DTYPE_F64, 31, -0.6, 0.6);
    const Tensor x = random_tensor({B, T, C}, DTYPE_F64, 32 + T, -2.0, 2.0);
    const Tensor s0 = random_tensor({B, K - 1, C}, DTYPE_F64, 33 + T, -2.0, 2.0);
    const Tensor dy = random_tensor({B, T, C}, DTYPE_F64, 34 + T, -1.0, 1.0);
    // dx and dinitial start at 1e30 (overwritten), dweight at 0.25 (accumulated).
    Tensor dx = filled(x.shape(), DTYPE_F64, 1e30), dw = filled({C, K}, DTYPE_F64, 0.25);
    Tensor ds0 = filled(s0.shape(), DTYPE_F64, 1e30);
    be->causal_conv1d_silu_backward(x, w, s0, dy, dx, dw, ds0);
    std::vector<double> dwv = values(dw);
    for (double& v : dwv) v -= 0.25;
    const auto loss = [&] {
      Tensor y = filled(x.shape(), DTYPE_F64, 0.0);
      be->causal_conv1d_silu_forward(x, w, s0, y, Tensor());
      return weighted_sum(y, dy);
    };
    std::string at;
    const double ex = test::fd_worst_ratio(x, values(dx), loss, &at);
    EXPECT_LE(ex, 1e-7) << "T " << T << " dx " << at;
    const double ew = test::fd_worst_ratio(w, dwv, loss, &at);
    EXPECT_LE(ew, 1e-7) << "T " << T << " dweight " << at;
    const double ei = test::fd_worst_ratio(s0, values(ds0), loss, &at);
    EXPECT_LE(ei, 1e-7) << "T " << T << " dinitial " << at;
    worst = std::max({worst, ex, ew, ei});
    // Without an initial state: the same dx as with zeros, and dinitial the gradient at zeros.
    const Tensor zeros = filled(s0.shape(), DTYPE_F64, 0.0);
    Tensor dxa = filled(x.shape(), DTYPE_F64, 1e30), dwa = filled({C, K}, DTYPE_F64, 0.0);
    Tensor dia = filled(s0.shape(), DTYPE_F64, 1e30);
    Tensor dxb = filled(x.shape(), DTYPE_F64, 1e30), dwb = filled({C, K}, DTYPE_F64, 0.0);
    Tensor dib = filled(s0.shape(), DTYPE_F64, 1e30);
    be->causal_conv1d_silu_backward(x, w, zeros, dy, dxa, dwa, dia);
    be->causal_conv1d_silu_backward(x, w, Tensor(), dy, dxb, dwb, dib);
    EXPECT_EQ(values(dxa), values(dxb)) << "T " << T;
    EXPECT_EQ(values(dwa), values(dwb)) << "T " << T;
    EXPECT_EQ(values(dia), values(dib)) << "T " << T;
    // An undefined dinitial is not written; dx is the same.
    Tensor dxc = filled(x.shape(), DTYPE_F64, 1e30), dwc = filled({C, K}, DTYPE_F64, 0.0);
    be->causal_conv1d_silu_backward(x, w, Tensor(), dy, dxc, dwc, Tensor());
    EXPECT_EQ(values(dxc), values(dxb)) << "T " << T;
  }
  std::printf("[linear_attention_ops] f64 conv backward vs central differences: %.2e\n", worst);
}

// ---- 4. gates

struct GateInputs {
  Tensor ba, a_log, dt_bias;
};

// N rows, H heads; a + dt_bias spans both softplus branches: row 0 at `fixed` points over heads
// 0, 1, .. (by default -30, -2, 0.5, 20.5, 25, 100), the other rows random in (-4, 4) + dt_bias;
// a_log in (-1, a_log_hi) (Qwen3-Next draws A = exp(a_log) in (0, 16)).
GateInputs make_gates(int64_t N, int64_t H, DType dtype, uint64_t seed, double a_log_hi = 2.7,
                      const std::vector<double>& fixed = {-30.0, -2.0, 0.5, 20.5, 25.0, 100.0}) {
  std::vector<double> ba = uniform(N * 2 * H, seed, -4.0, 4.0);
  const std::vector<double> dt_bias = uniform(H, seed + 1, -1.0, 1.0);
  for (int64_t h = 0; h < H && h < static_cast<int64_t>(fixed.size()); ++h) {
    ba[static_cast<size_t>(H + h)] = fixed[static_cast<size_t>(h)] - dt_bias[static_cast<size_t>(h)];
  }
  return {tensor_of({N, 2 * H}, dtype, ba), random_tensor({H}, dtype, seed + 2, -1.0, a_log_hi),
          tensor_of({H}, dtype, dt_bias)};
}

double softplus_ref(double x) { return x > 20 ? x : std::log1p(std::exp(x)); }
double sigmoid_ref(double x) { return 1 / (1 + std::exp(-x)); }

TEST(LinearAttentionOps, GatesMatchFormulas) {
  auto be = make_cpu_backend();
  const int64_t N = 7, H = 6;
  double worst[2] = {0, 0};
  for (DType dtype : {DTYPE_F64, DTYPE_F32}) {
    const int di = dtype == DTYPE_F64 ? 0 : 1;
    const double tol = dtype == DTYPE_F64 ? 1e-14 : 1e-6;
    const GateInputs in = make_gates(N, H, dtype, 41);
    Tensor g = filled({N, H}, dtype, 1e30), beta = filled({N, H}, dtype, 1e30);
    be->delta_gates_forward(in.ba, in.a_log, in.dt_bias, g, beta);
    const std::vector<double> ba = values(in.ba), al = values(in.a_log), dtb = values(in.dt_bias);
    const std::vector<double> gv = values(g), bv = values(beta);
    const Tensor dg = random_tensor({N, H}, dtype, 42, -1.0, 1.0), dbeta = random_tensor({N, H}, dtype, 43, -1.0, 1.0);
    Tensor dba = filled({N, 2 * H}, dtype, 1e30);
    Tensor da_log = filled({H}, dtype, 0.0), ddt = filled({H}, dtype, 0.0);
    be->delta_gates_backward(in.ba, in.a_log, in.dt_bias, dg, dbeta, dba, da_log, ddt);
    const std::vector<double> dgv = values(dg), dbv = values(dbeta), dbav = values(dba);
    std::vector<double> want_g, want_beta, want_dba(static_cast<size_t>(N * 2 * H)), want_dal(H, 0.0), want_ddt(H, 0.0);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t h = 0; h < H; ++h) {
        const size_t i = static_cast<size_t>(n * H + h);
        const double b = ba[static_cast<size_t>(n * 2 * H + h)];
        const double x = ba[static_cast<size_t>(n * 2 * H + H + h)] + dtb[static_cast<size_t>(h)];
        const double A = std::exp(al[static_cast<size_t>(h)]);
        want_beta.push_back(sigmoid_ref(b));
        want_g.push_back(-A * softplus_ref(x));
        want_dba[static_cast<size_t>(n * 2 * H + h)] = dbv[i] * sigmoid_ref(b) * (1 - sigmoid_ref(b));
        const double da = -dgv[i] * A * (x > 20 ? 1.0 : sigmoid_ref(x));
        want_dba[static_cast<size_t>(n * 2 * H + H + h)] = da;
        want_dal[static_cast<size_t>(h)] += dgv[i] * -A * softplus_ref(x);
        want_ddt[static_cast<size_t>(h)] += da;
      }
    }
    const std::string what = str_cat(dtype_name(dtype), " ");
    const double e[] = {max_rel_error(gv, want_g), max_rel_error(bv, want_beta), max_rel_error(dbav, want_dba),
                        max_rel_error(values(da_log), want_dal), max_rel_error(values(ddt), want_ddt)};
    const char* names[] = {"g", "beta", "dba", "da_log", "ddt_bias"};
    for (int j = 0; j < 5; ++j) {
      EXPECT_LE(e[j], tol) << what << names[j];
      worst[di] = std::max(worst[di], e[j]);
    }
    // Per element, both branches: row 0's heads have a + dt_bias = -30, -2, 0.5, 20.5, 25, 100;
    // the ratio to the reference is within ptol of 1 in each (max_rel_error above scales by the
    // largest |g|, at 100). f32's ptol is looser: a + dt_bias rounds to f32 (at -30 that is 1e-6
    // of softplus).
    const double ptol = dtype == DTYPE_F64 ? 1e-14 : 1e-5;
    for (int64_t h = 0; h < H; ++h) {
      const size_t i = static_cast<size_t>(h);
      EXPECT_NEAR(gv[i] / want_g[i], 1.0, ptol) << what << "g, row 0 head " << h;
      EXPECT_TRUE(std::isfinite(gv[i])) << what << "g, row 0 head " << h;
      const size_t j = static_cast<size_t>(H + h);
      EXPECT_NEAR(dbav[j] / want_dba[j], 1.0, ptol) << what << "d(a), row 0 head " << h;
    }
  }
  std::printf("[linear_attention_ops] gates vs formulas: %.2e (f64), %.2e (f32) (max rel)\n", worst[0], worst[1]);
}

TEST(LinearAttentionOps, GatesBackwardMatchesFiniteDifferences) {
  auto be = make_cpu_backend();
  const int64_t N = 5, H = 6;
  // Small A and a + dt_bias <= 30, so the loss stays small enough for the differences' rounding
  // (|loss| 1e-16 / 2e-6) to sit well under 1e-7.
  const GateInputs in = make_gates(N, H, DTYPE_F64, 51, 1.0, {-30.0, -2.0, 0.5, 20.5, 25.0, 30.0});
  const Tensor dg = random_tensor({N, H}, DTYPE_F64, 52, -1.0, 1.0);
  const Tensor dbeta = random_tensor({N, H}, DTYPE_F64, 53, -1.0, 1.0);
  Tensor dba = filled({N, 2 * H}, DTYPE_F64, 1e30);
  Tensor da_log = filled({H}, DTYPE_F64, 0.5), ddt = filled({H}, DTYPE_F64, -0.5);  // accumulated into
  be->delta_gates_backward(in.ba, in.a_log, in.dt_bias, dg, dbeta, dba, da_log, ddt);
  std::vector<double> dal = values(da_log), ddv = values(ddt);
  for (double& v : dal) v -= 0.5;
  for (double& v : ddv) v += 0.5;
  const auto loss = [&] {
    Tensor g = filled({N, H}, DTYPE_F64, 0.0), beta = filled({N, H}, DTYPE_F64, 0.0);
    be->delta_gates_forward(in.ba, in.a_log, in.dt_bias, g, beta);
    return weighted_sum(g, dg) + weighted_sum(beta, dbeta);
  };
  std::string at;
  const double e1 = test::fd_worst_ratio(in.ba, values(dba), loss, &at);
  EXPECT_LE(e1, 1e-7) << "dba " << at;
  const double e2 = test::fd_worst_ratio(in.a_log, dal, loss, &at);
  EXPECT_LE(e2, 1e-7) << "da_log " << at;
  const double e3 = test::fd_worst_ratio(in.dt_bias, ddv, loss, &at);
  EXPECT_LE(e3, 1e-7) << "ddt_bias " << at;
  std::printf("[linear_attention_ops] f64 gates backward vs central differences: %.2e\n", std::max({e1, e2, e3}));
}

// ---- 5. bad operands

TEST(LinearAttentionOps, BadShapesAreOneLineErrors) {
  auto be = make_cpu_backend();
  const int64_t B = 2, T = 7, C = 5, K = 4;
  const Tensor x = random_tensor({B, T, C}, DTYPE_F32, 61, -1.0, 1.0);
  const Tensor w = random_tensor({C, K}, DTYPE_F32, 62, -1.0, 1.0);
  const Tensor s0 = random_tensor({B, K - 1, C}, DTYPE_F32, 63, -1.0, 1.0);
  const Tensor y = filled(x.shape(), DTYPE_F32, 0.0), fin = filled(s0.shape(), DTYPE_F32, 0.0);
  const auto one_line = [](const std::string& e) {
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    return e;
  };
  const auto fwd = [&](const Tensor& xx, const Tensor& ww, const Tensor& init, const Tensor& yy, const Tensor& ff) {
    return one_line(error_of([&] { be->causal_conv1d_silu_forward(xx, ww, init, yy, ff); }));
  };
  EXPECT_EQ(fwd(x, w, s0, y, fin), "");
  EXPECT_EQ(fwd(filled({T, C}, DTYPE_F32, 0.0), w, s0, y, fin),
            "causal_conv1d_silu_forward: x is f32(7, 5), expected 3 dimensions (B, T, C)");
  EXPECT_EQ(fwd(x, filled({4, K}, DTYPE_F32, 0.0), s0, y, fin),
            "causal_conv1d_silu_forward: weight is f32(4, 4), expected f32(5, K) (C, K), K >= 1");
  EXPECT_EQ(fwd(x, w, filled({B, K, C}, DTYPE_F32, 0.0), y, fin),
            "causal_conv1d_silu_forward: initial is f32(2, 4, 5), expected f32(2, 3, 5) (B, K-1, C)");
  EXPECT_EQ(fwd(x, w, s0, filled({B, T, C}, DTYPE_F64, 0.0), fin),
            "causal_conv1d_silu_forward: y is f64(2, 7, 5), expected f32(2, 7, 5) (B, T, C)");
  EXPECT_EQ(fwd(x, w, s0, y, filled({B, K - 1, C + 1}, DTYPE_F32, 0.0)),
            "causal_conv1d_silu_forward: final is f32(2, 3, 6), expected f32(2, 3, 5) (B, K-1, C)");
  const Tensor x16 = Tensor::empty(host(), x.shape(), DTYPE_BF16, MEM_WORKSPACE);
  const Tensor w16 = Tensor::empty(host(), w.shape(), DTYPE_BF16, MEM_WORKSPACE);
  const Tensor y16 = Tensor::empty(host(), x.shape(), DTYPE_BF16, MEM_WORKSPACE);
  EXPECT_EQ(fwd(x16, w16, Tensor(), y16, Tensor()),
            "causal_conv1d_silu_forward: not supported for dtype bf16 on the CPU backend (f32, f64)");
  const Tensor dx = filled(x.shape(), DTYPE_F32, 0.0), dw = filled(w.shape(), DTYPE_F32, 0.0);
  EXPECT_EQ(one_line(error_of([&] {
              be->causal_conv1d_silu_backward(x, w, s0, y, dx, filled({C, K - 1}, DTYPE_F32, 0.0), Tensor());
            })),
            "causal_conv1d_silu_backward: dweight is f32(5, 3), expected f32(5, 4) (C, K)");
  EXPECT_EQ(one_line(error_of([&] {
              be->causal_conv1d_silu_backward(x, w, s0, filled({B, T - 1, C}, DTYPE_F32, 0.0), dx, dw, Tensor());
            })),
            "causal_conv1d_silu_backward: dy is f32(2, 6, 5), expected f32(2, 7, 5) (B, T, C)");
  EXPECT_EQ(one_line(error_of([&] {
              be->causal_conv1d_silu_backward(x, w, s0, y, dx, dw, filled({B, K - 1, C}, DTYPE_F64, 0.0));
            })),
            "causal_conv1d_silu_backward: dinitial is f64(2, 3, 5), expected f32(2, 3, 5) (B, K-1, C)");

  const int64_t N = 5, H = 3;
  const GateInputs in = make_gates(N, H, DTYPE_F32, 64);
  const Tensor g = filled({N, H}, DTYPE_F32, 0.0), beta = filled({N, H}, DTYPE_F32, 0.0);
  const auto gates = [&](const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias, const Tensor& gg,
                         const Tensor& bb) {
    return one_line(error_of([&] { be->delta_gates_forward(ba, a_log, dt_bias, gg, bb); }));
  };
  EXPECT_EQ(gates(in.ba, in.a_log, in.dt_bias, g, beta), "");
  EXPECT_EQ(gates(filled({N, 5}, DTYPE_F32, 0.0), in.a_log, in.dt_bias, g, beta),
            "delta_gates_forward: ba is f32(5, 5), expected f32(N, 6) (N, 2H) = [b | a] for a_log's 3 heads");
  EXPECT_EQ(gates(in.ba, in.a_log, filled({H}, DTYPE_F64, 0.0), g, beta),
            "delta_gates_forward: dt_bias is f64(3), expected f32(3) (H)");
  EXPECT_EQ(gates(in.ba, in.a_log, in.dt_bias, filled({N, H - 1}, DTYPE_F32, 0.0), beta),
            "delta_gates_forward: g is f32(5, 2), expected f32(5, 3) (N, H)");
  EXPECT_EQ(gates(in.ba, in.a_log, in.dt_bias, g, filled({N - 1, H}, DTYPE_F32, 0.0)),
            "delta_gates_forward: beta is f32(4, 3), expected f32(5, 3) (N, H)");
  EXPECT_EQ(gates(in.ba, filled({1, H}, DTYPE_F32, 0.0), in.dt_bias, g, beta),
            "delta_gates_forward: a_log is f32(1, 3), expected 1 dimension (H), H >= 1");
  const Tensor dba = filled(in.ba.shape(), DTYPE_F32, 0.0);
  EXPECT_EQ(one_line(error_of([&] {
              be->delta_gates_backward(in.ba, in.a_log, in.dt_bias, g, beta, dba, filled({2}, DTYPE_F32, 0.0),
                                       filled({H}, DTYPE_F32, 0.0));
            })),
            "delta_gates_backward: da_log is f32(2), expected f32(3) (H)");
  EXPECT_EQ(one_line(error_of([&] {
              be->delta_gates_backward(in.ba, in.a_log, in.dt_bias, g, filled({N, H + 1}, DTYPE_F32, 0.0), dba,
                                       filled({H}, DTYPE_F32, 0.0), filled({H}, DTYPE_F32, 0.0));
            })),
            "delta_gates_backward: dbeta is f32(5, 4), expected f32(5, 3) (N, H)");
}

// ---- 6. the strict backend forwards the four ops to the CPU kernels

TEST(LinearAttentionOps, StrictBackendRunsTheCpuKernels) {
  auto cpu = make_cpu_backend();
  test::StrictBackend strict;
  const auto upload = [&](const Tensor& t) {
    Tensor d = Tensor::empty(strict.allocator(), t.shape(), t.dtype(), MEM_WORKSPACE);
    strict.write(d, t.raw_data());
    return d;
  };
  const int64_t B = 1, T = 6, C = 4, K = 4;
  const Tensor x = random_tensor({B, T, C}, DTYPE_F32, 71, -1.0, 1.0);
  const Tensor w = random_tensor({C, K}, DTYPE_F32, 72, -1.0, 1.0);
  const Tensor s0 = random_tensor({B, K - 1, C}, DTYPE_F32, 73, -1.0, 1.0);
  const Tensor dy = random_tensor({B, T, C}, DTYPE_F32, 74, -1.0, 1.0);
  const ConvOut want = run_conv(*cpu, x, w, s0);
  const Tensor y = upload(want.y), fin = upload(want.final_state);
  strict.fill(y, 0.0), strict.fill(fin, 0.0);
  strict.causal_conv1d_silu_forward(upload(x), upload(w), upload(s0), y, fin);
  EXPECT_EQ(values(strict, y), values(want.y));
  EXPECT_EQ(values(strict, fin), values(want.final_state));
  Tensor dx = filled(x.shape(), DTYPE_F32, 0.0), dw = filled(w.shape(), DTYPE_F32, 0.0);
  Tensor ds0 = filled(s0.shape(), DTYPE_F32, 0.0);
  cpu->causal_conv1d_silu_backward(x, w, s0, dy, dx, dw, ds0);
  const Tensor sdx = upload(dx), sdw = upload(dw), sds0 = upload(ds0);
  strict.fill(sdx, 0.0), strict.fill(sdw, 0.0), strict.fill(sds0, 0.0);
  strict.causal_conv1d_silu_backward(upload(x), upload(w), upload(s0), upload(dy), sdx, sdw, sds0);
  EXPECT_EQ(values(strict, sdx), values(dx));
  EXPECT_EQ(values(strict, sdw), values(dw));
  EXPECT_EQ(values(strict, sds0), values(ds0));

  const int64_t N = 4, H = 2;
  const GateInputs in = make_gates(N, H, DTYPE_F32, 75);
  Tensor g = filled({N, H}, DTYPE_F32, 0.0), beta = filled({N, H}, DTYPE_F32, 0.0);
  cpu->delta_gates_forward(in.ba, in.a_log, in.dt_bias, g, beta);
  const Tensor sg = upload(g), sbeta = upload(beta);
  strict.fill(sg, 0.0), strict.fill(sbeta, 0.0);
  strict.delta_gates_forward(upload(in.ba), upload(in.a_log), upload(in.dt_bias), sg, sbeta);
  EXPECT_EQ(values(strict, sg), values(g));
  EXPECT_EQ(values(strict, sbeta), values(beta));
  Tensor dba = filled(in.ba.shape(), DTYPE_F32, 0.0), dal = filled({H}, DTYPE_F32, 0.0), ddt = filled({H}, DTYPE_F32, 0.0);
  cpu->delta_gates_backward(in.ba, in.a_log, in.dt_bias, g, beta, dba, dal, ddt);
  const Tensor sdba = upload(dba), sdal = upload(dal), sddt = upload(ddt);
  strict.fill(sdba, 0.0), strict.fill(sdal, 0.0), strict.fill(sddt, 0.0);
  strict.delta_gates_backward(upload(in.ba), upload(in.a_log), upload(in.dt_bias), sg, sbeta, sdba, sdal, sddt);
  EXPECT_EQ(values(strict, sdba), values(dba));
  EXPECT_EQ(values(strict, sdal), values(dal));
  EXPECT_EQ(values(strict, sddt), values(ddt));
}

}  // namespace
}  // namespace loom
