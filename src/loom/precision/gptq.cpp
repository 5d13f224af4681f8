// GPTQ and SparseGPT on host arrays (gptq.h states the algorithm). tools/gptq_reference.py is
// an independent PyTorch implementation of the same steps; tests/test_compress.cpp compares the
// two. The Cholesky factorizations and the inverse are LAPACK's (dpotrf, dpotri), GPTQ's lazy batch
// update BLAS's dgemm.
#include "loom/precision/gptq.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "loom/core/error.h"

extern "C" void dpotrf_(const char* uplo, const int* n, double* a, const int* lda, int* info, size_t uplo_len);
extern "C" void dpotri_(const char* uplo, const int* n, double* a, const int* lda, int* info, size_t uplo_len);
extern "C" void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
                       const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
                       const int* ldc, size_t transa_len, size_t transb_len);

namespace loom {
namespace {

// The format's group parameters for values x (double): int_stored_params of their range (the
// scale computed in double and rounded to what is stored, the zero point from it).
GroupParams group_params(const double* x, int64_t n, int64_t stride, int bits, const IntStorage& storage) {
  double lo = 0.0, hi = 0.0;
  for (int64_t i = 0; i < n; ++i) lo = std::min(lo, x[i * stride]), hi = std::max(hi, x[i * stride]);
  return int_stored_params(lo, hi, bits, storage);
}

uint8_t quantize(double x, const GroupParams& p, int bits) {
  const double top = static_cast<double>((1 << bits) - 1);
  return static_cast<uint8_t>(std::clamp(std::nearbyint(x / static_cast<double>(p.scale)) + p.zero, 0.0, top));
}

double dequantize(uint8_t q, const GroupParams& p) {
  return static_cast<double>(p.scale) * (static_cast<double>(q) - static_cast<double>(p.zero));
}

// Column i of `row` replaced by `value`: the error (w_i - value) / U_ii is spread over the
// block's later columns [i + 1, i2) (the OBS update) and returned for the lazy batch update.
double replace_column(double* row, int64_t i, int64_t i2, double value, const std::vector<double>& u, int64_t k) {
  const double* ui = u.data() + i * k;
  const double e = (row[i] - value) / ui[i];
  for (int64_t j = i + 1; j < i2; ++j) row[j] -= e * ui[j];
  return e;
}

// After a block [i1, i2), every row's later columns at once, as AutoGPTQ's
// W[:, i2:] -= Err1 Hinv[i1:i2, i2:]: one BLAS dgemm (row-major W (R, K), err (R, B) and U seen
// column-major as their transposes), which reads U's block once for all rows instead of once per
// row (the per-row loop was bound by that traffic).
void lazy_batch_update(std::vector<double>& w, const std::vector<double>& err, int64_t R, int64_t B, int64_t i1,
                       int64_t i2, const std::vector<double>& u, int64_t K) {
  if (i2 >= K) return;
  const int m = static_cast<int>(K - i2), n = static_cast<int>(R), k = static_cast<int>(i2 - i1);
  const int lda = static_cast<int>(K), ldb = static_cast<int>(B), ldc = static_cast<int>(K);
  const double alpha = -1.0, beta = 1.0;
  dgemm_("N", "N", &m, &n, &k, &alpha, u.data() + i1 * K + i2, &lda, err.data(), &ldb, &beta, w.data() + i2, &ldc, 1, 1);
}

}  // namespace

std::vector<double> gptq_inverse_factor(std::vector<double> h, int64_t k, double damp, std::vector<bool>& dead) {
  LOOM_CHECK(static_cast<int64_t>(h.size()) == k * k, "gptq: a Hessian of ", h.size(), " values for ", k, " columns");
  dead.assign(static_cast<size_t>(k), false);
  double mean = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    double& d = h[static_cast<size_t>(i * k + i)];
    if (d == 0.0) dead[static_cast<size_t>(i)] = true, d = 1.0;
    mean += d;
  }
  mean /= static_cast<double>(k);
  for (int64_t i = 0; i < k; ++i) h[static_cast<size_t>(i * k + i)] += damp * mean;
  const int n = static_cast<int>(k);
  int info = 0;
  // Symmetric: row-major and column-major are the same matrix. Lower Cholesky, then H^-1 from it.
  dpotrf_("L", &n, h.data(), &n, &info, 1);
  LOOM_CHECK(info == 0, "gptq: the calibration Hessian is not positive definite after damping (dpotrf info ", info,
             "): use more calibration tokens or a larger damping");
  dpotri_("L", &n, h.data(), &n, &info, 1);
  LOOM_CHECK(info == 0, "gptq: inverting the calibration Hessian failed (dpotri info ", info, ")");
  // The column-major lower triangle (i >= j at a[i + j k], row-major h[j k + i]) holds H^-1:
  // mirror it into the other half.
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t i = j + 1; i < k; ++i) h[static_cast<size_t>(i * k + j)] = h[static_cast<size_t>(j * k + i)];
  }
  // Upper Cholesky of H^-1 in column-major: H^-1 = U^T U, U[i][j] (i <= j) at a[i + j k].
  dpotrf_("U", &n, h.data(), &n, &info, 1);
  LOOM_CHECK(info == 0, "gptq: the inverse Hessian's Cholesky factorization failed (dpotrf info ", info, ")");
  std::vector<double> u(static_cast<size_t>(k * k), 0.0);  // row-major upper
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t i = 0; i <= j; ++i) u[static_cast<size_t>(i * k + j)] = h[static_cast<size_t>(i + j * k)];
  }
  return u;
}

