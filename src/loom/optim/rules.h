// The update rules behind make_optimizer, one factory each (optim/*.cpp), and the small
// helpers they share. Internal to optim/.
#pragma once
#include <cmath>
#include <memory>

#include "loom/optim/optimizer.h"

namespace loom {

#define LOOM_RULE(fn)                                                                                     \
  std::unique_ptr<Optimizer> fn(Backend& backend, const Tensor& params, const Tensor& grads, \
                                std::vector<OptimParam> list, const OptimConfig& c)
LOOM_RULE(make_sgd);        // elementwise.cpp
LOOM_RULE(make_adagrad);    // elementwise.cpp
LOOM_RULE(make_rmsprop);    // elementwise.cpp
LOOM_RULE(make_adam);       // elementwise.cpp (adam and adamw)
LOOM_RULE(make_lion);       // elementwise.cpp
LOOM_RULE(make_adam_mini);  // elementwise.cpp
LOOM_RULE(make_adafactor);  // factored.cpp
LOOM_RULE(make_sm3);        // factored.cpp
LOOM_RULE(make_came);       // factored.cpp
LOOM_RULE(make_ldadam);     // ldadam.cpp
LOOM_RULE(make_muon);       // muon.cpp
#undef LOOM_RULE

// Muon's quintic Newton-Schulz iteration on a rows x cols matrix (muon.cpp); x, y hold
// rows*cols floats, a, b min(rows, cols)^2. u and out may alias.
void newton_schulz5(Backend& backend, const float* u, float* out, int64_t rows, int64_t cols, int64_t steps, const Tensor& x,
                    const Tensor& y, const Tensor& a, const Tensor& b);

// AdamW on n elements (decoupled decay), g = grad_scale * grad; bias corrections for step t.
// Shared by Muon and LDAdam for the parameters they do not handle themselves.
inline void adamw_elements(float* p, const float* grad, float* m, float* v, int64_t n, float lr, float wd, float grad_scale,
                           double beta1, double beta2, double eps, int64_t t) {
  const float b1 = static_cast<float>(beta1), b2 = static_cast<float>(beta2), e = static_cast<float>(eps);
  const float bias1 = static_cast<float>(1.0 - std::pow(beta1, static_cast<double>(t)));
  const float bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(t))));
  const float decay = 1.0f - lr * wd, step_size = lr / bias1;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * grad_scale;
    m[i] = b1 * m[i] + (1.0f - b1) * g;
    v[i] = b2 * v[i] + (1.0f - b2) * g * g;
    p[i] = p[i] * decay - step_size * m[i] / (std::sqrt(v[i]) / bias2_sqrt + e);
  }
}

// Offsets of each parameter into a compact state buffer holding `per_param(q)` floats each.
template <typename F>
std::vector<int64_t> state_offsets(const std::vector<OptimParam>& list, F per_param, int64_t* total) {
  std::vector<int64_t> offsets;
  int64_t off = 0;
  for (const OptimParam& q : list) {
    offsets.push_back(off);
    off += per_param(q);
  }
  *total = off;
  return offsets;
}

}  // namespace loom
