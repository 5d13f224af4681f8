// Rules with factored (sublinear) second-moment state: Adafactor (Shazeer & Stern 2018, the
// Hugging Face semantics), SM3-II (Anil et al. 2019, row and column covers) and CAME (Luo et
// al. 2023, confidence-guided Adafactor). Each matrix segment is factored on its own; a 1-D
// parameter keeps per-element state. docs/optimizers.md has the exact rules.
#include <algorithm>
#include <cmath>

#include "loom/optim/rules.h"

namespace loom {

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

int64_t max_segment(const std::vector<OptimParam>& list) {
  int64_t n = 1;
  for (const OptimParam& q : list) {
    for (const OptimSegment& s : q.segments) n = std::max(n, s.rows * s.cols);
  }
  return n;
}

// Adafactor's (and CAME's) preconditioned gradient U = g / sqrt(V_hat) of an m x n segment,
// with V_hat the factored EMA (state R then C) of g^2 + eps1 for a matrix, the plain EMA
// (state V) for a vector. Returns the state pointer past this segment's entries.
float* precondition(bool matrix, int64_t m, int64_t n, const float* g, float gs, double beta, double eps1, float* state, float* U,
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
    return state + m + n;
  }
  const float b = static_cast<float>(beta), e = static_cast<float>(eps1);
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float d = g[i] * gs;
    state[i] = b * state[i] + (1.0f - b) * (d * d + e);
    U[i] = d / std::sqrt(state[i]);
  }
  return state + N;
}

// Second-moment state per parameter: R and C per segment of a matrix, else one per element.
int64_t factored_size(const OptimParam& q) {
  if (!q.matrix) return q.numel;
  int64_t n = 0;
  for (const OptimSegment& s : q.segments) n += s.rows + s.cols;
  return n;
}

class Adafactor final : public Optimizer {
 public:
  Adafactor(Backend& b, const Tensor& params, const Tensor& grads, std::vector<OptimParam> list, const OptimConfig& c)
      : Optimizer(c, b, params, grads, std::move(list)) {
    int64_t total = 0;
    offsets_ = state_offsets(list_, factored_size, &total);
    v_ = add_state("exp_avg_sq_factored", total);
    if (c_.beta1 > 0.0) m_ = add_state("exp_avg", numel_total_);
    work_ = Tensor::empty(b.allocator(), {max_segment(list_)}, DTYPE_F32, MEM_WORKSPACE);
  }

 private:
  void update(float lr, float gs) override {
    const double t = static_cast<double>(step_);
    double rho = std::min(1e-2, 1.0 / std::sqrt(t));
    if (c_.warmup_init) rho = std::min(1e-6 * t, 1.0 / std::sqrt(t));
    const double beta2t = 1.0 - std::pow(t, c_.decay_rate);
    const double eps1 = c_.eps;
    float* U = work_.data<float>();
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      float* state = v_.data<float>() + offsets_[k];
      float* mom = m_.defined() ? m_.data<float>() + element_offsets_[k] : nullptr;
      for (const OptimSegment& s : q.segments) {
        const int64_t m = s.rows, n = s.cols, N = m * n;
        float* p = params_.data<float>() + s.offset;
        const float* g = grads_.data<float>() + s.offset;
        const double rms_theta = std::sqrt(sum_squares(p, N) / static_cast<double>(N));
        const double base = c_.relative_step ? rho * q.lr_scale : static_cast<double>(lr) * q.lr_scale;
        const float lr_eff = static_cast<float>(base * (c_.scale_parameter ? std::max(c_.eps2, rms_theta) : 1.0));
        state = precondition(q.matrix, m, n, g, gs, beta2t, eps1, state, U, rf_, cf_);
        const double rms_u = std::sqrt(sum_squares(U, N) / static_cast<double>(N));
        const float scale = static_cast<float>(lr_eff / std::max(1.0, rms_u / c_.clip_threshold));
        const float decay = 1.0f - q.weight_decay * lr_eff, b1 = static_cast<float>(c_.beta1);
        float* M = mom != nullptr ? mom + (s.offset - q.offset) : nullptr;
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < N; ++i) {
          float u = U[i] * scale;
          if (M != nullptr) {
            M[i] = b1 * M[i] + (1.0f - b1) * u;
            u = M[i];
          }
          p[i] = p[i] * decay - u;
        }
      }
    }
  }

  std::vector<int64_t> offsets_;
  Tensor v_, m_, work_;
  std::vector<float> rf_, cf_;
};

class Sm3 final : public Optimizer {
 public:
  Sm3(Backend& b, const Tensor& params, const Tensor& grads, std::vector<OptimParam> list, const OptimConfig& c)
      : Optimizer(c, b, params, grads, std::move(list)) {
    int64_t total = 0;
    offsets_ = state_offsets(list_, factored_size, &total);
    acc_ = add_state("accumulators", total);
  }

