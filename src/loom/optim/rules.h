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

// Muon's quintic Newton-Schulz iteration on a rows x cols matrix (muon.cpp), all through the
// backend; u, out hold rows*cols floats, as x and y, a and b min(rows, cols)^2. u and out may alias.
void newton_schulz5(Backend& backend, const Tensor& u, const Tensor& out, int64_t rows, int64_t cols, int64_t steps,
                    const Tensor& x, const Tensor& y, const Tensor& a, const Tensor& b);

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
