// The optimizer ops of the Backend interface (backend.h: sgd_step ... ldadam_apply), in the manner
// of test_backend_compress_ops.cpp: each case builds random inputs in host memory, runs the op on
// the CPU backend and on the backend under test (copies written with Backend::write, read back with
// Backend::read) and compares every operand afterwards: bitwise between the two (the CPU kernels
// run on both), and within 1e-5 of max |ref| (f32 arithmetic against double) with a naive double
// reference written here from the op's contract in backend.h.
// Backends: "strict" (the CPU kernels on memory host code may not read, tests/strict_backend.h)
// and "cuda", skipped where the build has no CUDA backend, no GPU is visible or the backend does
// not state capabilities().every_optimizer (the CUDA backend's defaults throw).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/error.h"
#include "backend_ops_fixture.h"
#include "test_util.h"

namespace loom {
namespace {

using Tensors = std::vector<Tensor>;
using Vals = std::vector<std::vector<double>>;  // the operands' values, in double
using Op = std::function<void(Backend&, const Tensors&)>;
constexpr double kTol = 1e-5;

OptimHyper hyper(int64_t step = 3) {
  OptimHyper h;
  h.lr = 0.01, h.weight_decay = 0.1f, h.grad_scale = 0.8f, h.step = step;
  h.beta1 = 0.9, h.beta2 = 0.99, h.beta3 = 0.999, h.eps = 1e-8, h.eps2 = 1e-3;
  h.momentum = 0.9, h.dampening = 0.1, h.clip_threshold = 1.0;
  return h;
}
double sgn(double x) { return x > 0 ? 1.0 : (x < 0 ? -1.0 : 0.0); }

// The shared fixture (backend_ops_fixture.h) picks the backend under test and holds host_ and cpu_.
class BackendOptimOpsTest : public backend_ops_test::BackendOpsTest {
 protected:
  void SetUp() override {
    BackendOpsTest::SetUp();
    if (backend_ && !backend_->capabilities().every_optimizer && GetParam() != "strict") {
      GTEST_SKIP() << backend_->name() << " lacks the optimizer ops (its defaults throw)";
    }
  }

  // Uniform in [offset - scale, offset + scale).
  Tensor f32(Shape shape, uint64_t seed, double scale = 1.0, double offset = 0.0) {
    Tensor t = test::random_tensor(host_, std::move(shape), DTYPE_F32, seed, scale);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] += static_cast<float>(offset);
    return t;
  }

  Tensors run(Backend& backend, const Tensors& in, const Op& op) {
    Tensors dev;
    for (const Tensor& t : in) {
      if (!t.defined()) {
        dev.emplace_back();
        continue;
      }
      dev.push_back(Tensor::empty(backend.allocator(), t.shape(), t.dtype(), MEM_WORKSPACE));
      backend.write(dev.back(), t.raw_data());
    }
    op(backend, dev);
    Tensors out;
    for (const Tensor& t : dev) {
      if (!t.defined()) {
        out.emplace_back();
        continue;
      }
      out.push_back(Tensor::empty(host_, t.shape(), t.dtype(), MEM_WORKSPACE));
      backend.read(t, out.back().raw_data());
    }
    return out;
  }

