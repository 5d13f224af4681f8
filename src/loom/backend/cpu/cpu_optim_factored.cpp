// CPU kernels of the factored optimizer ops (Backend::adafactor_step, sm3_step, came_step; the
// contracts in backend.h): Adafactor (Shazeer & Stern 2018, the Hugging Face semantics), SM3-II
// (Anil et al. 2019, row and column covers) and CAME (Luo et al. 2023), one segment a call. The
// loops are optim/factored.cpp's own, moved here unchanged (same arithmetic, order and OpenMP
// schedules): row and column sums run in double in an order independent of the thread count;
// the RMS of the parameters and of the update use OpenMP's reduction, as they always did.
// Compiled without floating-point contraction (-ffp-contract=off, CMakeLists.txt), as their CUDA
// twins are (cuda_optim_factored.cu): every product rounded on its own, the GPU's bits the CPU's.
#include <algorithm>
#include <cmath>
#include <vector>

#include "loom/backend/cpu/cpu_optim_ops.h"
#include "loom/backend/optim_checks.h"
#include "loom/core/error.h"

namespace loom::cpu {

namespace {

constexpr int64_t kColumnChunk = 64;

// EMA of the row and column means of u(i, j) over an m x n segment:
//   R_i = beta R_i + (1-beta) mean_j u(i,j);  C_j = beta C_j + (1-beta) mean_i u(i,j).
// Sums in double, in an order independent of the thread count.
template <typename F>
void factored_ema(int64_t m, int64_t n, const F& u, float* R, float* C, double beta) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    double s = 0.0;
    for (int64_t j = 0; j < n; ++j) s += u(i, j);
    R[i] = static_cast<float>(beta * R[i] + (1.0 - beta) * (s / static_cast<double>(n)));
  }
#pragma omp parallel for schedule(static)
  for (int64_t j0 = 0; j0 < n; j0 += kColumnChunk) {
    const int64_t j1 = std::min(n, j0 + kColumnChunk);
    double s[kColumnChunk] = {};
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = j0; j < j1; ++j) s[j - j0] += u(i, j);
    }
    for (int64_t j = j0; j < j1; ++j) C[j] = static_cast<float>(beta * C[j] + (1.0 - beta) * (s[j - j0] / static_cast<double>(m)));
  }
}

// The factors of 1/sqrt(V_hat) with V_hat_ij = R_i / mean(R) * C_j: rf_i = rsqrt(R_i/mean(R)),
// cf_j = rsqrt(C_j) (Adafactor's approx_sq_grad).
void inverse_sqrt_factors(int64_t m, int64_t n, const float* R, const float* C, std::vector<float>& rf, std::vector<float>& cf) {
  double mean = 0.0;
  for (int64_t i = 0; i < m; ++i) mean += R[i];
  mean /= static_cast<double>(m);
  rf.resize(static_cast<size_t>(m));
  cf.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < m; ++i) rf[static_cast<size_t>(i)] = static_cast<float>(1.0 / std::sqrt(R[i] / mean));
  for (int64_t j = 0; j < n; ++j) cf[static_cast<size_t>(j)] = static_cast<float>(1.0 / std::sqrt(static_cast<double>(C[j])));
}

double sum_squares(const float* x, int64_t n) {
  double s = 0.0;
#pragma omp parallel for reduction(+ : s) schedule(static)
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

// Adafactor's (and CAME's) preconditioned gradient U = g / sqrt(V_hat) of an m x n segment,
// with V_hat the factored EMA (state R then C) of g^2 + eps1 for a matrix, the plain EMA
// (state V) for a vector.
void precondition(bool matrix, int64_t m, int64_t n, const float* g, float gs, double beta, double eps1, float* state, float* U,
                  std::vector<float>& rf, std::vector<float>& cf) {
  const int64_t N = m * n;
  if (matrix) {
    float* R = state;
    float* C = state + m;
    factored_ema(m, n, [&](int64_t i, int64_t j) { const double d = g[i * n + j] * gs; return d * d + eps1; }, R, C, beta);
    inverse_sqrt_factors(m, n, R, C, rf, cf);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) U[i * n + j] = g[i * n + j] * gs * rf[static_cast<size_t>(i)] * cf[static_cast<size_t>(j)];
    }
    return;
  }
  const float b = static_cast<float>(beta), e = static_cast<float>(eps1);
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float d = g[i] * gs;
    state[i] = b * state[i] + (1.0f - b) * (d * d + e);
    U[i] = d / std::sqrt(state[i]);
  }
}

}  // namespace

