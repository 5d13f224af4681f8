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
    const float mu = static_cast<float>(c_.momentum), damp = static_cast<float>(c_.dampening);
    const bool nesterov = c_.nesterov == 1, first = step_ == 1;
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      float* p = this->p(q);
      const float* g = this->g(q);
      float* b = buf_.defined() ? buf_.data<float>() + element_offsets_[k] : nullptr;
      const float eta = lr * q.lr_scale, wd = q.weight_decay;
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < q.numel; ++i) {
        float d = g[i] * gs + wd * p[i];
        if (b != nullptr) {
          b[i] = first ? d : mu * b[i] + (1.0f - damp) * d;
          d = nesterov ? d + mu * b[i] : b[i];
        }
        p[i] -= eta * d;
      }
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
    const float eps = static_cast<float>(c_.eps);
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      float* p = this->p(q);
      const float* g = this->g(q);
      float* s = sum_.data<float>() + element_offsets_[k];
      const float clr = lr * q.lr_scale / static_cast<float>(1.0 + static_cast<double>(step_ - 1) * c_.lr_decay);
      const float wd = q.weight_decay;
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < q.numel; ++i) {
        const float d = g[i] * gs + wd * p[i];
        s[i] += d * d;
        p[i] -= clr * d / (std::sqrt(s[i]) + eps);
      }
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
    const float a = static_cast<float>(c_.beta2), eps = static_cast<float>(c_.eps), mu = static_cast<float>(c_.momentum);
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      float* p = this->p(q);
      const float* g = this->g(q);
      float* s = square_.data<float>() + element_offsets_[k];
      float* ga = mean_.defined() ? mean_.data<float>() + element_offsets_[k] : nullptr;
      float* b = buf_.defined() ? buf_.data<float>() + element_offsets_[k] : nullptr;
      const float eta = lr * q.lr_scale, wd = q.weight_decay;
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < q.numel; ++i) {
        const float d = g[i] * gs + wd * p[i];
        s[i] = a * s[i] + (1.0f - a) * d * d;
        float avg;
        if (ga != nullptr) {
          ga[i] = a * ga[i] + (1.0f - a) * d;
          avg = std::sqrt(s[i] - ga[i] * ga[i]) + eps;
        } else {
          avg = std::sqrt(s[i]) + eps;
        }
        if (b != nullptr) {
          b[i] = mu * b[i] + d / avg;
          p[i] -= eta * b[i];
        } else {
          p[i] -= eta * d / avg;
        }
      }
    }
  }

  Tensor square_, mean_, buf_;
};

// Adam (L2 decay added to the gradient) and AdamW (decoupled decay), optional AMSGrad.
class Adam final : public Optimizer {
 public:
  Adam(Backend& b, const Tensor& params, const Tensor& grads, std::vector<OptimParam> list, const OptimConfig& c)
      : Optimizer(c, b, params, grads, std::move(list)), decoupled_(c.name == "adamw") {
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
      float* p = this->p(q);
      const float* g = this->g(q);
      float* m = m_.data<float>() + element_offsets_[k];
      float* v = v_.data<float>() + element_offsets_[k];
      float* vmax = vmax_.defined() ? vmax_.data<float>() + element_offsets_[k] : nullptr;
      const float b1 = static_cast<float>(c_.beta1), b2 = static_cast<float>(c_.beta2), eps = static_cast<float>(c_.eps);
      const float bias1 = static_cast<float>(1.0 - std::pow(c_.beta1, static_cast<double>(step_)));
      const float bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(c_.beta2, static_cast<double>(step_))));
      const float step_size = eta / bias1;
      const float l2 = decoupled_ ? 0.0f : q.weight_decay, decay = decoupled_ ? 1.0f - eta * q.weight_decay : 1.0f;
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < q.numel; ++i) {
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
    const float b1 = static_cast<float>(c_.beta1), b2 = static_cast<float>(c_.beta2);
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      float* p = this->p(q);
      const float* g = this->g(q);
      float* m = m_.data<float>() + element_offsets_[k];
      const float eta = lr * q.lr_scale, decay = 1.0f - eta * q.weight_decay;
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < q.numel; ++i) {
        const float d = g[i] * gs;
        const float c = b1 * m[i] + (1.0f - b1) * d;
        const float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
        p[i] = p[i] * decay - eta * sign;
        m[i] = b2 * m[i] + (1.0f - b2) * d;
      }
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
      for (const OptimSegment& s : q.segments) {
        for (int64_t r = 0; r < s.rows; r += s.block_rows) blocks_.push_back({s.offset + r * s.cols, s.block_rows * s.cols});
      }
    }
    m_ = add_state("exp_avg", numel_total_);
    v_ = add_state("exp_avg_sq_block", static_cast<int64_t>(blocks_.size()));
  }

 private:
  struct Block {
    int64_t offset, numel;  // into the flat buffers
  };

  void update(float lr, float gs) override {
    const float b1 = static_cast<float>(c_.beta1), eps = static_cast<float>(c_.eps);
    const double b2 = c_.beta2;
    const float bias1 = static_cast<float>(1.0 - std::pow(c_.beta1, static_cast<double>(step_)));
    const double bias2 = 1.0 - std::pow(c_.beta2, static_cast<double>(step_));
    float* vb = v_.data<float>();
    size_t block = 0;
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      const float eta = lr * q.lr_scale, decay = 1.0f - eta * q.weight_decay;
      size_t nblocks = 0;
      for (const OptimSegment& s : q.segments) nblocks += static_cast<size_t>(s.rows / s.block_rows);
      float* p0 = params_.data<float>();
      const float* g0 = grads_.data<float>();
      float* m0 = m_.data<float>() + element_offsets_[k] - q.offset;  // indexed by flat offset
#pragma omp parallel for schedule(static) if (nblocks > 1)
      for (size_t j = block; j < block + nblocks; ++j) {
        const Block& bl = blocks_[j];
        double sq = 0.0;
        for (int64_t i = bl.offset; i < bl.offset + bl.numel; ++i) {
          const double d = static_cast<double>(g0[i] * gs);
          sq += d * d;
        }
        vb[j] = static_cast<float>(b2 * vb[j] + (1.0 - b2) * (sq / static_cast<double>(bl.numel)));
        const float denom = static_cast<float>(std::sqrt(static_cast<double>(vb[j]) / bias2)) + eps;
        for (int64_t i = bl.offset; i < bl.offset + bl.numel; ++i) {
          const float d = g0[i] * gs;
          m0[i] = b1 * m0[i] + (1.0f - b1) * d;
          p0[i] = p0[i] * decay - eta * (m0[i] / bias1) / denom;
        }
      }
      block += nblocks;
    }
  }

  std::vector<Block> blocks_;
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