  // The op on the CPU and on the backend under test; `reference` maps the inputs' values to the
  // expected values of every operand (an empty vector: not compared, e.g. scratch).
  void check(const std::string& what, const Tensors& in, const Op& op, const std::function<void(Vals&)>& reference) {
    Vals ref;
    for (const Tensor& t : in) ref.push_back(t.defined() ? test::values(t) : std::vector<double>{});
    reference(ref);
    const Tensors cpu = run(*cpu_, in, op), got = run(*backend_, in, op);
    for (size_t k = 0; k < in.size(); ++k) {
      if (!in[k].defined() || ref[k].empty()) continue;
      EXPECT_EQ(std::memcmp(cpu[k].raw_data(), got[k].raw_data(), in[k].nbytes()), 0)
          << what << ": operand " << k << " on " << GetParam() << " differs from the CPU's";
      const std::vector<double> x = test::values(cpu[k]);
      double scale = 1e-30, err = 0.0;
      for (double r : ref[k]) scale = std::max(scale, std::abs(r));
      for (size_t i = 0; i < x.size(); ++i) err = std::max(err, std::isfinite(x[i]) ? std::abs(x[i] - ref[k][i]) : 1e30);
      EXPECT_LE(err / scale, kTol) << what << ": operand " << k << " against the double reference";
    }
  }
};

const int64_t kN = 1001;

TEST_P(BackendOptimOpsTest, SgdWithAndWithoutMomentum) {
  for (const bool nesterov : {false, true}) {
    for (const int64_t step : {int64_t{1}, int64_t{3}}) {
      OptimHyper h = hyper(step);
      h.nesterov = nesterov;
      check("sgd_step", {f32({kN}, 1), f32({kN}, 2), f32({kN}, 3)},
            [&](Backend& b, const Tensors& t) { b.sgd_step(t[0], t[1], t[2], h); },
            [&](Vals& v) {
              for (int64_t i = 0; i < kN; ++i) {
                double d = v[1][i] * h.grad_scale + h.weight_decay * v[0][i];
                v[2][i] = step == 1 ? d : h.momentum * v[2][i] + (1 - h.dampening) * d;
                d = nesterov ? d + h.momentum * v[2][i] : v[2][i];
                v[0][i] -= h.lr * d;
              }
            });
    }
  }
  const OptimHyper h = hyper();
  check("sgd_step plain", {f32({kN}, 1), f32({kN}, 2), Tensor()}, [&](Backend& b, const Tensors& t) { b.sgd_step(t[0], t[1], t[2], h); },
        [&](Vals& v) {
          for (int64_t i = 0; i < kN; ++i) v[0][i] -= h.lr * (v[1][i] * h.grad_scale + h.weight_decay * v[0][i]);
        });
}

TEST_P(BackendOptimOpsTest, AdagradAccumulatesSquares) {
  const OptimHyper h = hyper();
  check("adagrad_step", {f32({kN}, 4), f32({kN}, 5), f32({kN}, 6, 0.5, 0.5)},
        [&](Backend& b, const Tensors& t) { b.adagrad_step(t[0], t[1], t[2], h); },
        [&](Vals& v) {
          for (int64_t i = 0; i < kN; ++i) {
            const double d = v[1][i] * h.grad_scale + h.weight_decay * v[0][i];
            v[2][i] += d * d;
            v[0][i] -= h.lr * d / (std::sqrt(v[2][i]) + h.eps);
          }
        });
}

TEST_P(BackendOptimOpsTest, RmspropPlainAndCenteredWithMomentum) {
  const OptimHyper h = hyper();
  for (const bool centered : {false, true}) {
    // Centered: grad_avg small against square_avg, so the variance stays positive.
    const Tensors in = {f32({kN}, 7), f32({kN}, 8), f32({kN}, 9, 0.5, 1.0), centered ? f32({kN}, 10, 0.1) : Tensor(),
                        centered ? f32({kN}, 11) : Tensor()};
    check(centered ? "rmsprop_step centered" : "rmsprop_step", in,
          [&](Backend& b, const Tensors& t) { b.rmsprop_step(t[0], t[1], t[2], t[3], t[4], h); },
          [&](Vals& v) {
            const double a = h.beta2;
            for (int64_t i = 0; i < kN; ++i) {
              const double d = v[1][i] * h.grad_scale + h.weight_decay * v[0][i];
              v[2][i] = a * v[2][i] + (1 - a) * d * d;
              double den = std::sqrt(v[2][i]) + h.eps;
              if (centered) {
                v[3][i] = a * v[3][i] + (1 - a) * d;
                den = std::sqrt(v[2][i] - v[3][i] * v[3][i]) + h.eps;
                v[4][i] = h.momentum * v[4][i] + d / den;
                v[0][i] -= h.lr * v[4][i];
              } else {
                v[0][i] -= h.lr * d / den;
              }
            }
          });
  }
}

TEST_P(BackendOptimOpsTest, AdamL2WithAmsgradAndDecoupled) {
  for (const bool decoupled : {false, true}) {
    OptimHyper h = hyper();
    h.decoupled = decoupled;
    const Tensors in = {f32({kN}, 12), f32({kN}, 13), f32({kN}, 14, 0.1), f32({kN}, 15, 0.01, 0.02),
                        decoupled ? Tensor() : f32({kN}, 16, 0.01, 0.02)};
    check("adam_step", in, [&](Backend& b, const Tensors& t) { b.adam_step(t[0], t[1], t[2], t[3], t[4], h); },
          [&](Vals& v) {
            const double bc1 = 1 - std::pow(h.beta1, 3.0), bc2 = 1 - std::pow(h.beta2, 3.0);
            for (int64_t i = 0; i < kN; ++i) {
              const double g = v[1][i] * h.grad_scale, d = decoupled ? g : g + h.weight_decay * v[0][i];
              if (decoupled) v[0][i] *= 1 - h.lr * h.weight_decay;
              v[2][i] = h.beta1 * v[2][i] + (1 - h.beta1) * d;
              v[3][i] = h.beta2 * v[3][i] + (1 - h.beta2) * d * d;
              double den = v[3][i];
              if (!decoupled) den = v[4][i] = std::max(v[4][i], v[3][i]);
              v[0][i] -= h.lr / bc1 * v[2][i] / (std::sqrt(den) / std::sqrt(bc2) + h.eps);
            }
          });
  }
}

TEST_P(BackendOptimOpsTest, LionStepsBySign) {
  const OptimHyper h = hyper();
  check("lion_step", {f32({kN}, 17), f32({kN}, 18), f32({kN}, 19)},
        [&](Backend& b, const Tensors& t) { b.lion_step(t[0], t[1], t[2], h); },
        [&](Vals& v) {
          for (int64_t i = 0; i < kN; ++i) {
            const double g = v[1][i] * h.grad_scale, c = h.beta1 * v[2][i] + (1 - h.beta1) * g;
            v[0][i] = v[0][i] * (1 - h.lr * h.weight_decay) - h.lr * sgn(c);
            v[2][i] = h.beta2 * v[2][i] + (1 - h.beta2) * g;
          }
        });
}

TEST_P(BackendOptimOpsTest, AdamMiniOneSecondMomentPerBlock) {
  const OptimHyper h = hyper();
  const int64_t blocks = 7, bn = 143;
  check("adam_mini_step", {f32({blocks * bn}, 20), f32({blocks * bn}, 21), f32({blocks * bn}, 22, 0.1), f32({blocks}, 23, 0.01, 0.02)},
        [&](Backend& b, const Tensors& t) { b.adam_mini_step(t[0], t[1], t[2], t[3], h); },
        [&](Vals& v) {
          const double bc1 = 1 - std::pow(h.beta1, 3.0), bc2 = 1 - std::pow(h.beta2, 3.0);
          for (int64_t j = 0; j < blocks; ++j) {
            double sq = 0;
            for (int64_t i = j * bn; i < (j + 1) * bn; ++i) sq += std::pow(v[1][i] * h.grad_scale, 2);
            v[3][j] = h.beta2 * v[3][j] + (1 - h.beta2) * sq / bn;
            for (int64_t i = j * bn; i < (j + 1) * bn; ++i) {
              v[2][i] = h.beta1 * v[2][i] + (1 - h.beta1) * v[1][i] * h.grad_scale;
              v[0][i] = v[0][i] * (1 - h.lr * h.weight_decay) - h.lr * (v[2][i] / bc1) / (std::sqrt(v[3][j] / bc2) + h.eps);
            }
          }
        });
}

// Row and column EMAs of f(i, j) + eps over an m x n segment (Adafactor's and CAME's factored state).
void factored_ema(std::vector<double>& state, size_t at, int64_t m, int64_t n, double beta,
                  const std::function<double(int64_t, int64_t)>& f) {
  for (int64_t i = 0; i < m; ++i) {
    double s = 0;
    for (int64_t j = 0; j < n; ++j) s += f(i, j);
    state[at + i] = beta * state[at + i] + (1 - beta) * s / n;
  }
  for (int64_t j = 0; j < n; ++j) {
    double s = 0;
    for (int64_t i = 0; i < m; ++i) s += f(i, j);
    state[at + m + j] = beta * state[at + m + j] + (1 - beta) * s / m;
  }
}
// 1 / sqrt(R_i / mean(R) C_j).
double inv_sqrt_factored(const std::vector<double>& state, size_t at, int64_t m, int64_t i, int64_t j) {
  double mean = 0;
  for (int64_t k = 0; k < m; ++k) mean += state[at + k];
  mean /= m;
  return 1 / std::sqrt(state[at + i] / mean * state[at + m + j]);
}
// U = g / sqrt(V^) into u, with the state's EMA (factored, or per element) of g^2 + eps.
void precondition_ref(Vals& v, bool factored, int64_t m, int64_t n, const OptimHyper& h, std::vector<double>& u) {
  const auto g = [&](int64_t i, int64_t j) { return v[1][i * n + j] * h.grad_scale; };
  if (factored) factored_ema(v[2], 0, m, n, h.beta2, [&](int64_t i, int64_t j) { return g(i, j) * g(i, j) + h.eps; });
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      if (!factored) v[2][i * n + j] = h.beta2 * v[2][i * n + j] + (1 - h.beta2) * (g(i, j) * g(i, j) + h.eps);
      u[i * n + j] = g(i, j) * (factored ? inv_sqrt_factored(v[2], 0, m, i, j) : 1 / std::sqrt(v[2][i * n + j]));
    }
  }
}
double rms(const std::vector<double>& x) {
  double s = 0;
  for (double e : x) s += e * e;
  return std::sqrt(s / x.size());
}

