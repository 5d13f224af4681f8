// CPU kernels of the optimizer ops (contracts in backend.h; the rules and their papers in
// docs/optimizers.md and optim/*.cpp). The loops are the optimizers' own, moved here unchanged:
// the same arithmetic in the same order under the same OpenMP schedules, so every optimizer's
// results are the bits they were when the loops ran in optim/.
#include "loom/backend/cpu/cpu_optim_ops.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>
#include <vector>

#include "loom/backend/checks.h"
#include "loom/backend/cpu/cpu_math.h"
#include "loom/backend/optim_checks.h"
#include "loom/core/error.h"

extern "C" void dsyevd_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda, double* w, double* work,
                        const int* lwork, int* iwork, const int* liwork, int* info, size_t jobz_len, size_t uplo_len);

namespace loom::cpu {

using checks::rows_of;

namespace {

float* opt(const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; }

}  // namespace

void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, const OptimHyper& h) {
  const int64_t n = checks::check_sgd_step(param, grad, buf);
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* b = opt(buf);
  const float mu = static_cast<float>(h.momentum), damp = static_cast<float>(h.dampening);
  const bool nesterov = h.nesterov, first = h.step == 1;
  const float eta = static_cast<float>(h.lr), wd = h.weight_decay, gs = h.grad_scale;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i] * gs + wd * p[i];
    if (b != nullptr) {
      b[i] = first ? d : mu * b[i] + (1.0f - damp) * d;
      d = nesterov ? d + mu * b[i] : b[i];
    }
    p[i] -= eta * d;
  }
}

void adagrad_step(const Tensor& param, const Tensor& grad, const Tensor& sum, const OptimHyper& h) {
  const int64_t n = checks::check_adagrad_step(param, grad, sum);
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* s = sum.data<float>();
  const float eps = static_cast<float>(h.eps), clr = static_cast<float>(h.lr), wd = h.weight_decay, gs = h.grad_scale;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float d = g[i] * gs + wd * p[i];
    s[i] += d * d;
    p[i] -= clr * d / (std::sqrt(s[i]) + eps);
  }
}

void rmsprop_step(const Tensor& param, const Tensor& grad, const Tensor& square, const Tensor& avg, const Tensor& buf,
                  const OptimHyper& h) {
  const int64_t n = checks::check_rmsprop_step(param, grad, square, avg, buf);
  const float a = static_cast<float>(h.beta2), eps = static_cast<float>(h.eps), mu = static_cast<float>(h.momentum);
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* s = square.data<float>();
  float* ga = opt(avg);
  float* b = opt(buf);
  const float eta = static_cast<float>(h.lr), wd = h.weight_decay, gs = h.grad_scale;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float d = g[i] * gs + wd * p[i];
    s[i] = a * s[i] + (1.0f - a) * d * d;
    float den;
    if (ga != nullptr) {
      ga[i] = a * ga[i] + (1.0f - a) * d;
      den = std::sqrt(s[i] - ga[i] * ga[i]) + eps;
    } else {
      den = std::sqrt(s[i]) + eps;
    }
    if (b != nullptr) {
      b[i] = mu * b[i] + d / den;
      p[i] -= eta * b[i];
    } else {
      p[i] -= eta * d / den;
    }
  }
}

void adam_step(const Tensor& param, const Tensor& grad, const Tensor& m_, const Tensor& v_, const Tensor& vmax_,
               const OptimHyper& h) {
  const int64_t n = checks::check_adam_step(param, grad, m_, v_, vmax_);
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* m = m_.data<float>();
  float* v = v_.data<float>();
  float* vmax = opt(vmax_);
  const float eta = static_cast<float>(h.lr), gs = h.grad_scale;
  const float b1 = static_cast<float>(h.beta1), b2 = static_cast<float>(h.beta2), eps = static_cast<float>(h.eps);
  const float bias1 = static_cast<float>(1.0 - std::pow(h.beta1, static_cast<double>(h.step)));
  const float bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, static_cast<double>(h.step))));
  const float step_size = eta / bias1;
  const float l2 = h.decoupled ? 0.0f : h.weight_decay, decay = h.decoupled ? 1.0f - eta * h.weight_decay : 1.0f;