GptqFactor gptq_factor(std::span<const double> h_in, int64_t K, const GptqOptions& options) {
  LOOM_CHECK(static_cast<int64_t>(h_in.size()) == K * K, "gptq: a Hessian of ", h_in.size(), " values for ", K, " columns");
  GptqFactor f;
  f.cols = K;
  // Column order: natural, or by decreasing Hessian diagonal (act_order).
  f.perm.resize(static_cast<size_t>(K));
  std::iota(f.perm.begin(), f.perm.end(), 0);
  if (options.act_order) {
    std::stable_sort(f.perm.begin(), f.perm.end(), [&](int64_t a, int64_t b) {
      return h_in[static_cast<size_t>(a * K + a)] > h_in[static_cast<size_t>(b * K + b)];
    });
  }
  std::vector<double> h(static_cast<size_t>(K * K));
  for (int64_t i = 0; i < K; ++i) {
    for (int64_t j = 0; j < K; ++j) h[static_cast<size_t>(i * K + j)] = h_in[static_cast<size_t>(f.perm[i] * K + f.perm[j])];
  }
  f.u = gptq_inverse_factor(std::move(h), K, options.damp, f.dead);
  return f;
}

IntWeight gptq_quantize(std::span<const float> w, std::span<const double> h, const IntWeightSpec& spec,
                        const GptqOptions& options) {
  LOOM_CHECK(static_cast<int64_t>(h.size()) == spec.cols * spec.cols, "gptq: a weight of ", w.size(),
             " and a Hessian of ", h.size(), " values for (", spec.rows, ", ", spec.cols, ")");
  return gptq_quantize_rows(w, gptq_factor(h, spec.cols, options), spec, options);
}

IntWeight gptq_quantize_rows(std::span<const float> w_in, const GptqFactor& f, const IntWeightSpec& spec,
                             const GptqOptions& options) {
  const int64_t R = spec.rows, K = spec.cols, G = spec.group;
  LOOM_CHECK(static_cast<int64_t>(w_in.size()) == R * K && f.cols == K, "gptq: a weight of ", w_in.size(),
             " values and a factor of ", f.cols, " columns for (", R, ", ", K, ")");
  LOOM_CHECK(!spec.act_int8, "gptq: W8A8 is SmoothQuant's format; GPTQ stores weight-only codes");
  const std::vector<int64_t>& perm = f.perm;
  const std::vector<double>& u = f.u;
  std::vector<double> w(static_cast<size_t>(R * K));  // permuted columns
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < K; ++i) w[static_cast<size_t>(r * K + i)] = w_in[static_cast<size_t>(r * K + perm[i])];
  }
  for (int64_t i = 0; i < K; ++i) {
    if (!f.dead[static_cast<size_t>(i)]) continue;
    for (int64_t r = 0; r < R; ++r) w[static_cast<size_t>(r * K + i)] = 0.0;
  }
  const int64_t groups = K / G;
  std::vector<GroupParams> params(static_cast<size_t>(R * groups));  // [row][group in natural order]
  if (options.act_order) {  // static groups: from the weight as it is (dead columns zeroed)
    std::vector<double> natural(static_cast<size_t>(K));
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t i = 0; i < K; ++i) natural[static_cast<size_t>(perm[i])] = w[static_cast<size_t>(r * K + i)];
      for (int64_t g = 0; g < groups; ++g) params[static_cast<size_t>(r * groups + g)] = group_params(natural.data() + g * G, G, 1, spec.bits, options.storage);
    }
  }
  std::vector<uint8_t> codes(static_cast<size_t>(R * K));  // natural column order
  const int64_t B = options.block;
  std::vector<double> err(static_cast<size_t>(R * B));
  for (int64_t i1 = 0; i1 < K; i1 += B) {
    const int64_t i2 = std::min(i1 + B, K);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      double* row = w.data() + r * K;  // columns [i1, i2) updated in place (AutoGPTQ's W1)
      for (int64_t i = i1; i < i2; ++i) {
        const int64_t col = perm[static_cast<size_t>(i)];
        const int64_t g = col / G;
        GroupParams& p = params[static_cast<size_t>(r * groups + g)];
        if (!options.act_order && i % G == 0) p = group_params(row + i, G, 1, spec.bits, options.storage);
        const uint8_t q = quantize(row[i], p, spec.bits);
        codes[static_cast<size_t>(r * K + col)] = q;
        err[static_cast<size_t>(r * B + (i - i1))] = replace_column(row, i, i2, dequantize(q, p), u, K);
      }
    }
    lazy_batch_update(w, err, R, B, i1, i2, u, K);
  }
  IntWeight out;
  out.spec = spec;
  out.storage = options.storage;
  const int64_t rb = int_row_bytes(spec.bits, K);
  out.codes.resize(static_cast<size_t>(R * rb));
  out.scales.resize(static_cast<size_t>(R * groups));
  out.zeros.resize(static_cast<size_t>(R * groups));
  for (int64_t r = 0; r < R; ++r) {
    int_pack_row(codes.data() + r * K, spec.bits, K, out.codes.data() + r * rb);
    for (int64_t g = 0; g < groups; ++g) {
      out.scales[static_cast<size_t>(r * groups + g)] = params[static_cast<size_t>(r * groups + g)].scale;
      out.zeros[static_cast<size_t>(r * groups + g)] = params[static_cast<size_t>(r * groups + g)].zero;
    }
  }
  return out;
}

