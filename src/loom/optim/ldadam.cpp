// LDAdam (Robert, Safaryan, Modoranu, Alistarh 2024, "LDAdam: Adaptive Optimization from
// Low-Dimensional Gradient Statistics", arXiv 2410.16103): Adam whose moments live in a rank-r
// subspace of each hidden matrix's gradient, re-estimated every step by one block power
// iteration; the moments are carried across subspaces by the projection-aware update and what
// the projections lose (of the gradient and of the momentum) is fed back through the gradient
// buffer (generalized error feedback). docs/optimizers.md has the exact rule.
#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/optim/rules.h"

namespace loom {

namespace {

struct LowRank {
  bool active = false;  // false: full rank (identity projector) or not a hidden matrix: AdamW
  bool transpose = false;
  int64_t m = 0, n = 0, r = 0;  // G' is m x n (m <= n), P is m x r, moments r x n
  int64_t p_offset = 0;         // into the projector buffer
};

class LdAdam final : public Optimizer {
 public:
  LdAdam(Backend& b, const Tensor& params, const Tensor& grads, std::vector<OptimParam> list, const OptimConfig& c)
      : Optimizer(c, b, params, grads, std::move(list)) {
    int64_t moments = 0, projector = 0, big = 1, mr = 1, rn = 1;
    for (const OptimParam& q : list_) {
      for (const OptimSegment& s : q.segments) {
        LowRank lr;
        lr.transpose = s.rows > s.cols;
        lr.m = std::min(s.rows, s.cols);
        lr.n = std::max(s.rows, s.cols);
        lr.r = std::min(c_.rank, lr.m);
        lr.active = q.hidden && lr.r < lr.m;
        moment_offsets_.push_back(moments);
        lr.p_offset = projector;
        if (lr.active) {
          moments += lr.r * lr.n;
          projector += lr.m * lr.r;
          big = std::max(big, lr.m * lr.n);
          mr = std::max(mr, lr.m * std::max(lr.r, lr.m));
          rn = std::max(rn, lr.r * lr.n);
        } else {
          moments += s.rows * s.cols;
        }
        segs_.push_back(lr);
      }
    }
    m_ = add_state("exp_avg", moments);
    v_ = add_state("exp_avg_sq", moments);
    if (projector > 0) p_ = add_state("projector", projector);
    state_.emplace_back("error_feedback", grads_);  // the gradient buffer carries E between steps
    Allocator& alloc = b.allocator();
    g_ = Tensor::empty(alloc, {big}, DTYPE_F32, MEM_WORKSPACE);
    e_ = Tensor::empty(alloc, {big}, DTYPE_F32, MEM_WORKSPACE);
    b_ = Tensor::empty(alloc, {big}, DTYPE_F32, MEM_WORKSPACE);
    prev_ = Tensor::empty(alloc, {mr}, DTYPE_F32, MEM_WORKSPACE);
    y_ = Tensor::empty(alloc, {mr}, DTYPE_F32, MEM_WORKSPACE);
    z_ = Tensor::empty(alloc, {big}, DTYPE_F32, MEM_WORKSPACE);
    gh_ = Tensor::empty(alloc, {rn}, DTYPE_F32, MEM_WORKSPACE);
    mt_ = Tensor::empty(alloc, {rn}, DTYPE_F32, MEM_WORKSPACE);
    vt_ = Tensor::empty(alloc, {rn}, DTYPE_F32, MEM_WORKSPACE);
  }

  bool keeps_gradients() const override { return true; }

 private:
  void update(float lr, float gs) override {
    size_t idx = 0;
    for (const OptimParam& q : list_) {
      const float eta = lr * q.lr_scale;
      for (const OptimSegment& s : q.segments) {
        const LowRank& seg = segs_[idx];
        const int64_t mo = moment_offsets_[idx++];
        if (!seg.active) {
          adamw(s.offset, s.rows * s.cols, m_, v_, mo, eta, q.weight_decay, gs);
          backend_.fill(grads_.view(s.offset, {s.rows * s.cols}), 0.0);
          continue;
        }
        low_rank_step(seg, s, mo, hyper(q, lr, gs));
      }
    }
  }

  Tensor mat(const Tensor& t, int64_t rows, int64_t cols) const { return t.view(0, {rows, cols}); }