TEST_P(BackendOptimOpsTest, AdafactorFactoredWithMomentumAndPerElement) {
  const int64_t m = 37, n = 70;
  for (const bool factored : {true, false}) {
    OptimHyper h = hyper();
    h.factored = factored;
    h.clip_threshold = 0.5;  // the clip engages
    const Tensors in = {f32({m, n}, 24), f32({m, n}, 25), f32({factored ? m + n : m * n}, 26, 0.5, 1.0),
                        factored ? f32({m * n}, 27, 0.01) : Tensor(), f32({m * n}, 28)};
    check(factored ? "adafactor_step factored" : "adafactor_step", in,
          [&](Backend& b, const Tensors& t) { b.adafactor_step(t[0], t[1], t[2], t[3], t[4], h); },
          [&](Vals& v) {
            const double rate = h.lr * std::max(h.eps2, rms(v[0]));
            std::vector<double> u(m * n);
            precondition_ref(v, factored, m, n, h, u);
            const double scale = rate / std::max(1.0, rms(u) / h.clip_threshold);
            for (int64_t i = 0; i < m * n; ++i) {
              double x = u[i] * scale;
              if (factored) x = v[3][i] = h.beta1 * v[3][i] + (1 - h.beta1) * x;
              v[0][i] = v[0][i] * (1 - h.weight_decay * rate) - x;
            }
            v[4].clear();  // scratch
          });
  }
}

