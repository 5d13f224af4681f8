// CPU kernels of LDAdam's ops (Robert et al. 2024; Backend::ldadam_*, the contracts in backend.h):
// the projector's orthonormalization and first eigenvectors, the state's rotation into the new
// subspace, Adam there and the update's application. Compiled without floating-point contraction
// (-ffp-contract=off, CMakeLists.txt), like cpu_optim_factored.cpp and their CUDA twins
// (cuda_optim_factored.cu, nvcc -fmad=false): every product and sum rounded on its own on both
// sides, so the GPU gives these bits without depending on two compilers' contraction rules.
#include <algorithm>
#include <cmath>
#include <vector>

#include "loom/backend/checks.h"
#include "loom/backend/cpu/cpu_optim_ops.h"
#include "loom/backend/optim_checks.h"
#include "loom/core/error.h"

extern "C" void dsyevd_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda, double* w, double* work,
                        const int* lwork, int* iwork, const int* liwork, int* info, size_t jobz_len, size_t uplo_len);

namespace loom::cpu {

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
