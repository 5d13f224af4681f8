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

}  // namespace loom::cpu
