// Elementwise rules: SGD (Robbins & Monro 1951; heavy ball, Polyak 1964; Nesterov 1983 in
// Sutskever et al. 2013's form), Adagrad (Duchi et al. 2011), RMSprop (Hinton 2012; centered,
// Graves 2013), Adam (Kingma & Ba 2015; AMSGrad, Reddi et al. 2018), AdamW (Loshchilov & Hutter
// 2019), Lion (Chen et al. 2023), and Adam-mini (Zhang et al. 2024), whose second moment is one
// scalar per block. The first five follow torch.optim's conventions exactly (docs/optimizers.md).
#include <algorithm>
#include <cmath>

#include "loom/optim/rules.h"

namespace loom {

namespace {

class Sgd final : public Optimizer {
 public:
  Sgd(Backend& b, const Tensor& params, const Tensor& grads, std::vector<OptimParam> list, const OptimConfig& c)
      : Optimizer(c, b, params, grads, std::move(list)) {
    if (c_.momentum > 0.0) buf_ = add_state("momentum_buffer", numel_total_);
  }

 private:
  void update(float lr, float gs) override {
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      backend_.sgd_step(params_.view(q.offset, {q.numel}), grads_.view(q.offset, {q.numel}), slice(buf_, k, q),
                        hyper(q, lr, gs));
    }
  }

  Tensor buf_;
};

class Adagrad final : public Optimizer {
 public:
  Adagrad(Backend& b, const Tensor& params, const Tensor& grads, std::vector<OptimParam> list, const OptimConfig& c)
      : Optimizer(c, b, params, grads, std::move(list)) {
    sum_ = add_state("sum", numel_total_, static_cast<float>(c_.initial_accumulator));
  }

 private:
  void update(float lr, float gs) override {
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      OptimHyper h = hyper(q, lr, gs);
      h.lr = lr * q.lr_scale / static_cast<float>(1.0 + static_cast<double>(step_ - 1) * c_.lr_decay);
      backend_.adagrad_step(params_.view(q.offset, {q.numel}), grads_.view(q.offset, {q.numel}), slice(sum_, k, q), h);
    }
  }

  Tensor sum_;
};

class RmsProp final : public Optimizer {
 public:
  RmsProp(Backend& b, const Tensor& params, const Tensor& grads, std::vector<OptimParam> list, const OptimConfig& c)
      : Optimizer(c, b, params, grads, std::move(list)) {
    square_ = add_state("square_avg", numel_total_);
    if (c_.centered) mean_ = add_state("grad_avg", numel_total_);
    if (c_.momentum > 0.0) buf_ = add_state("momentum_buffer", numel_total_);
  }

 private:
  void update(float lr, float gs) override {
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      backend_.rmsprop_step(params_.view(q.offset, {q.numel}), grads_.view(q.offset, {q.numel}), slice(square_, k, q),
                            slice(mean_, k, q), slice(buf_, k, q), hyper(q, lr, gs));
    }
  }

  Tensor square_, mean_, buf_;
};

// Adam (L2 decay added to the gradient) and AdamW (decoupled decay), optional AMSGrad.
class Adam final : public Optimizer {
 public:
  Adam(Backend& b, const Tensor& params, const Tensor& grads, std::vector<OptimParam> list, const OptimConfig& c)
      : Optimizer(c, b, params, grads, std::move(list)), decoupled_(c.kind == OptimizerKind::adamw) {
    m_ = add_state("exp_avg", numel_total_);
    v_ = add_state("exp_avg_sq", numel_total_);
    if (c_.amsgrad) vmax_ = add_state("max_exp_avg_sq", numel_total_);
  }