std::vector<float> sparsegpt_prune(std::span<const float> w_in, std::span<const double> h_in, int64_t R, int64_t K,
                                   double sparsity, int n_keep_zero, int m, double damp, int64_t B) {
  LOOM_CHECK(static_cast<int64_t>(w_in.size()) == R * K && static_cast<int64_t>(h_in.size()) == K * K,
             "sparsegpt: a weight of ", w_in.size(), " and a Hessian of ", h_in.size(), " values for (", R, ", ", K, ")");
  std::vector<bool> dead;
  const std::vector<double> u = gptq_inverse_factor(std::vector<double>(h_in.begin(), h_in.end()), K, damp, dead);
  std::vector<double> w(w_in.begin(), w_in.end());
  for (int64_t i = 0; i < K; ++i) {
    if (!dead[static_cast<size_t>(i)]) continue;
    for (int64_t r = 0; r < R; ++r) w[static_cast<size_t>(r * K + i)] = 0.0;
  }
  std::vector<double> err(static_cast<size_t>(R * B));
  for (int64_t i1 = 0; i1 < K; i1 += B) {
    const int64_t i2 = std::min(i1 + B, K), n = i2 - i1;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      double* row = w.data() + r * K;
      std::vector<bool> mask(static_cast<size_t>(n), false);  // pruned in this block
      auto score = [&](int64_t i) {
        const double d = u[static_cast<size_t>(i * K + i)];
        return row[i] * row[i] / (d * d);
      };
      if (m == 0) {  // unstructured: the block's smallest scores of this row (the paper's adaptive mask per block)
        std::vector<int64_t> order(static_cast<size_t>(n));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score(i1 + a) < score(i1 + b); });
        const int64_t prune = static_cast<int64_t>(std::floor(sparsity * static_cast<double>(n)));
        for (int64_t k = 0; k < prune; ++k) mask[static_cast<size_t>(order[static_cast<size_t>(k)])] = true;
      }
      for (int64_t i = i1; i < i2; ++i) {
        if (m > 0 && (i - i1) % m == 0) {  // n:m: the n smallest of the next m columns
          std::vector<int64_t> order;
          for (int64_t j = i; j < std::min(i + m, i2); ++j) order.push_back(j - i1);
          std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score(i1 + a) < score(i1 + b); });
          for (int k = 0; k < n_keep_zero && k < static_cast<int>(order.size()); ++k) mask[static_cast<size_t>(order[static_cast<size_t>(k)])] = true;
        }
        const double q = mask[static_cast<size_t>(i - i1)] ? 0.0 : row[i];
        err[static_cast<size_t>(r * B + (i - i1))] = replace_column(row, i, i2, q, u, K);
        row[i] = q;
      }
    }
    lazy_batch_update(w, err, R, B, i1, i2, u, K);
  }
  return std::vector<float>(w.begin(), w.end());
}

}  // namespace loom