#pragma omp parallel for simd schedule(dynamic, kStreamChunk) if (n > kStreamChunk)
  for (int64_t i = 0; i < n; ++i) {
    const float d = g[i] * gs + l2 * p[i];
    p[i] *= decay;
    m[i] = b1 * m[i] + (1.0f - b1) * d;
    v[i] = b2 * v[i] + (1.0f - b2) * d * d;
    float denom_v = v[i];
    if (vmax != nullptr) {
      vmax[i] = std::max(vmax[i], v[i]);
      denom_v = vmax[i];
    }
    p[i] -= step_size * m[i] / (std::sqrt(denom_v) / bias2_sqrt + eps);
  }
}

void lion_step(const Tensor& param, const Tensor& grad, const Tensor& m_, const OptimHyper& h) {
  const int64_t n = checks::check_lion_step(param, grad, m_);
  const float b1 = static_cast<float>(h.beta1), b2 = static_cast<float>(h.beta2);
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* m = m_.data<float>();
  const float eta = static_cast<float>(h.lr), decay = 1.0f - eta * h.weight_decay, gs = h.grad_scale;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float d = g[i] * gs;
    const float c = b1 * m[i] + (1.0f - b1) * d;
    const float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
    p[i] = p[i] * decay - eta * sign;
    m[i] = b2 * m[i] + (1.0f - b2) * d;
  }
}

void adam_mini_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const OptimHyper& h) {
  const auto [n, nblocks, bn] = checks::check_adam_mini_step(param, grad, m, v);
  const float b1 = static_cast<float>(h.beta1), eps = static_cast<float>(h.eps), gs = h.grad_scale;
  const double b2 = h.beta2;
  const float bias1 = static_cast<float>(1.0 - std::pow(h.beta1, static_cast<double>(h.step)));
  const double bias2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  const float eta = static_cast<float>(h.lr), decay = 1.0f - eta * h.weight_decay;
  float* vb = v.data<float>();
  float* p0 = param.data<float>();
  const float* g0 = grad.data<float>();
  float* m0 = m.data<float>();
#pragma omp parallel for schedule(static) if (nblocks > 1)
  for (int64_t j = 0; j < nblocks; ++j) {
    const int64_t offset = j * bn;
    double sq = 0.0;
    for (int64_t i = offset; i < offset + bn; ++i) {
      const double d = static_cast<double>(g0[i] * gs);
      sq += d * d;
    }
    vb[j] = static_cast<float>(b2 * vb[j] + (1.0 - b2) * (sq / static_cast<double>(bn)));
    const float denom = static_cast<float>(std::sqrt(static_cast<double>(vb[j]) / bias2)) + eps;
    for (int64_t i = offset; i < offset + bn; ++i) {
      const float d = g0[i] * gs;
      m0[i] = b1 * m0[i] + (1.0f - b1) * d;
      p0[i] = p0[i] * decay - eta * (m0[i] / bias1) / denom;
    }
  }
}

void scale_transpose(const Tensor& src, const Tensor& dst, float scale, bool transpose) {
  const auto [rows, cols] = checks::check_scale_transpose(src, dst);
  const int64_t n = src.numel();
  const float* s = src.data<float>();
  float* d = dst.data<float>();
  if (transpose) {
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) d[j * rows + i] = s[i * cols + j] * scale;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) d[i] = s[i] * scale;
  }
}

void axpy(const Tensor& y, const Tensor& x, float alpha) {
  const int64_t n = checks::check_axpy(y, x);
  float* Y = y.data<float>();
  const float* X = x.data<float>();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) Y[i] += alpha * X[i];
}

void muon_momentum(const Tensor& grad, const Tensor& buf, const Tensor& u, const OptimHyper& h) {
  const int64_t n = checks::check_muon_momentum(grad, buf, u);
  const float mu = static_cast<float>(h.momentum), gs = h.grad_scale;
  const bool nesterov = h.nesterov;
  const float* g = grad.data<float>();
  float* B = buf.data<float>();
  float* U = u.data<float>();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float d = g[i] * gs;
    B[i] = mu * B[i] + (1.0f - mu) * d;
    U[i] = nesterov ? (1.0f - mu) * d + mu * B[i] : B[i];
  }
}

