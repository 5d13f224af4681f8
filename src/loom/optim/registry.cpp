// One row per optimizer: its name, whether its update is element-wise, whether it keeps error
// feedback in the gradient buffer, its defaults, its factory and its state size. Everything that
// asks about an optimizer (config resolution, make_optimizer, the memory estimate, ZeRO and the
// layout's compatibility table) reads this table.
#include <algorithm>

#include "loom/core/error.h"
#include "loom/optim/rules.h"

namespace loom {

namespace {

void fill(double& field, double value) {
  if (field < 0.0) field = value;
}

// Per-parameter shape facts the state formulas use.
struct Shape2 {
  int64_t n = 0, factored = 0, blocks = 0;  // elements, sum of rows + cols over segments, Adam-mini blocks
};
Shape2 shape_of(const OptimParam& q) {
  Shape2 s{q.numel, 0, 0};
  for (const OptimSegment& seg : q.segments) {
    s.factored += seg.rows + seg.cols;
    s.blocks += seg.rows / seg.block_rows;
  }
  return s;
}

void sgd_defaults(OptimConfig& c) {
  fill(c.momentum, c.kind == OptimizerKind::sgd ? 0.0 : 0.9);
  if (c.nesterov < 0) c.nesterov = c.kind == OptimizerKind::nesterov ? 1 : 0;
  fill(c.weight_decay, 0.0);
}
int64_t sgd_state(const OptimParam& q, const OptimConfig& c) { return c.momentum > 0.0 ? q.numel : 0; }

void adagrad_defaults(OptimConfig& c) {
  fill(c.eps, 1e-10);
  fill(c.weight_decay, 0.0);
}
int64_t one_per_element(const OptimParam& q, const OptimConfig&) { return q.numel; }

void rmsprop_defaults(OptimConfig& c) {
  fill(c.beta2, 0.99);
  fill(c.eps, 1e-8);
  fill(c.momentum, 0.0);
  fill(c.weight_decay, 0.0);
}
int64_t rmsprop_state(const OptimParam& q, const OptimConfig& c) {
  return q.numel * (1 + (c.centered ? 1 : 0) + (c.momentum > 0.0 ? 1 : 0));
}

void adam_defaults(OptimConfig& c) {
  fill(c.beta1, 0.9);
  fill(c.beta2, 0.999);
  fill(c.eps, 1e-8);
  fill(c.weight_decay, c.kind == OptimizerKind::adam ? 0.0 : c.kind == OptimizerKind::adamw ? 0.01 : 0.1);
}
int64_t adam_state(const OptimParam& q, const OptimConfig& c) { return q.numel * (c.amsgrad ? 3 : 2); }
int64_t adam_mini_state(const OptimParam& q, const OptimConfig&) { return q.numel + shape_of(q).blocks; }

void adafactor_defaults(OptimConfig& c) {
  fill(c.beta1, 0.0);  // 0 = no first moment
  fill(c.eps, 1e-30);
  fill(c.eps2, 1e-3);
  fill(c.weight_decay, 0.0);
}
int64_t adafactor_state(const OptimParam& q, const OptimConfig& c) {
  return (q.matrix ? shape_of(q).factored : q.numel) + (c.beta1 > 0.0 ? q.numel : 0);
}

void sm3_defaults(OptimConfig& c) {
  fill(c.eps, 0.0);
  fill(c.weight_decay, 0.0);
}
int64_t sm3_state(const OptimParam& q, const OptimConfig&) { return q.matrix ? shape_of(q).factored : q.numel; }

void lion_defaults(OptimConfig& c) {
  fill(c.beta1, 0.9);
  fill(c.beta2, 0.99);
  fill(c.weight_decay, 0.0);
}

void came_defaults(OptimConfig& c) {
  fill(c.beta1, 0.9);
  fill(c.beta2, 0.999);
  fill(c.beta3, 0.9999);
  fill(c.eps, 1e-30);
  fill(c.eps2, 1e-16);
  fill(c.weight_decay, 0.0);
}
int64_t came_state(const OptimParam& q, const OptimConfig&) { return q.numel + (q.matrix ? 2 * shape_of(q).factored : q.numel); }

void ldadam_defaults(OptimConfig& c) {
  fill(c.beta1, 0.908);
  fill(c.beta2, 0.99);
  fill(c.eps, 1e-8);
  fill(c.weight_decay, 0.0);
}
int64_t ldadam_state(const OptimParam& q, const OptimConfig& c) {
  if (!q.hidden) return 2 * q.numel;
  int64_t floats = 0;
  for (const OptimSegment& s : q.segments) {
    const int64_t m = std::min(s.rows, s.cols), w = std::max(s.rows, s.cols), r = std::min(c.rank, m);
    floats += r == m ? 2 * s.rows * s.cols : 2 * r * w + m * r;
  }
  return floats;
}

void muon_defaults(OptimConfig& c) {
  fill(c.momentum, 0.95);
  if (c.nesterov < 0) c.nesterov = 1;
  fill(c.beta1, 0.9);
  fill(c.beta2, 0.95);
  fill(c.eps, 1e-8);
  fill(c.weight_decay, 0.0);
}
int64_t muon_state(const OptimParam& q, const OptimConfig&) { return q.hidden ? q.numel : 2 * q.numel; }

// name, kind, element-wise, keeps gradients, defaults, factory, state floats per parameter; in
// OptimizerKind's order.
using K = OptimizerKind;
const std::vector<OptimizerRow> kRows = {
    {"sgd", K::sgd, true, false, sgd_defaults, make_sgd, sgd_state},
    {"momentum", K::momentum, true, false, sgd_defaults, make_sgd, sgd_state},
    {"nesterov", K::nesterov, true, false, sgd_defaults, make_sgd, sgd_state},
    {"adagrad", K::adagrad, true, false, adagrad_defaults, make_adagrad, one_per_element},
    {"rmsprop", K::rmsprop, true, false, rmsprop_defaults, make_rmsprop, rmsprop_state},
    {"adam", K::adam, true, false, adam_defaults, make_adam, adam_state},
    {"adamw", K::adamw, true, false, adam_defaults, make_adam, adam_state},
    {"adafactor", K::adafactor, false, false, adafactor_defaults, make_adafactor, adafactor_state},
    {"sm3", K::sm3, false, false, sm3_defaults, make_sm3, sm3_state},
    {"lion", K::lion, true, false, lion_defaults, make_lion, one_per_element},
    {"adam-mini", K::adam_mini, false, false, adam_defaults, make_adam_mini, adam_mini_state},
    {"came", K::came, false, false, came_defaults, make_came, came_state},
    {"ldadam", K::ldadam, false, true, ldadam_defaults, make_ldadam, ldadam_state},
    {"muon", K::muon, false, false, muon_defaults, make_muon, muon_state},
};

}  // namespace

const std::vector<OptimizerRow>& optimizer_rows() { return kRows; }

const OptimizerRow& optimizer_row(const std::string& name) {
  for (const OptimizerRow& r : kRows) {
    if (name == r.name) return r;
  }
  std::string known;
  for (const OptimizerRow& r : kRows) known += (known.empty() ? "" : ", ") + std::string(r.name);
  throw Error(str_cat("optim.name: unknown optimizer '", name, "' (expected one of ", known, ")"));
}

const OptimizerRow& optimizer_row(OptimizerKind kind) {
  const OptimizerRow& r = kRows.at(static_cast<size_t>(kind));
  LOOM_CHECK(r.kind == kind, "the optimizer registry is out of OptimizerKind's order at ", r.name);
  return r;
}

const std::vector<std::string>& optimizer_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const OptimizerRow& r : kRows) out.push_back(r.name);
    return out;
  }();
  return names;
}

bool elementwise_optimizer(OptimizerKind kind) { return optimizer_row(kind).elementwise; }

}  // namespace loom