TEST_P(BackendOptimOpsTest, Sm3RowAndColumnCoversAndPerElement) {
  const int64_t m = 37, n = 70;
  for (const bool factored : {true, false}) {
    OptimHyper h = hyper();
    h.factored = factored;
    check(factored ? "sm3_step factored" : "sm3_step", {f32({m, n}, 29), f32({m, n}, 30), f32({factored ? m + n : m * n}, 31, 0.5, 0.5)},
          [&](Backend& b, const Tensors& t) { b.sm3_step(t[0], t[1], t[2], h); },
          [&](Vals& v) {
            std::vector<double> rows(m, 0.0), cols(n, 0.0);
            for (int64_t i = 0; i < m; ++i) {
              for (int64_t j = 0; j < n; ++j) {
                const double g = v[1][i * n + j] * h.grad_scale;
                const int64_t k = i * n + j;
                const double nu = factored ? std::min(v[2][i], v[2][m + j]) + g * g : (v[2][k] += g * g);
                rows[i] = std::max(rows[i], nu);
                cols[j] = std::max(cols[j], nu);
                v[0][k] = v[0][k] * (1 - h.lr * h.weight_decay) - h.lr * (nu > 0 ? g / (std::sqrt(nu) + h.eps) : 0.0);
              }
            }
            if (!factored) return;
            for (int64_t i = 0; i < m; ++i) v[2][i] = rows[i];
            for (int64_t j = 0; j < n; ++j) v[2][m + j] = cols[j];
          });
  }
}