void newton_schulz_normalize(const Tensor& u, const Tensor& x) {
  const int64_t n = checks::check_newton_schulz_normalize(u, x);
  const float* U = u.data<float>();
  double norm = 0.0;
  for (int64_t i = 0; i < n; ++i) norm += static_cast<double>(U[i]) * U[i];
  const float inv = static_cast<float>(1.0 / (std::sqrt(norm) + 1e-7));
  scale_transpose(u, x, inv, rows_of(u) > u.dim(-1));
}

void decayed_update(const Tensor& param, const Tensor& u, float decay, float step) {
  const int64_t n = checks::check_decayed_update(param, u);
  float* p = param.data<float>();
  const float* U = u.data<float>();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] * decay - step * U[i];
}

// ---------------------------------------------------------------- LDAdam (Robert et al. 2024)

void leading_eigenvectors(const Tensor& s_, const Tensor& p) {
  const auto [n, r] = checks::check_leading_eigenvectors(s_, p);
  std::vector<double> s(s_.data<float>(), s_.data<float>() + n * n);
  float* out = p.data<float>();
  const int N = static_cast<int>(n);
  std::vector<double> w(static_cast<size_t>(n));
  int lwork = -1, liwork = -1, info = 0, iwork_query = 0;
  double work_query = 0.0;
  dsyevd_("V", "U", &N, s.data(), &N, w.data(), &work_query, &lwork, &iwork_query, &liwork, &info, 1, 1);
  LOOM_CHECK(info == 0, "LDAdam: LAPACK dsyevd workspace query failed (info ", info, ")");
  lwork = static_cast<int>(work_query);
  liwork = iwork_query;
  std::vector<double> work(static_cast<size_t>(lwork));
  std::vector<int> iwork(static_cast<size_t>(liwork));
  dsyevd_("V", "U", &N, s.data(), &N, w.data(), work.data(), &lwork, iwork.data(), &liwork, &info, 1, 1);
  LOOM_CHECK(info == 0, "LDAdam: LAPACK dsyevd did not converge (info ", info, ")");
  // Eigenvalues ascend; eigenvector k is column k (column-major), i.e. s[k*n .. k*n+n).
  for (int64_t c = 0; c < r; ++c) {
    const double* v = s.data() + (n - 1 - c) * n;
    for (int64_t i = 0; i < n; ++i) out[i * r + c] = static_cast<float>(v[i]);
  }
}

void gram_schmidt(const Tensor& y_, const Tensor& fallback_, const Tensor& p) {
  const auto [n, r] = checks::check_gram_schmidt(y_, fallback_, p);
  const float* y = y_.data<float>();
  const float* fallback = fallback_.data<float>();
  float* out = p.data<float>();
  std::vector<double> q(static_cast<size_t>(n * r));
  for (int64_t c = 0; c < r; ++c) {
    std::vector<double> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = y[i * r + c];
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t k = 0; k < c; ++k) {
        double dot = 0.0;
        for (int64_t i = 0; i < n; ++i) dot += q[static_cast<size_t>(i * r + k)] * v[static_cast<size_t>(i)];
        for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] -= dot * q[static_cast<size_t>(i * r + k)];
      }
      if (pass == 0) {
        double norm = 0.0;
        for (double x : v) norm += x * x;
        if (norm <= 1e-60) {
          for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = fallback[i * r + c];
        } else {
          break;  // one pass is Gram-Schmidt as specified; the second only rescues a vanished column
        }
      }
    }
    double norm = 0.0;
    for (double x : v) norm += x * x;
    norm = std::sqrt(norm);
    for (int64_t i = 0; i < n; ++i) q[static_cast<size_t>(i * r + c)] = norm > 0.0 ? v[static_cast<size_t>(i)] / norm : 0.0;
  }
  for (int64_t i = 0; i < n * r; ++i) out[i] = static_cast<float>(q[static_cast<size_t>(i)]);
}

