// Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"): Nesterov momentum, then
// the quintic Newton-Schulz iteration X <- a X + (b A + c A^2) X, A = X X^T, with (a, b, c) =
// (3.4445, -4.7750, 2.0315), which maps the update's singular values into about [0.7, 1.2].
// Hidden matrices only (each segment on its own); AdamW for the rest. The update is scaled by
// 0.2 sqrt(max(m, n)) (Liu et al. 2025, Moonshot AI) so one learning rate serves both parts, or
// by sqrt(max(1, m/n)) (Keller Jordan's reference). The iteration runs in fp32 through the
// backend's GEMM.
#include <algorithm>
#include <cmath>

#include "loom/optim/rules.h"

namespace loom {

// Applies `steps` Newton-Schulz iterations to u (rows, cols) and writes the (approximately)
// orthogonalized result to out. Work tensors: x, y of rows*cols floats, a, b of min(rows, cols)^2
// floats. Exposed for the tests (tests/test_optim.cpp).
void newton_schulz5(Backend& backend, const Tensor& u, const Tensor& out, int64_t rows, int64_t cols, int64_t steps,
                    const Tensor& x, const Tensor& y, const Tensor& a, const Tensor& b) {
  constexpr float ka = 3.4445f, kb = -4.7750f, kc = 2.0315f;
  const bool transpose = rows > cols;
  const int64_t s = transpose ? cols : rows, l = transpose ? rows : cols;
  Tensor xv = x.view(0, {s, l}), yv = y.view(0, {s, l}), av = a.view(0, {s, s}), bv = b.view(0, {s, s});
  backend.newton_schulz_normalize(u.view(0, {rows, cols}), xv);  // X = U / ||U||, the short side first
  for (int64_t it = 0; it < steps; ++it) {
    GemmSpec xxt;
    xxt.trans_b = true;
    backend.gemm(xv, xv, av, xxt);  // A = X X^T
    GemmSpec aa;
    aa.alpha = kc;
    backend.gemm(av, av, bv, aa);  // B = c A A
    backend.axpy(bv, av, kb);      // B += b A
    backend.gemm(bv, xv, yv, GemmSpec{});  // Y = B X
    backend.axpy(yv, xv, ka);              // Y += a X
    std::swap(xv, yv);
  }
  backend.scale_transpose(xv, out.view(0, {rows, cols}), 1.0f, transpose);
}

namespace {

class Muon final : public Optimizer {
 public:
  Muon(Backend& b, const Tensor& params, const Tensor& grads, std::vector<OptimParam> list, const OptimConfig& c)
      : Optimizer(c, b, params, grads, std::move(list)) {
    int64_t hidden = 0, other = 0, big = 1, square = 1;
    buf_offsets_ = state_offsets(list_, [](const OptimParam& q) { return q.hidden ? q.numel : 0; }, &hidden);
    adam_offsets_ = state_offsets(list_, [](const OptimParam& q) { return q.hidden ? 0 : q.numel; }, &other);
    if (hidden > 0) buf_ = add_state("momentum_buffer", hidden);
    if (other > 0) {
      m_ = add_state("exp_avg", other);
      v_ = add_state("exp_avg_sq", other);
    }
    for (const OptimParam& q : list_) {
      if (!q.hidden) continue;
      for (const OptimSegment& s : q.segments) {
        big = std::max(big, s.rows * s.cols);
        square = std::max(square, std::min(s.rows, s.cols) * std::min(s.rows, s.cols));
      }
    }
    Allocator& alloc = b.allocator();
    u_ = Tensor::empty(alloc, {big}, DTYPE_F32, MEM_WORKSPACE);
    x_ = Tensor::empty(alloc, {big}, DTYPE_F32, MEM_WORKSPACE);
    y_ = Tensor::empty(alloc, {big}, DTYPE_F32, MEM_WORKSPACE);
    a_ = Tensor::empty(alloc, {square}, DTYPE_F32, MEM_WORKSPACE);
    bm_ = Tensor::empty(alloc, {square}, DTYPE_F32, MEM_WORKSPACE);
  }

 private:
  void update(float lr, float gs) override {
    for (size_t k = 0; k < list_.size(); ++k) {
      const OptimParam& q = list_[k];
      const float eta = lr * q.lr_scale;
      if (!q.hidden) {
        adamw(q.offset, q.numel, m_, v_, adam_offsets_[k], eta, q.weight_decay, gs);
        continue;
      }
      const OptimHyper h = hyper(q, lr, gs);
      for (const OptimSegment& s : q.segments) {
        const int64_t n = s.rows * s.cols, rel = s.offset - q.offset;
        const Tensor U = u_.view(0, {n});
        backend_.muon_momentum(grads_.view(s.offset, {n}), buf_.view(buf_offsets_[k] + rel, {n}), U, h);
        newton_schulz5(backend_, U, U, s.rows, s.cols, c_.ns_steps, x_, y_, a_, bm_);
        const double scale = c_.muon_scaling == MuonScale::moonshot
                                 ? 0.2 * std::sqrt(static_cast<double>(std::max(s.rows, s.cols)))
                                 : std::sqrt(std::max(1.0, static_cast<double>(s.rows) / static_cast<double>(s.cols)));
        const float step = eta * static_cast<float>(scale), decay = 1.0f - eta * q.weight_decay;
        backend_.decayed_update(params_.view(s.offset, {n}), U, decay, step);
      }
    }
  }

  std::vector<int64_t> buf_offsets_, adam_offsets_;
  Tensor buf_, m_, v_, u_, x_, y_, a_, bm_;
};

}  // namespace

std::unique_ptr<Optimizer> make_muon(Backend& b, const Tensor& p, const Tensor& g, std::vector<OptimParam> l, const OptimConfig& c) {
  return std::make_unique<Muon>(b, p, g, std::move(l), c);
}

}  // namespace loom
