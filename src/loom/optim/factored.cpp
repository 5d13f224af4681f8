// Rules with factored (sublinear) second-moment state: Adafactor (Shazeer & Stern 2018, the
// Hugging Face semantics), SM3-II (Anil et al. 2019, row and column covers) and CAME (Luo et
// al. 2023, confidence-guided Adafactor). Each matrix segment is factored on its own; a 1-D
// parameter keeps per-element state. docs/optimizers.md has the exact rules.
#include <algorithm>
#include <cmath>

#include "loom/optim/rules.h"

namespace loom {

namespace {

int64_t max_segment(const std::vector<OptimParam>& list) {
  int64_t n = 1;
  for (const OptimParam& q : list) {
    for (const OptimSegment& s : q.segments) n = std::max(n, s.rows * s.cols);
  }
  return n;
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
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      OptimHyper h = hyper(q, lr, gs);
      h.beta2 = 1.0 - std::pow(t, c_.decay_rate);
      h.lr = c_.relative_step ? rho * q.lr_scale : static_cast<double>(lr) * q.lr_scale;  // the base rate
      h.factored = q.matrix;
      int64_t state = offsets_[k];
      for (const OptimSegment& s : q.segments) {
        const int64_t N = s.rows * s.cols, states = q.matrix ? s.rows + s.cols : N;
        const Tensor m = m_.defined() ? m_.view(element_offsets_[k] + (s.offset - q.offset), {N}) : Tensor();
        backend_.adafactor_step(params_.view(s.offset, {s.rows, s.cols}), grads_.view(s.offset, {s.rows, s.cols}),
                                v_.view(state, {states}), m, work_.view(0, {N}), h);
        state += states;
      }
    }
  }

  std::vector<int64_t> offsets_;
  Tensor v_, m_, work_;
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
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      OptimHyper h = hyper(q, lr, gs);
      h.factored = q.matrix;
      if (!q.matrix) {  // singleton covers, one per element
        backend_.sm3_step(params_.view(q.offset, {q.numel}), grads_.view(q.offset, {q.numel}),
                          acc_.view(offsets_[k], {q.numel}), h);
        continue;
      }
      int64_t acc = offsets_[k];
      for (const OptimSegment& s : q.segments) {
        backend_.sm3_step(params_.view(s.offset, {s.rows, s.cols}), grads_.view(s.offset, {s.rows, s.cols}),
                          acc_.view(acc, {s.rows + s.cols}), h);
        acc += s.rows + s.cols;
      }
    }
  }

  std::vector<int64_t> offsets_;
  Tensor acc_;
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
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      OptimHyper h = hyper(q, lr, gs);
      h.factored = q.matrix;
      int64_t state = offsets_[k], res = q.matrix ? r_offsets_[k] : 0;
      for (const OptimSegment& s : q.segments) {
        const int64_t N = s.rows * s.cols, states = q.matrix ? s.rows + s.cols : N;
        const Tensor r = q.matrix ? r_.view(res, {states}) : Tensor();
        backend_.came_step(params_.view(s.offset, {s.rows, s.cols}), grads_.view(s.offset, {s.rows, s.cols}),
                           v_.view(state, {states}), m_.view(element_offsets_[k] + (s.offset - q.offset), {N}), r,
                           work_.view(0, {N}), h);
        state += states;
        if (q.matrix) res += states;
      }
    }
  }

  std::vector<int64_t> offsets_, r_offsets_;
  Tensor m_, v_, r_, work_;
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