 private:
  void update(float lr, float gs) override {
    const float eps = static_cast<float>(c_.eps);
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      float* acc = acc_.data<float>() + offsets_[k];
      const float eta = lr * q.lr_scale, decay = 1.0f - eta * q.weight_decay;
      auto step_of = [&](float g, float nu) { return nu > 0.0f ? g / (std::sqrt(nu) + eps) : 0.0f; };
      if (!q.matrix) {  // singleton covers: nu = mu + g^2, mu = nu
        float* p = this->p(q);
        const float* g = this->g(q);
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < q.numel; ++i) {
          const float d = g[i] * gs;
          acc[i] += d * d;
          p[i] = p[i] * decay - eta * step_of(d, acc[i]);
        }
        continue;
      }
      for (const OptimSegment& s : q.segments) {
        const int64_t m = s.rows, n = s.cols;
        float* mr = acc;
        float* mc = acc + m;
        acc += m + n;
        float* p = params_.data<float>() + s.offset;
        const float* g = grads_.data<float>() + s.offset;
        auto nu = [&](int64_t i, int64_t j) {
          const float d = g[i * n + j] * gs;
          return std::min(mr[i], mc[j]) + d * d;
        };
        new_cols_.assign(static_cast<size_t>(n), 0.0f);
        rows_.assign(static_cast<size_t>(m), 0.0f);
#pragma omp parallel for schedule(static)
        for (int64_t j0 = 0; j0 < n; j0 += kColumnChunk) {
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = j0; j < std::min(n, j0 + kColumnChunk); ++j) new_cols_[static_cast<size_t>(j)] = std::max(new_cols_[static_cast<size_t>(j)], nu(i, j));
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
          rows_[static_cast<size_t>(i)] = row_max;
        }
        std::copy_n(rows_.data(), m, mr);
        std::copy_n(new_cols_.data(), n, mc);
      }
    }
  }

  std::vector<int64_t> offsets_;
  Tensor acc_;
  std::vector<float> new_cols_, rows_;
};

class Came final : public Optimizer {
 public:
  Came(Backend& b, const Tensor& params, const Tensor& grads, std::vector<OptimParam> list, const OptimConfig& c)
      : Optimizer(c, b, params, grads, std::move(list)) {
    int64_t total = 0, residual = 0;
    offsets_ = state_offsets(list_, factored_size, &total);
    r_offsets_ = state_offsets(list_, [](const OptimParam& q) { return q.matrix ? factored_size(q) : 0; }, &residual);
    m_ = add_state("exp_avg", numel_total_);
    v_ = add_state("exp_avg_sq_factored", total);
    if (residual > 0) r_ = add_state("exp_avg_res_factored", residual);
    work_ = Tensor::empty(b.allocator(), {max_segment(list_)}, DTYPE_F32, MEM_WORKSPACE);
  }

 private:
  void update(float lr, float gs) override {
    const double b2 = c_.beta2, b3 = c_.beta3, eps1 = c_.eps, eps2 = c_.eps2;
    const float b1 = static_cast<float>(c_.beta1);
    float* U = work_.data<float>();
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      float* state = v_.data<float>() + offsets_[k];
      float* res = q.matrix ? r_.data<float>() + r_offsets_[k] : nullptr;
      const float eta = lr * q.lr_scale, decay = 1.0f - eta * q.weight_decay;
      for (const OptimSegment& s : q.segments) {
        const int64_t m = s.rows, n = s.cols, N = m * n;
        float* p = params_.data<float>() + s.offset;
        const float* g = grads_.data<float>() + s.offset;
        float* M = m_.data<float>() + element_offsets_[k] + (s.offset - q.offset);
        state = precondition(q.matrix, m, n, g, gs, b2, eps1, state, U, rf_, cf_);
        const double rms_u = std::sqrt(sum_squares(U, N) / static_cast<double>(N));
        const float clip = static_cast<float>(1.0 / std::max(1.0, rms_u / c_.clip_threshold));
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < N; ++i) {
          U[i] *= clip;
          M[i] = b1 * M[i] + (1.0f - b1) * U[i];
        }
        if (!q.matrix) {  // no confidence factor on vectors: D = M
#pragma omp parallel for simd schedule(static)
          for (int64_t i = 0; i < N; ++i) p[i] = p[i] * decay - eta * M[i];
          continue;
        }
        float* Rr = res;
        float* Cr = res + m;
        res += m + n;
        factored_ema(m, n, [&](int64_t i, int64_t j) { const double d = static_cast<double>(U[i * n + j]) - M[i * n + j]; return d * d + eps2; },
                     Rr, Cr, b3);
        inverse_sqrt_factors(m, n, Rr, Cr, rf_, cf_);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            p[i * n + j] = p[i * n + j] * decay - eta * M[i * n + j] * rf_[static_cast<size_t>(i)] * cf_[static_cast<size_t>(j)];
          }
        }
      }
    }
  }

  std::vector<int64_t> offsets_, r_offsets_;
  Tensor m_, v_, r_, work_;
  std::vector<float> rf_, cf_;
};

}  // namespace

std::unique_ptr<Optimizer> make_adafactor(Backend& b, const Tensor& p, const Tensor& g, std::vector<OptimParam> l,
                                          const OptimConfig& c) {
  return std::make_unique<Adafactor>(b, p, g, std::move(l), c);
}
std::unique_ptr<Optimizer> make_sm3(Backend& b, const Tensor& p, const Tensor& g, std::vector<OptimParam> l, const OptimConfig& c) {
  return std::make_unique<Sm3>(b, p, g, std::move(l), c);
}
std::unique_ptr<Optimizer> make_came(Backend& b, const Tensor& p, const Tensor& g, std::vector<OptimParam> l, const OptimConfig& c) {
  return std::make_unique<Came>(b, p, g, std::move(l), c);
}

}  // namespace loom