  // One hidden segment; mo: its moments' offset into m_ and v_.
  void low_rank_step(const LowRank& seg, const OptimSegment& s, int64_t mo, const OptimHyper& h) {
    const int64_t M = seg.m, N = seg.n, r = seg.r, t = step_;
    const double b1 = c_.beta1;
    // G' = gs * G, or its transpose so that the projected side is the smaller one.
    Tensor Gt = mat(g_, M, N), Pt = p_.view(seg.p_offset, {M, r}), Prev = mat(prev_, M, r);
    Tensor Mom = m_.view(mo, {r, N}), Vm = v_.view(mo, {r, N}), Mt = mat(mt_, r, N), Vt = mat(vt_, r, N);
    Tensor Gh = mat(gh_, r, N), E = mat(e_, M, N);
    backend_.scale_transpose(grads_.view(s.offset, {s.rows, s.cols}), Gt, h.grad_scale, seg.transpose);
    backend_.copy(Pt, Prev);
    if (t == 1) {
      GemmSpec ggt;
      ggt.trans_b = true;
      Tensor S = mat(z_, M, M);
      backend_.gemm(Gt, Gt, S, ggt);  // G G^T
      backend_.leading_eigenvectors(S, Pt);
    } else {
      // b = rho * P_{t-1} M / (1 - b1^(t-1)) + (1 - rho) G;  Y = b (b^T P_{t-1});  P_t = GS(Y)
      const double bc1_prev = 1.0 - std::pow(b1, static_cast<double>(t - 1));
      Tensor Bm = mat(b_, M, N);
      GemmSpec pm;
      pm.alpha = static_cast<float>(c_.rho / bc1_prev);
      backend_.gemm(Prev, Mom, Bm, pm);
      backend_.axpy(Bm, Gt, static_cast<float>(1.0 - c_.rho));
      Tensor Z = mat(z_, N, r), Y = mat(y_, M, r);
      GemmSpec btp;
      btp.trans_a = true;
      backend_.gemm(Bm, Prev, Z, btp);
      backend_.gemm(Bm, Z, Y, GemmSpec{});
      backend_.gram_schmidt(Y, Prev, Pt);
    }
    // Q = P_t^T P_{t-1}; Mt = Q M; projection-aware V.
    backend_.ldadam_rotate(Pt, Prev, Mom, Vm, Mt, Vt, h);
    // Gh = P^T G;  E = G - P Gh + b1/(1-b1) (P_{t-1} M - P Mt)
    GemmSpec ptg;
    ptg.trans_a = true;
    backend_.gemm(Pt, Gt, Gh, ptg);
    backend_.copy(Gt, E);
    GemmSpec sub;
    sub.alpha = -1.0f;
    sub.beta = 1.0f;
    backend_.gemm(Pt, Gh, E, sub);
    if (t > 1) {
      const float k = static_cast<float>(b1 / (1.0 - b1));
      GemmSpec add_prev;
      add_prev.alpha = k;
      add_prev.beta = 1.0f;
      backend_.gemm(Prev, Mom, E, add_prev);
      GemmSpec sub_new;
      sub_new.alpha = -k;
      sub_new.beta = 1.0f;
      backend_.gemm(Pt, Mt, E, sub_new);
    }
    // Adam in the subspace; the direction W goes back through P into Mt's buffer.
    backend_.ldadam_adam(Mom, Vm, Mt, Vt, Gh, h);
    Tensor D = mat(b_, M, N);
    backend_.gemm(Pt, Mt, D, GemmSpec{});
    backend_.ldadam_apply(params_.view(s.offset, {s.rows, s.cols}), grads_.view(s.offset, {s.rows, s.cols}), D, E,
                          seg.transpose, h);
  }

  std::vector<LowRank> segs_;
  std::vector<int64_t> moment_offsets_;
  Tensor m_, v_, p_, g_, e_, b_, prev_, y_, z_, gh_, mt_, vt_;
};

}  // namespace

std::unique_ptr<Optimizer> make_ldadam(Backend& b, const Tensor& p, const Tensor& g, std::vector<OptimParam> l,
                                       const OptimConfig& c) {
  return std::make_unique<LdAdam>(b, p, g, std::move(l), c);
}

}  // namespace loom