TEST_P(BackendOptimOpsTest, CameConfidenceFactoredAndPerElement) {
  const int64_t m = 37, n = 70;
  for (const bool factored : {true, false}) {
    OptimHyper h = hyper();
    h.factored = factored;
    h.clip_threshold = 0.5;
    const Tensors in = {f32({m, n}, 32), f32({m, n}, 33), f32({factored ? m + n : m * n}, 34, 0.5, 1.0), f32({m * n}, 35, 0.1),
                        factored ? f32({m + n}, 36, 0.5, 1.0) : Tensor(), f32({m * n}, 37)};
    check(factored ? "came_step factored" : "came_step", in,
          [&](Backend& b, const Tensors& t) { b.came_step(t[0], t[1], t[2], t[3], t[4], t[5], h); },
          [&](Vals& v) {
            std::vector<double> u(m * n);
            precondition_ref(v, factored, m, n, h, u);
            const double clip = 1 / std::max(1.0, rms(u) / h.clip_threshold);
            for (int64_t i = 0; i < m * n; ++i) {
              u[i] *= clip;
              v[3][i] = h.beta1 * v[3][i] + (1 - h.beta1) * u[i];
            }
            if (factored) {
              factored_ema(v[4], 0, m, n, h.beta3, [&](int64_t i, int64_t j) {
                const double r = u[i * n + j] - v[3][i * n + j];
                return r * r + h.eps2;
              });
            }
            for (int64_t i = 0; i < m; ++i) {
              for (int64_t j = 0; j < n; ++j) {
                const double conf = factored ? inv_sqrt_factored(v[4], 0, m, i, j) : 1.0;
                v[0][i * n + j] = v[0][i * n + j] * (1 - h.lr * h.weight_decay) - h.lr * v[3][i * n + j] * conf;
              }
            }
            v[5].clear();
          });
  }
}

TEST_P(BackendOptimOpsTest, MuonMomentumNewtonSchulzStartAndUpdate) {
  for (const bool nesterov : {false, true}) {
    OptimHyper h = hyper();
    h.nesterov = nesterov;
    check("muon_momentum", {f32({kN}, 38), f32({kN}, 39), f32({kN}, 40)},
          [&](Backend& b, const Tensors& t) { b.muon_momentum(t[0], t[1], t[2], h); },
          [&](Vals& v) {
            for (int64_t i = 0; i < kN; ++i) {
              const double g = v[0][i] * h.grad_scale;
              v[1][i] = h.momentum * v[1][i] + (1 - h.momentum) * g;
              v[2][i] = nesterov ? (1 - h.momentum) * g + h.momentum * v[1][i] : v[1][i];
            }
          });
  }
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{24, 8}, {8, 40}}) {
    check("newton_schulz_normalize", {f32({rows, cols}, 41), f32({rows * cols}, 42)},
          [&](Backend& b, const Tensors& t) { b.newton_schulz_normalize(t[0], t[1]); },
          [&](Vals& v) {
            const double inv = 1 / (rms(v[0]) * std::sqrt(rows * cols) + 1e-7);
            for (int64_t i = 0; i < rows; ++i) {
              for (int64_t j = 0; j < cols; ++j) v[1][rows > cols ? j * rows + i : i * cols + j] = v[0][i * cols + j] * inv;
            }
          });
  }
  check("decayed_update", {f32({kN}, 43), f32({kN}, 44)},
        [&](Backend& b, const Tensors& t) { b.decayed_update(t[0], t[1], 0.99f, 0.02f); },
        [&](Vals& v) {
          for (int64_t i = 0; i < kN; ++i) v[0][i] = v[0][i] * double(0.99f) - double(0.02f) * v[1][i];
        });
}