 private:
  void update(float lr, float gs) override {
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      const float eta = lr * q.lr_scale;
      if (decoupled_ && !c_.amsgrad) {  // the backend's fused AdamW kernel
        adamw(q.offset, q.numel, m_, v_, element_offsets_[k], eta, q.weight_decay, gs);
        continue;
      }
      OptimHyper h = hyper(q, lr, gs);
      h.decoupled = decoupled_;
      backend_.adam_step(params_.view(q.offset, {q.numel}), grads_.view(q.offset, {q.numel}), slice(m_, k, q),
                         slice(v_, k, q), slice(vmax_, k, q), h);
    }
  }

  bool decoupled_;
  Tensor m_, v_, vmax_;
};

class Lion final : public Optimizer {
 public:
  Lion(Backend& b, const Tensor& params, const Tensor& grads, std::vector<OptimParam> list, const OptimConfig& c)
      : Optimizer(c, b, params, grads, std::move(list)) {
    m_ = add_state("exp_avg", numel_total_);
  }

 private:
  void update(float lr, float gs) override {
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      backend_.lion_step(params_.view(q.offset, {q.numel}), grads_.view(q.offset, {q.numel}), slice(m_, k, q),
                         hyper(q, lr, gs));
    }
  }

  Tensor m_;
};

// Adam-mini: the first moment per element, the second one scalar per block (a block is
// block_rows consecutive rows of a segment; a 1-D parameter is one block).
class AdamMini final : public Optimizer {
 public:
  AdamMini(Backend& b, const Tensor& params, const Tensor& grads, std::vector<OptimParam> list, const OptimConfig& c)
      : Optimizer(c, b, params, grads, std::move(list)) {
    for (const OptimParam& q : list_) {
      for (const OptimSegment& s : q.segments) blocks_ += s.rows / s.block_rows;
    }
    m_ = add_state("exp_avg", numel_total_);
    v_ = add_state("exp_avg_sq_block", blocks_);
  }

 private:
  // One op per segment; v holds the segment's blocks, one after another.
  void update(float lr, float gs) override {
    int64_t block = 0;
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      const OptimHyper h = hyper(q, lr, gs);
      for (const OptimSegment& s : q.segments) {
        const int64_t n = s.rows * s.cols, blocks = s.rows / s.block_rows;
        backend_.adam_mini_step(params_.view(s.offset, {n}), grads_.view(s.offset, {n}),
                                m_.view(element_offsets_[k] + (s.offset - q.offset), {n}), v_.view(block, {blocks}), h);
        block += blocks;
      }
    }
  }

  int64_t blocks_ = 0;
  Tensor m_, v_;
};

}  // namespace

std::unique_ptr<Optimizer> make_sgd(Backend& b, const Tensor& p, const Tensor& g, std::vector<OptimParam> l, const OptimConfig& c) {
  return std::make_unique<Sgd>(b, p, g, std::move(l), c);
}
std::unique_ptr<Optimizer> make_adagrad(Backend& b, const Tensor& p, const Tensor& g, std::vector<OptimParam> l,
                                        const OptimConfig& c) {
  return std::make_unique<Adagrad>(b, p, g, std::move(l), c);
}
std::unique_ptr<Optimizer> make_rmsprop(Backend& b, const Tensor& p, const Tensor& g, std::vector<OptimParam> l,
                                        const OptimConfig& c) {
  return std::make_unique<RmsProp>(b, p, g, std::move(l), c);
}
std::unique_ptr<Optimizer> make_adam(Backend& b, const Tensor& p, const Tensor& g, std::vector<OptimParam> l, const OptimConfig& c) {
  return std::make_unique<Adam>(b, p, g, std::move(l), c);
}
std::unique_ptr<Optimizer> make_lion(Backend& b, const Tensor& p, const Tensor& g, std::vector<OptimParam> l, const OptimConfig& c) {
  return std::make_unique<Lion>(b, p, g, std::move(l), c);
}
std::unique_ptr<Optimizer> make_adam_mini(Backend& b, const Tensor& p, const Tensor& g, std::vector<OptimParam> l,
                                          const OptimConfig& c) {
  return std::make_unique<AdamMini>(b, p, g, std::move(l), c);
}

}  // namespace loom