void adafactor_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m_, const Tensor& u,
                    const OptimHyper& h) {
  const auto [m, n] = checks::check_adafactor_step(param, grad, state, m_, u, h.factored);
  const int64_t N = m * n;
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* U = u.data<float>();
  const double rms_theta = std::sqrt(sum_squares(p, N) / static_cast<double>(N));
  const float lr_eff = static_cast<float>(h.lr * (h.scale_parameter ? std::max(h.eps2, rms_theta) : 1.0));
  std::vector<float> rf, cf;
  precondition(h.factored, m, n, g, h.grad_scale, h.beta2, h.eps, state.data<float>(), U, rf, cf);
  const double rms_u = std::sqrt(sum_squares(U, N) / static_cast<double>(N));
  const float scale = static_cast<float>(lr_eff / std::max(1.0, rms_u / h.clip_threshold));
  const float decay = 1.0f - h.weight_decay * lr_eff, b1 = static_cast<float>(h.beta1);
  float* M = m_.defined() ? m_.data<float>() : nullptr;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    float v = U[i] * scale;
    if (M != nullptr) {
      M[i] = b1 * M[i] + (1.0f - b1) * v;
      v = M[i];
    }
    p[i] = p[i] * decay - v;
  }
}

void sm3_step(const Tensor& param, const Tensor& grad, const Tensor& acc_, const OptimHyper& h) {
  const auto [m, n] = checks::check_sm3_step(param, grad, acc_, h.factored);
  const float eps = static_cast<float>(h.eps), gs = h.grad_scale;
  const float eta = static_cast<float>(h.lr), decay = 1.0f - eta * h.weight_decay;
  float* acc = acc_.data<float>();
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  auto step_of = [&](float gv, float nu) { return nu > 0.0f ? gv / (std::sqrt(nu) + eps) : 0.0f; };
  if (!h.factored) {  // singleton covers: nu = mu + g^2, mu = nu
    const int64_t N = m * n;
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float d = g[i] * gs;
      acc[i] += d * d;
      p[i] = p[i] * decay - eta * step_of(d, acc[i]);
    }
    return;
  }
  float* mr = acc;
  float* mc = acc + m;
  auto nu = [&](int64_t i, int64_t j) {
    const float d = g[i * n + j] * gs;
    return std::min(mr[i], mc[j]) + d * d;
  };
  std::vector<float> new_cols(static_cast<size_t>(n), 0.0f), rows(static_cast<size_t>(m), 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t j0 = 0; j0 < n; j0 += kColumnChunk) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = j0; j < std::min(n, j0 + kColumnChunk); ++j) new_cols[static_cast<size_t>(j)] = std::max(new_cols[static_cast<size_t>(j)], nu(i, j));
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    float row_max = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const float v = nu(i, j);
      row_max = std::max(row_max, v);
      p[i * n + j] = p[i * n + j] * decay - eta * step_of(g[i * n + j] * gs, v);
    }
    rows[static_cast<size_t>(i)] = row_max;
  }
  std::copy_n(rows.data(), m, mr);
  std::copy_n(new_cols.data(), n, mc);
}

void came_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m_, const Tensor& res_,
               const Tensor& u, const OptimHyper& h) {
  const auto [m, n] = checks::check_came_step(param, grad, state, m_, res_, u, h.factored);
  const int64_t N = m * n;
  const double b3 = h.beta3, eps2 = h.eps2;
  const float b1 = static_cast<float>(h.beta1);
  const float eta = static_cast<float>(h.lr), decay = 1.0f - eta * h.weight_decay;
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* M = m_.data<float>();
  float* U = u.data<float>();
  std::vector<float> rf, cf;
  precondition(h.factored, m, n, g, h.grad_scale, h.beta2, h.eps, state.data<float>(), U, rf, cf);
  const double rms_u = std::sqrt(sum_squares(U, N) / static_cast<double>(N));
  const float clip = static_cast<float>(1.0 / std::max(1.0, rms_u / h.clip_threshold));
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    U[i] *= clip;
    M[i] = b1 * M[i] + (1.0f - b1) * U[i];
  }
  if (!h.factored) {  // no confidence factor on vectors: D = M
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < N; ++i) p[i] = p[i] * decay - eta * M[i];
    return;
  }
  float* Rr = res_.data<float>();
  float* Cr = Rr + m;
  factored_ema(m, n, [&](int64_t i, int64_t j) { const double d = static_cast<double>(U[i * n + j]) - M[i * n + j]; return d * d + eps2; },
               Rr, Cr, b3);
  inverse_sqrt_factors(m, n, Rr, Cr, rf, cf);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      p[i * n + j] = p[i * n + j] * decay - eta * M[i * n + j] * rf[static_cast<size_t>(i)] * cf[static_cast<size_t>(j)];
    }
  }
}

}  // namespace loom::cpu