TEST_P(BackendOptimOpsTest, ScaleTransposeAndAxpy) {
  for (const bool transpose : {false, true}) {
    check("scale_transpose", {f32({13, 29}, 45), f32({13 * 29}, 46)},
          [&](Backend& b, const Tensors& t) { b.scale_transpose(t[0], t[1], 0.75f, transpose); },
          [&](Vals& v) {
            for (int64_t i = 0; i < 13; ++i) {
              for (int64_t j = 0; j < 29; ++j) v[1][transpose ? j * 13 + i : i * 29 + j] = 0.75 * v[0][i * 29 + j];
            }
          });
  }
  check("axpy", {f32({kN}, 47), f32({kN}, 48)}, [](Backend& b, const Tensors& t) { b.axpy(t[0], t[1], -4.775f); },
        [](Vals& v) {
          for (int64_t i = 0; i < kN; ++i) v[0][i] += double(-4.775f) * v[1][i];
        });
}

// Modified Gram-Schmidt of y's columns (n, r) in double; a column that vanishes takes fallback's.
std::vector<double> gram_schmidt_ref(const std::vector<double>& y, const std::vector<double>& fallback, int64_t n, int64_t r) {
  std::vector<double> q(y.size());
  for (int64_t c = 0; c < r; ++c) {
    std::vector<double> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = y[i * r + c];
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t k = 0; k < c; ++k) {
        double dot = 0;
        for (int64_t i = 0; i < n; ++i) dot += q[i * r + k] * v[i];
        for (int64_t i = 0; i < n; ++i) v[i] -= dot * q[i * r + k];
      }
      double norm = 0;
      for (double x : v) norm += x * x;
      if (pass == 1 || norm > 1e-60) break;
      for (int64_t i = 0; i < n; ++i) v[i] = fallback[i * r + c];
    }
    double norm = 0;
    for (double x : v) norm += x * x;
    for (int64_t i = 0; i < n; ++i) q[i * r + c] = v[i] / std::sqrt(norm);
  }
  return q;
}

TEST_P(BackendOptimOpsTest, GramSchmidtAndLeadingEigenvectors) {
  const int64_t n = 23, r = 5;
  Tensor y = f32({n, r}, 49);
  for (int64_t i = 0; i < n; ++i) y.data<float>()[i * r + 2] = 0.0f;  // column 2 vanishes: fallback's
  check("gram_schmidt", {y, f32({n, r}, 50), f32({n * r}, 51)},
        [](Backend& b, const Tensors& t) { b.gram_schmidt(t[0], t[1], t[2]); },
        [&](Vals& v) { v[2] = gram_schmidt_ref(v[0], v[1], n, r); });
  // s = Q diag(lambda) Q^T with Q orthonormal and distinct lambda: the leading eigenvectors are
  // Q's columns by descending lambda, up to sign (compared as |<p_c, q_c>| = 1, so the reference
  // replaces p by the signed Q column).
  const Tensor basis = f32({n, n}, 52);
  const std::vector<double> q = gram_schmidt_ref(test::values(basis), test::values(basis), n, n);
  Tensor s = Tensor::empty(host_, {n, n}, DTYPE_F32, MEM_WORKSPACE);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < n; ++k) acc += q[i * n + k] * (k + 1.0) * q[j * n + k];
      s.data<float>()[i * n + j] = static_cast<float>(acc);
    }
  }
  check("leading_eigenvectors", {s, f32({n, r}, 53)}, [](Backend& b, const Tensors& t) { b.leading_eigenvectors(t[0], t[1]); },
        [&](Vals& v) {
          const Tensors got = run(*cpu_, {s, f32({n, r}, 53)}, [](Backend& b, const Tensors& t) { b.leading_eigenvectors(t[0], t[1]); });
          const std::vector<double> p = test::values(got[1]);
          for (int64_t c = 0; c < r; ++c) {
            const int64_t k = n - 1 - c;  // lambda = k + 1, descending
            double dot = 0;
            for (int64_t i = 0; i < n; ++i) dot += p[i * r + c] * q[i * n + k];
            for (int64_t i = 0; i < n; ++i) v[1][i * r + c] = sgn(dot) * q[i * n + k];
          }
        });
}