void ldadam_rotate(const Tensor& p, const Tensor& prev, const Tensor& m_, const Tensor& v_, const Tensor& mt_,
                   const Tensor& vt_, const OptimHyper& h) {
  const auto [M, r, N] = checks::check_ldadam_rotate(p, prev, m_, v_, mt_, vt_);
  const int64_t t = h.step;
  const double b1 = h.beta1, b2 = h.beta2;
  const float* P = p.data<float>();
  const float* Pp = prev.data<float>();
  const float* m = m_.data<float>();
  const float* v = v_.data<float>();
  float* mt = mt_.data<float>();
  float* vt = vt_.data<float>();
  std::vector<double> Q(static_cast<size_t>(r * r), 0.0);
  const double bc1_prev = 1.0 - std::pow(b1, static_cast<double>(t - 1));
  const double bc2_prev = 1.0 - std::pow(b2, static_cast<double>(t - 1));
  if (t > 1) {  // Q = P_t^T P_{t-1}
    for (int64_t a = 0; a < r; ++a) {
      for (int64_t b = 0; b < r; ++b) {
        double dot = 0.0;
        for (int64_t i = 0; i < M; ++i) dot += static_cast<double>(P[i * r + a]) * Pp[i * r + b];
        Q[static_cast<size_t>(a * r + b)] = dot;
      }
    }
  }
  for (int64_t a = 0; a < r; ++a) {
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0.0;
      for (int64_t b = 0; b < r; ++b) acc += Q[static_cast<size_t>(a * r + b)] * m[b * N + j];
      mt[a * N + j] = static_cast<float>(acc);
    }
  }
  std::fill_n(vt, r * N, 0.0f);
  if (t > 1) {
    const double c1 = 1.0 / (bc1_prev * bc1_prev);
    for (int64_t a = 0; a < r; ++a) {
      for (int64_t j = 0; j < N; ++j) {
        double acc = 0.0;
        for (int64_t b = 0; b < r; ++b) {
          const double qq = Q[static_cast<size_t>(a * r + b)] * Q[static_cast<size_t>(a * r + b)];
          acc += qq * (v[b * N + j] / bc2_prev - static_cast<double>(m[b * N + j]) * m[b * N + j] * c1);
        }
        acc += static_cast<double>(mt[a * N + j]) * mt[a * N + j] * c1;
        vt[a * N + j] = static_cast<float>(bc2_prev * std::fabs(acc));
      }
    }
  }
}

void ldadam_adam(const Tensor& m_, const Tensor& v_, const Tensor& mt_, const Tensor& vt_, const Tensor& gh_,
                 const OptimHyper& h) {
  const int64_t n = checks::check_ldadam_adam(m_, v_, mt_, vt_, gh_);
  const double b1 = h.beta1, b2 = h.beta2;
  const int64_t t = h.step;
  const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2), eps = static_cast<float>(h.eps);
  const float bc1 = static_cast<float>(1.0 - std::pow(b1, static_cast<double>(t)));
  const float bc2 = static_cast<float>(1.0 - std::pow(b2, static_cast<double>(t)));
  float* m = m_.data<float>();
  float* v = v_.data<float>();
  float* mt = mt_.data<float>();
  const float* vt = vt_.data<float>();
  const float* gh = gh_.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    m[i] = fb1 * mt[i] + (1.0f - fb1) * gh[i];
    v[i] = fb2 * vt[i] + (1.0f - fb2) * gh[i] * gh[i];
    mt[i] = (m[i] / bc1) / (std::sqrt(v[i] / bc2) + eps);
  }
}

void ldadam_apply(const Tensor& param, const Tensor& grad, const Tensor& d_, const Tensor& e_, bool transpose,
                  const OptimHyper& h) {
  const auto [rows, cols] = checks::check_ldadam_apply(param, grad, d_, e_);
  float* p = param.data<float>();
  float* g = grad.data<float>();
  const float* d = d_.data<float>();
  const float* e = e_.data<float>();
  const float eta = static_cast<float>(h.lr), decay = 1.0f - eta * h.weight_decay;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t k = transpose ? j * rows + i : i * cols + j;
      p[i * cols + j] = p[i * cols + j] * decay - eta * d[k];
      g[i * cols + j] = e[k];
    }
  }
}

}  // namespace loom::cpu
