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

extern "C" void dsyevd_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda, double* w, double* work,
                        const int* lwork, int* iwork, const int* liwork, int* info, size_t jobz_len, size_t uplo_len);

namespace loom {

namespace {

// The r leading eigenvectors of the symmetric n x n matrix s, as the columns of out (n x r,
// row-major), by LAPACK's dsyevd.
void leading_eigenvectors(std::vector<double>& s, int64_t n, int64_t r, float* out) {
  const int N = static_cast<int>(n);
  std::vector<double> w(static_cast<size_t>(n));
  int lwork = -1, liwork = -1, info = 0, iwork_query = 0;
  double work_query = 0.0;
  dsyevd_("V", "U", &N, s.data(), &N, w.data(), &work_query, &lwork, &iwork_query, &liwork, &info, 1, 1);
  LOOM_CHECK(info == 0, "LDAdam: LAPACK dsyevd workspace query failed (info ", info, ")");
  lwork = static_cast<int>(work_query);
  liwork = iwork_query;
  std::vector<double> work(static_cast<size_t>(lwork));
  std::vector<int> iwork(static_cast<size_t>(liwork));
  dsyevd_("V", "U", &N, s.data(), &N, w.data(), work.data(), &lwork, iwork.data(), &liwork, &info, 1, 1);
  LOOM_CHECK(info == 0, "LDAdam: LAPACK dsyevd did not converge (info ", info, ")");
  // Eigenvalues ascend; eigenvector k is column k (column-major), i.e. s[k*n .. k*n+n).
  for (int64_t c = 0; c < r; ++c) {
    const double* v = s.data() + (n - 1 - c) * n;
    for (int64_t i = 0; i < n; ++i) out[i * r + c] = static_cast<float>(v[i]);
  }
}

// Orthonormalizes the r columns of y (n x r, row-major) by modified Gram-Schmidt in double:
// the Q of y's thin QR with R's diagonal positive. A column that vanishes keeps `fallback`'s.
void gram_schmidt(const float* y, int64_t n, int64_t r, const float* fallback, float* out) {
  std::vector<double> q(static_cast<size_t>(n * r));
  for (int64_t c = 0; c < r; ++c) {
    std::vector<double> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = y[i * r + c];
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t k = 0; k < c; ++k) {
        double dot = 0.0;
        for (int64_t i = 0; i < n; ++i) dot += q[static_cast<size_t>(i * r + k)] * v[static_cast<size_t>(i)];
        for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] -= dot * q[static_cast<size_t>(i * r + k)];
      }
      if (pass == 0) {
        double norm = 0.0;
        for (double x : v) norm += x * x;
        if (norm <= 1e-60) {
          for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = fallback[i * r + c];
        } else {
          break;  // one pass is Gram-Schmidt as specified; the second only rescues a vanished column
        }
      }
    }
    double norm = 0.0;
    for (double x : v) norm += x * x;
    norm = std::sqrt(norm);
    for (int64_t i = 0; i < n; ++i) q[static_cast<size_t>(i * r + c)] = norm > 0.0 ? v[static_cast<size_t>(i)] / norm : 0.0;
  }
  for (int64_t i = 0; i < n * r; ++i) out[i] = static_cast<float>(q[static_cast<size_t>(i)]);
}

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
        float* g = grads_.data<float>() + s.offset;
        if (!seg.active) {
          adamw(s.offset, s.rows * s.cols, m_, v_, mo, eta, q.weight_decay, gs);
          std::fill_n(g, s.rows * s.cols, 0.0f);
          continue;
        }
        low_rank_step(seg, s, params_.data<float>() + s.offset, g, m_.data<float>() + mo, v_.data<float>() + mo, eta,
                      q.weight_decay, gs);
      }
    }
  }

  Tensor mat(const Tensor& t, int64_t rows, int64_t cols) const { return t.view(0, {rows, cols}); }

  void low_rank_step(const LowRank& seg, const OptimSegment& s, float* p, float* g, float* m, float* v, float eta, float wd,
                     float gs) {
    const int64_t M = seg.m, N = seg.n, r = seg.r, t = step_;
    const double b1 = c_.beta1, b2 = c_.beta2;
    float* P = p_.data<float>() + seg.p_offset;
    // G' = gs * G, or its transpose so that the projected side is the smaller one.
    float* G = g_.data<float>();
    for (int64_t i = 0; i < s.rows; ++i) {
      for (int64_t j = 0; j < s.cols; ++j) (seg.transpose ? G[j * s.rows + i] : G[i * s.cols + j]) = g[i * s.cols + j] * gs;
    }
    Tensor Gt = mat(g_, M, N), Pt = p_.view(seg.p_offset, {M, r}), Prev = mat(prev_, M, r);
    Tensor Mom = m_.view(m - m_.data<float>(), {r, N}), Mt = mat(mt_, r, N), Gh = mat(gh_, r, N), E = mat(e_, M, N);
    std::copy_n(P, M * r, prev_.data<float>());
    std::vector<double> Q(static_cast<size_t>(r * r), 0.0);
    const double bc1_prev = 1.0 - std::pow(b1, static_cast<double>(t - 1));
    const double bc2_prev = 1.0 - std::pow(b2, static_cast<double>(t - 1));
    if (t == 1) {
      GemmSpec ggt;
      ggt.trans_b = true;
      Tensor S = mat(z_, M, M);
      backend_.gemm(Gt, Gt, S, ggt);  // G G^T
      std::vector<double> sd(S.data<float>(), S.data<float>() + M * M);
      leading_eigenvectors(sd, M, r, P);
    } else {
      // b = rho * P_{t-1} M / (1 - b1^(t-1)) + (1 - rho) G;  Y = b (b^T P_{t-1});  P_t = GS(Y)
      Tensor Bm = mat(b_, M, N);
      GemmSpec pm;
      pm.alpha = static_cast<float>(c_.rho / bc1_prev);
      backend_.gemm(Prev, Mom, Bm, pm);
      float* Bd = Bm.data<float>();
      const float keep = static_cast<float>(1.0 - c_.rho);
      for (int64_t i = 0; i < M * N; ++i) Bd[i] += keep * G[i];
      Tensor Z = mat(z_, N, r), Y = mat(y_, M, r);
      GemmSpec btp;
      btp.trans_a = true;
      backend_.gemm(Bm, Prev, Z, btp);
      backend_.gemm(Bm, Z, Y, GemmSpec{});
      gram_schmidt(Y.data<float>(), M, r, prev_.data<float>(), P);
      // Q = P_t^T P_{t-1}
      const float* Pp = prev_.data<float>();
      for (int64_t a = 0; a < r; ++a) {
        for (int64_t b = 0; b < r; ++b) {
          double dot = 0.0;
          for (int64_t i = 0; i < M; ++i) dot += static_cast<double>(P[i * r + a]) * Pp[i * r + b];
          Q[static_cast<size_t>(a * r + b)] = dot;
        }
      }
    }
    // Mt = Q M; projection-aware V.
    float* mt = mt_.data<float>();
    for (int64_t a = 0; a < r; ++a) {
      for (int64_t j = 0; j < N; ++j) {
        double acc = 0.0;
        for (int64_t b = 0; b < r; ++b) acc += Q[static_cast<size_t>(a * r + b)] * m[b * N + j];
        mt[a * N + j] = static_cast<float>(acc);
      }
    }
    std::vector<float> vt(static_cast<size_t>(r * N), 0.0f);
    if (t > 1) {
      const double c1 = 1.0 / (bc1_prev * bc1_prev);
      for (int64_t a = 0; a < r; ++a) {
        for (int64_t j = 0; j < N; ++j) {
          double acc = 0.0;
          for (int64_t b = 0; b < r; ++b) {
            const double qq = Q[static_cast<size_t>(a * r + b)] * Q[static_cast<size_t>(a * r + b)];
            acc += qq * (v[b * N + j] / bc2_prev - static_cast<double>(m[b * N + j]) * m[b * N + j] * c1);
          }
          acc += static_cast<double>(mt[a * N + j]) * mt[a * N + j] * c1;
          vt[static_cast<size_t>(a * N + j)] = static_cast<float>(bc2_prev * std::fabs(acc));
        }
      }
    }
    // Gh = P^T G;  E = G - P Gh + b1/(1-b1) (P_{t-1} M - P Mt)
    GemmSpec ptg;
    ptg.trans_a = true;
    backend_.gemm(Pt, Gt, Gh, ptg);
    std::copy_n(G, M * N, E.data<float>());
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
    const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2), eps = static_cast<float>(c_.eps);
    const float bc1 = static_cast<float>(1.0 - std::pow(b1, static_cast<double>(t)));
    const float bc2 = static_cast<float>(1.0 - std::pow(b2, static_cast<double>(t)));
    const float* gh = gh_.data<float>();
    for (int64_t i = 0; i < r * N; ++i) {
      m[i] = fb1 * mt[i] + (1.0f - fb1) * gh[i];
      v[i] = fb2 * vt[static_cast<size_t>(i)] + (1.0f - fb2) * gh[i] * gh[i];
      mt[i] = (m[i] / bc1) / (std::sqrt(v[i] / bc2) + eps);
    }
    Tensor D = mat(b_, M, N);
    backend_.gemm(Pt, Mt, D, GemmSpec{});
    const float* d = D.data<float>();
    const float* e = E.data<float>();
    const float decay = 1.0f - eta * wd;
    for (int64_t i = 0; i < s.rows; ++i) {
      for (int64_t j = 0; j < s.cols; ++j) {
        const int64_t k = seg.transpose ? j * s.rows + i : i * s.cols + j;
        p[i * s.cols + j] = p[i * s.cols + j] * decay - eta * d[k];
        g[i * s.cols + j] = e[k];
      }
    }
  }

  std::vector<LowRank> segs_;
  std::vector<int64_t> moment_offsets_;
  Tensor m_, v_, p_, g_, e_, b_, prev_, y_, z_, gh_, mt_;
};

}  // namespace

std::unique_ptr<Optimizer> make_ldadam(Backend& b, const Tensor& p, const Tensor& g, std::vector<OptimParam> l,
                                       const OptimConfig& c) {
  return std::make_unique<LdAdam>(b, p, g, std::move(l), c);
}

}  // namespace loom