TEST_P(BackendOptimOpsTest, LdadamRotateAdamAndApply) {
  const int64_t M = 17, N = 29, r = 4;
  for (const int64_t step : {int64_t{1}, int64_t{3}}) {
    const OptimHyper h = hyper(step);
    check("ldadam_rotate", {f32({M, r}, 54), f32({M, r}, 55), f32({r * N}, 56, 0.1), f32({r * N}, 57, 0.01, 0.02),
                            f32({r * N}, 58), f32({r * N}, 59)},
          [&](Backend& b, const Tensors& t) { b.ldadam_rotate(t[0], t[1], t[2], t[3], t[4], t[5], h); },
          [&](Vals& v) {
            const double bc1 = 1 - std::pow(h.beta1, step - 1.0), bc2 = 1 - std::pow(h.beta2, step - 1.0);
            for (int64_t a = 0; a < r; ++a) {
              std::vector<double> qa(r, 0.0);  // row a of Q = P^T prev; 0 at step 1
              for (int64_t b = 0; b < r && step > 1; ++b) {
                for (int64_t i = 0; i < M; ++i) qa[b] += v[0][i * r + a] * v[1][i * r + b];
              }
              for (int64_t j = 0; j < N; ++j) {
                double mt = 0, acc = 0;
                for (int64_t b = 0; b < r; ++b) {
                  mt += qa[b] * v[2][b * N + j];
                  acc += qa[b] * qa[b] * (v[3][b * N + j] / bc2 - v[2][b * N + j] * v[2][b * N + j] / (bc1 * bc1));
                }
                v[4][a * N + j] = mt;
                v[5][a * N + j] = step > 1 ? bc2 * std::abs(acc + mt * mt / (bc1 * bc1)) : 0.0;
              }
            }
          });
  }
  const OptimHyper h = hyper();
  check("ldadam_adam", {f32({r * N}, 60, 0.1), f32({r * N}, 61), f32({r * N}, 62, 0.1), f32({r * N}, 63, 0.01, 0.02), f32({r * N}, 64)},
        [&](Backend& b, const Tensors& t) { b.ldadam_adam(t[0], t[1], t[2], t[3], t[4], h); },
        [&](Vals& v) {
          const double bc1 = 1 - std::pow(h.beta1, 3.0), bc2 = 1 - std::pow(h.beta2, 3.0);
          for (int64_t i = 0; i < r * N; ++i) {
            v[0][i] = h.beta1 * v[2][i] + (1 - h.beta1) * v[4][i];
            v[1][i] = h.beta2 * v[3][i] + (1 - h.beta2) * v[4][i] * v[4][i];
            v[2][i] = (v[0][i] / bc1) / (std::sqrt(v[1][i] / bc2) + h.eps);
          }
        });
  for (const bool transpose : {false, true}) {
    check("ldadam_apply", {f32({M, N}, 65), f32({M, N}, 66), f32({M * N}, 67), f32({M * N}, 68)},
          [&](Backend& b, const Tensors& t) { b.ldadam_apply(t[0], t[1], t[2], t[3], transpose, h); },
          [&](Vals& v) {
            for (int64_t i = 0; i < M; ++i) {
              for (int64_t j = 0; j < N; ++j) {
                const int64_t k = transpose ? j * M + i : i * N + j;
                v[0][i * N + j] = v[0][i * N + j] * (1 - h.lr * h.weight_decay) - h.lr * v[2][k];
                v[1][i * N + j] = v[3][k];
              }
            }
          });
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendOptimOpsTest, ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace loom
