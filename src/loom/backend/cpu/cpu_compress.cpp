// CPU kernels of the gradient compression ops (contracts in backend.h; the methods in
// parallel/compress.h). Sequential loops: the stated summation orders make them bit-reproducible.
#include "loom/backend/cpu/cpu_compress.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "loom/backend/compress_checks.h"
#include "loom/core/error.h"
#include "loom/core/philox.h"

namespace loom::cpu {

void topk_extract(const Tensor& acc, const Tensor& idx, const Tensor& val, const Tensor& scratch) {
  const auto [n, k] = checks::check_topk_extract(acc, idx, val, scratch);
  float* a = acc.data<float>();
  int32_t* order = scratch.data<int32_t>();
  std::iota(order, order + n, 0);
  std::nth_element(order, order + (k - 1), order + n, [a](int32_t x, int32_t y) {
    const float fx = std::fabs(a[x]), fy = std::fabs(a[y]);
    return fx > fy || (fx == fy && x < y);  // a total order: the k entries are unique
  });
  std::sort(order, order + k);
  int32_t* pi = idx.data<int32_t>();
  float* pv = val.data<float>();
  for (int64_t j = 0; j < k; ++j) {
    pi[j] = order[j];
    pv[j] = a[order[j]];
    a[order[j]] = 0.0f;  // sent: the accumulator keeps the rest
  }
}

void scatter_add(const Tensor& idx, const Tensor& val, const Tensor& out) {
  const char* op = "scatter_add";
  checks::check_scatter_add(idx, val, out);
  const int32_t* pi = idx.data<int32_t>();
  const float* pv = val.data<float>();
  float* o = out.data<float>();
  const int64_t n = out.numel();
  for (int64_t j = 0; j < idx.numel(); ++j) {
    LOOM_CHECK(pi[j] >= 0 && pi[j] < n, op, ": index ", pi[j], " at ", j, " is outside [0, ", n, ")");
    o[pi[j]] += pv[j];
  }
}

void scatter_zero(const Tensor& idx, const Tensor& x) {
  const char* op = "scatter_zero";
  checks::check_scatter_zero(idx, x);
  const int32_t* pi = idx.data<int32_t>();
  float* px = x.data<float>();
  for (int64_t j = 0; j < idx.numel(); ++j) {
    LOOM_CHECK(pi[j] >= 0 && pi[j] < x.numel(), op, ": index ", pi[j], " at ", j, " is outside [0, ", x.numel(), ")");
    px[pi[j]] = 0.0f;
  }
}

void dgc_accumulate(const Tensor& g, const Tensor& u, const Tensor& v, float momentum, double clip) {
  const int64_t n = checks::check_dgc_accumulate(g, u, v);
  float* pg = g.data<float>();
  float* pu = u.data<float>();
  float* pv = v.data<float>();
  if (clip > 0.0) {
    double sq = 0.0;
    for (int64_t i = 0; i < n; ++i) sq += static_cast<double>(pg[i]) * pg[i];
    const double norm = std::sqrt(sq);
    if (norm > clip) {
      const float scale = static_cast<float>(clip / norm);
      for (int64_t i = 0; i < n; ++i) pg[i] *= scale;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    pu[i] = momentum * pu[i] + pg[i];  // momentum correction
    pv[i] += pu[i];                    // accumulation
  }
}

void onebit_encode(const Tensor& acc, const Tensor& words, const Tensor& scale) {
  const int64_t n = checks::check_onebit_encode(acc, words, scale);
  float* e = acc.data<float>();
  double l1 = 0.0;
  for (int64_t i = 0; i < n; ++i) l1 += std::fabs(static_cast<double>(e[i]));
  const float s = n > 0 ? static_cast<float>(l1 / static_cast<double>(n)) : 0.0f;
  auto* w = reinterpret_cast<uint32_t*>(words.data<int32_t>());
  std::fill(w, w + words.numel(), 0u);
  for (int64_t i = 0; i < n; ++i) {
    const bool negative = e[i] < 0.0f;
    if (negative) w[i / 32] |= 1u << (i % 32);
    e[i] -= negative ? -s : s;  // residual = a - p
  }
  scale.data<float>()[0] = s;
}

void onebit_decode_add(const Tensor& words, const Tensor& scales, const Tensor& out) {
  const int64_t w = checks::check_onebit_decode_add(words, scales, out), n = out.numel();
  float* o = out.data<float>();
  for (int64_t r = 0; r < scales.numel(); ++r) {
    const auto* rw = reinterpret_cast<const uint32_t*>(words.data<int32_t>()) + r * w;
    const float s = scales.data<float>()[r];
    for (int64_t i = 0; i < n; ++i) o[i] += (rw[i / 32] >> (i % 32)) & 1u ? -s : s;
  }
}

void qsgd_encode(const Tensor& g, const Tensor& codes, const Tensor& norm, const QsgdSpec& spec) {
  const int64_t n = checks::check_qsgd_encode(g, codes, norm, spec), words = (n + 3) / 4;
  const float* pg = g.data<float>();
  double sq = 0.0;
  for (int64_t i = 0; i < n; ++i) sq += static_cast<double>(pg[i]) * pg[i];
  const float nrm = static_cast<float>(std::sqrt(sq));
  auto* bytes = reinterpret_cast<int8_t*>(codes.data<int32_t>());
  std::memset(bytes, 0, static_cast<size_t>(words) * 4);
  const PhiloxKey key = {static_cast<uint32_t>(spec.seed), static_cast<uint32_t>(spec.seed >> 32)};
  for (int64_t q = 0; q < words && nrm > 0.0f; ++q) {
    const PhiloxCounter r =
        philox4x32_10({static_cast<uint32_t>(spec.offset + 4 * q), spec.stream, spec.draw, 0x9597u}, key);
    for (int64_t j = 0; j < 4 && 4 * q + j < n; ++j) {
      const int64_t i = 4 * q + j;
      const double x = std::fabs(static_cast<double>(pg[i])) / nrm * spec.levels;
      const double l = std::floor(x);
      const int level = static_cast<int>(l) + (philox_uniform(r[static_cast<size_t>(j)]) < x - l ? 1 : 0);
      bytes[i] = static_cast<int8_t>(pg[i] < 0.0f ? -level : level);
    }
  }
  norm.data<float>()[0] = nrm;
}

void qsgd_decode_add(const Tensor& codes, const Tensor& norms, int levels, const Tensor& out) {
  const int64_t w = checks::check_qsgd_decode_add(codes, norms, out), n = out.numel();
  const float s = static_cast<float>(levels);
  float* o = out.data<float>();
  for (int64_t r = 0; r < norms.numel(); ++r) {
    const auto* rb = reinterpret_cast<const int8_t*>(codes.data<int32_t>() + r * w);
    const float unit = norms.data<float>()[r] / s;
    for (int64_t i = 0; i < n; ++i) o[i] = std::fma(unit, static_cast<float>(rb[i]), o[i]);  // one rounding
  }
}

void lowrank_project(const Tensor& m, const Tensor& q, const Tensor& out, bool transpose) {
  const auto [rows, cols, r] = checks::check_lowrank_project(m, q, out, transpose);
  const float* pm = m.data<float>();
  const float* pq = q.data<float>();
  float* po = out.data<float>();
  if (!transpose) {
    for (int64_t i = 0; i < rows; ++i) {  // out = m q
      for (int64_t j = 0; j < r; ++j) {
        double acc = 0.0;
        for (int64_t c = 0; c < cols; ++c) acc += static_cast<double>(pm[i * cols + c]) * pq[c * r + j];
        po[i * r + j] = static_cast<float>(acc);
      }
    }
    return;
  }
  for (int64_t c = 0; c < cols; ++c) {  // out = m^T q
    for (int64_t j = 0; j < r; ++j) {
      double acc = 0.0;
      for (int64_t i = 0; i < rows; ++i) acc += static_cast<double>(pm[i * cols + c]) * pq[i * r + j];
      po[c * r + j] = static_cast<float>(acc);
    }
  }
}

void orthonormalize_columns(const Tensor& p) {
  const auto [rows, r] = checks::check_orthonormalize_columns(p);
  float* pp = p.data<float>();
  auto at = [r](int64_t i, int64_t j) { return static_cast<size_t>(i * r + j); };
  // The double copy: a per-thread buffer that only grows (no allocation once it holds the largest p).
  thread_local std::vector<double> d;
  d.assign(pp, pp + rows * r);
  for (int pass = 0; pass < 2; ++pass) {  // "twice is enough"
    for (int64_t j = 0; j < r; ++j) {
      for (int64_t k = 0; k < j; ++k) {
        double dot = 0.0;
        for (int64_t i = 0; i < rows; ++i) dot += d[at(i, j)] * d[at(i, k)];
        for (int64_t i = 0; i < rows; ++i) d[at(i, j)] -= dot * d[at(i, k)];
      }
      double norm = 0.0;
      for (int64_t i = 0; i < rows; ++i) norm += d[at(i, j)] * d[at(i, j)];
      const double inv = norm > 1e-30 ? 1.0 / std::sqrt(norm) : 0.0;
      for (int64_t i = 0; i < rows; ++i) d[at(i, j)] *= inv;
    }
  }
  for (int64_t i = 0; i < rows * r; ++i) pp[i] = static_cast<float>(d[static_cast<size_t>(i)]);
}

void lowrank_expand(const Tensor& p, const Tensor& q, const Tensor& out, float alpha, float beta) {
  const auto [rows, cols, r] = checks::check_lowrank_expand(p, q, out);
  const float* pp = p.data<float>();
  const float* pq = q.data<float>();
  float* po = out.data<float>();
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < cols; ++c) {
      double acc = 0.0;
      for (int64_t j = 0; j < r; ++j) acc += static_cast<double>(pp[i * r + j]) * pq[c * r + j];
      float& o = po[i * cols + c];
      o = beta == 0.0f ? alpha * static_cast<float>(acc) : alpha * static_cast<float>(acc) + beta * o;
    }
  }
}

}  // namespace loom::cpu
