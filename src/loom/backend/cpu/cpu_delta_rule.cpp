// The gated delta rule on the CPU backend (Backend::delta_rule_forward / delta_rule_backward;
// backend.h states the math, the layout, the two forms and the backward's strategy).
// Gated DeltaNet: Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with
// Delta Rule", arXiv 2412.06464 (the gated delta rule and its chunkwise form); the chunked
// form's WY representation / UT transform: Yang, Wang, Zhang, Shen & Kim 2024, "Parallelizing
// Linear Transformers with the Delta Rule over Sequence Length", arXiv 2406.06484. Written from
// those equations; the backward is their derivative, derived here.
//
// Work: one (b, h) head per OpenMP thread at a time (heads are independent), every buffer a
// thread uses carved from the backend's workspace: the head's state, the chunk's gathered rows
// and small (chunk x chunk) matrices, and in the backward the per-chunk checkpoints. Sums run in
// the operands' dtype (f32 or f64).
// Grouped heads (Hv value heads over Hk <= Hv query/key heads, value head h reading key head
// h / (Hv / Hk)): the forward runs the B Hv value heads independently, reading the shared q/k
// rows in place; the backward runs one (b, key head) per thread, its Hv / Hk value heads one
// after another, the first writing the shared dq/dk rows and the others adding to them, so no
// two threads ever write the same row and the sums have a fixed order. With Hk == Hv that is
// exactly the one-to-one loop (same items, same arithmetic).
// Speed (plain loops, no GEMMs; f32, B 1, T 2048, H 4, d_k = d_v = 128, chunk 64, 2 threads of a
// shared 2-core machine): forward recurrent 20 ms, chunked 33 ms; backward about 100 ms either.
// On a CPU the chunked form buys nothing over the recurrent one without GEMMs; it is here as the
// form a GPU runs (and to be checked against it).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "loom/backend/checks.h"
#include "loom/backend/cpu/cpu_backend_internal.h"

namespace loom::cpu_backend_detail {
namespace {

// Buffers carved one after another from a thread's slice of the workspace; with base == nullptr
// it only counts, so the same bind() sizes the slice and hands it out.
template <typename F>
struct Arena {
  F* base = nullptr;
  int64_t used = 0;
  F* take(int64_t n) {
    F* p = base == nullptr ? nullptr : base + used;
    used += n;
    return p;
  }
};

// a.b in 8 partial sums (a fixed order the compiler vectorizes: one running sum would be a
// serial chain, which it may not reorder).
template <typename F>
F dot(const F* a, const F* b, int64_t n) {
  F part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) part[j] += a[i + j] * b[i + j];
  }
  F s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One (b, h) value head's operands: row t of q / k (its key head's) at q + t * ks, of v / out at
// v + t * vs, of g / beta at g + t * gs (ks = Hk d_k, vs = Hv d_v, gs = Hv in the (B, T, heads,
// ...) layout).
template <typename F>
struct Head {
  const F *q, *k, *v, *g, *beta;
  F* out;  // forward only
  int64_t ks, vs, gs, len, dk, dv;
};
// The same head's gradients (backward): dout read, the others written (dq / dk rows at the
// Head's ks stride). accumulate: add to dq / dk instead of overwriting them (every value head of
// a group but its first, which overwrites).
template <typename F>
struct HeadGrad {
  const F* dout;
  F *dq, *dk, *dv, *dg, *dbeta;
  bool accumulate = false;
};

template <typename F>
Head<F> head_of(const checks::DeltaRuleDims& d, int64_t bh, const F* q, const F* k, const F* v, const F* g,
                const F* beta, F* out) {
  const int64_t b = bh / d.H, h = bh % d.H;
  const int64_t row = b * d.T * d.H + h;                      // (b, t = 0, h) of v, g, beta, out
  const int64_t krow = b * d.T * d.Hk + h / (d.H / d.Hk);  // (b, t = 0, key head) of q, k
  return Head<F>{q + krow * d.dk, k + krow * d.dk, v + row * d.dv, g + row, beta + row,
                 out == nullptr ? nullptr : out + row * d.dv, d.Hk * d.dk, d.H * d.dv, d.H, d.T, d.dk, d.dv};
}

// ---------------------------------------------------------------- recurrent form
// One step at position t from S (S_{t-1} -> S_t, in place); writes o_t when out is set.
// u (d_v) is scratch.
template <typename F>
void recurrent_step(const Head<F>& hd, int64_t t, F* S, F* u, F* out) {
  const int64_t dk = hd.dk, dv = hd.dv;
  const F* q = hd.q + t * hd.ks;
  const F* k = hd.k + t * hd.ks;
  const F* v = hd.v + t * hd.vs;
  const F a = std::exp(hd.g[t * hd.gs]), beta = hd.beta[t * hd.gs];
  // S <- exp(g_t) S; u = S^T k_t (what the decayed memory recalls for k_t).
  std::fill(u, u + dv, F(0));
  for (int64_t r = 0; r < dk; ++r) {
    F* s = S + r * dv;
    const F kr = k[r];
    for (int64_t c = 0; c < dv; ++c) {
      s[c] *= a;
      u[c] += kr * s[c];
    }
  }
  // delta_t = beta_t (v_t - u) (kept in u); S += k_t delta_t^T; o_t = S^T q_t.
  for (int64_t c = 0; c < dv; ++c) u[c] = beta * (v[c] - u[c]);
  F* o = out;
  if (o != nullptr) std::fill(o, o + dv, F(0));
  for (int64_t r = 0; r < dk; ++r) {
    F* s = S + r * dv;
    const F kr = k[r], qr = q[r];
    for (int64_t c = 0; c < dv; ++c) s[c] += kr * u[c];
    if (o != nullptr) {
      for (int64_t c = 0; c < dv; ++c) o[c] += qr * s[c];
    }
  }
}

// The reverse-time recurrence over positions [t0, t0 + L) of one head. states holds S_{t0-1}
// (the chunk's checkpoint) and gets S_{t0} .. S_{t0+L-1} recomputed after it ((L + 1) d_k d_v);
// dS is d(S_{t0+L-1}) on entry, d(S_{t0-1}) on exit. Per step, with P = exp(g_t) S_{t-1},
// u = P^T k_t, delta = beta_t (v_t - u), S_t = P + k_t delta^T, o_t = S_t^T q_t:
//   dS += q_t do_t^T; dq_t = S_t do_t; dk_t = dS delta + P du; d(delta) = dS^T k_t;
//   dbeta_t = d(delta).(v_t - u); dv_t = beta_t d(delta); du = -beta_t d(delta);
//   dP = dS + k_t du^T; dg_t = <dP, P>; d(S_{t-1}) = exp(g_t) dP.
template <typename F>
void recurrent_chunk_backward(const Head<F>& hd, const HeadGrad<F>& gd, int64_t t0, int64_t L, F* states, F* dS,
                              F* u, F* ddelta) {
  const int64_t dk = hd.dk, dv = hd.dv, n = dk * dv;
  for (int64_t i = 0; i < L; ++i) {
    std::memcpy(states + (i + 1) * n, states + i * n, sizeof(F) * n);
    recurrent_step(hd, t0 + i, states + (i + 1) * n, u, static_cast<F*>(nullptr));
  }
  for (int64_t i = L - 1; i >= 0; --i) {
    const int64_t t = t0 + i;
    const F* prev = states + i * n;
    const F* cur = states + (i + 1) * n;
    const F* q = hd.q + t * hd.ks;
    const F* k = hd.k + t * hd.ks;
    const F* v = hd.v + t * hd.vs;
    const F* dout = gd.dout + t * hd.vs;
    F* dq = gd.dq + t * hd.ks;
    F* dk_t = gd.dk + t * hd.ks;
    F* dv_t = gd.dv + t * hd.vs;
    const F a = std::exp(hd.g[t * hd.gs]), beta = hd.beta[t * hd.gs];
    // dS += q do^T; dq = S_t do; u = P^T k.
    std::fill(u, u + dv, F(0));
    for (int64_t r = 0; r < dk; ++r) {
      F* ds = dS + r * dv;
      const F* sp = prev + r * dv;
      const F qr = q[r], kr = k[r];
      for (int64_t c = 0; c < dv; ++c) {
        ds[c] += qr * dout[c];
        u[c] += kr * sp[c];
      }
      if (gd.accumulate) dq[r] += dot(cur + r * dv, dout, dv);
      else dq[r] = dot(cur + r * dv, dout, dv);
    }
    // u becomes v - u (the recall error); delta = beta (v - u).
    for (int64_t c = 0; c < dv; ++c) u[c] = v[c] - a * u[c];
    // dk = dS delta; d(delta) = dS^T k.
    std::fill(ddelta, ddelta + dv, F(0));
    for (int64_t r = 0; r < dk; ++r) {
      const F* ds = dS + r * dv;
      const F kr = k[r];
      for (int64_t c = 0; c < dv; ++c) ddelta[c] += ds[c] * kr;
      if (gd.accumulate) dk_t[r] += beta * dot(ds, u, dv);
      else dk_t[r] = beta * dot(ds, u, dv);
    }
    gd.dbeta[t * hd.gs] = dot(ddelta, u, dv);
    for (int64_t c = 0; c < dv; ++c) {
      dv_t[c] = beta * ddelta[c];
      ddelta[c] = -beta * ddelta[c];  // now du
    }
    // dk += P du; dP = dS + k du^T; dg = <dP, P>; dS <- exp(g) dP.
    F dg = 0;
    for (int64_t r = 0; r < dk; ++r) {
      F* ds = dS + r * dv;
      const F* sp = prev + r * dv;
      const F kr = k[r];
      dk_t[r] += a * dot(sp, ddelta, dv);
      for (int64_t c = 0; c < dv; ++c) ds[c] += kr * ddelta[c];
      dg += dot(ds, sp, dv);
      for (int64_t c = 0; c < dv; ++c) ds[c] *= a;
    }
    gd.dg[t * hd.gs] = a * dg;
  }
}

// ---------------------------------------------------------------- chunked form
// A chunk's buffers (cap positions at most): its gathered rows, cumulative decays, the decay
// matrix, the UT transform, the WY factors and deltas; the backward's gradients of each.
template <typename F>
struct Chunk {
  F *q, *k, *v, *bet, *G, *gam, *Gam, *Tm, *W, *U, *D, *row;
  F *dO, *dQ, *dK, *dD, *dR, *tmp, *dGam, *dgam, *db;
  void bind(Arena<F>& a, int64_t cap, int64_t dk, int64_t dv, bool backward) {
    q = a.take(cap * dk), k = a.take(cap * dk), v = a.take(cap * dv);
    bet = a.take(cap), G = a.take(cap), gam = a.take(cap), row = a.take(cap);
    Gam = a.take(cap * cap), Tm = a.take(cap * cap);
    W = a.take(cap * dk), U = a.take(cap * dv), D = a.take(cap * dv);
    if (!backward) return;
    dO = a.take(cap * dv), dQ = a.take(cap * dk), dK = a.take(cap * dk), dD = a.take(cap * dv);
    dR = a.take(cap * dv), tmp = a.take(cap * dk), dGam = a.take(cap * cap), dgam = a.take(cap), db = a.take(cap);
  }
};

// Positions [t0, t0 + L) from the state S0 before them: gathers the rows, G_i (the chunk's
// cumulative log-decay), gamma_i = exp(G_i), Gamma_ij = exp(G_i - G_j) (j <= i), the UT
// transform T = (I + A)^-1 with A_ij = beta_i Gamma_ij k_i.k_j (j < i), the WY factors
// W = T diag(beta gamma) K and U = T diag(beta) V, and the deltas D = U - W S0.
template <typename F>
void chunk_prepare(const Head<F>& hd, int64_t t0, int64_t L, const F* S0, Chunk<F>& c) {
  const int64_t dk = hd.dk, dv = hd.dv;
  F G = 0;
  for (int64_t i = 0; i < L; ++i) {
    const int64_t t = t0 + i;
    std::memcpy(c.q + i * dk, hd.q + t * hd.ks, sizeof(F) * dk);
    std::memcpy(c.k + i * dk, hd.k + t * hd.ks, sizeof(F) * dk);
    std::memcpy(c.v + i * dv, hd.v + t * hd.vs, sizeof(F) * dv);
    c.bet[i] = hd.beta[t * hd.gs];
    G += hd.g[t * hd.gs];
    c.G[i] = G;
    c.gam[i] = std::exp(G);
  }
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t j = 0; j <= i; ++j) c.Gam[i * L + j] = std::exp(c.G[i] - c.G[j]);
  }
  // T row by row (forward substitution of (I + A) T = I): T_ii = 1, T_ij = -sum_{j<=m<i} A_im T_mj.
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t m = 0; m < i; ++m) c.row[m] = c.bet[i] * c.Gam[i * L + m] * dot(c.k + i * dk, c.k + m * dk, dk);
    F* Ti = c.Tm + i * L;
    for (int64_t j = 0; j < i; ++j) {
      F s = 0;
      for (int64_t m = j; m < i; ++m) s += c.row[m] * c.Tm[m * L + j];
      Ti[j] = -s;
    }
    Ti[i] = 1;
  }
  // W_i = sum_{j<=i} T_ij beta_j gamma_j k_j; U_i = sum_{j<=i} T_ij beta_j v_j; D_i = U_i - S0^T W_i.
  for (int64_t i = 0; i < L; ++i) {
    F* w = c.W + i * dk;
    F* u = c.U + i * dv;
    std::fill(w, w + dk, F(0));
    std::fill(u, u + dv, F(0));
    for (int64_t j = 0; j <= i; ++j) {
      const F tb = c.Tm[i * L + j] * c.bet[j], tbg = tb * c.gam[j];
      const F* kj = c.k + j * dk;
      const F* vj = c.v + j * dv;
      for (int64_t r = 0; r < dk; ++r) w[r] += tbg * kj[r];
      for (int64_t x = 0; x < dv; ++x) u[x] += tb * vj[x];
    }
    F* d = c.D + i * dv;
    std::memcpy(d, u, sizeof(F) * dv);
    for (int64_t r = 0; r < dk; ++r) {
      const F wr = w[r];
      const F* s = S0 + r * dv;
      for (int64_t x = 0; x < dv; ++x) d[x] -= wr * s[x];
    }
  }
}

// The chunk's outputs: o_i = gamma_i S0^T q_i + sum_{j<=i} Gamma_ij (q_i.k_j) D_j.
template <typename F>
void chunk_outputs(const Head<F>& hd, int64_t t0, int64_t L, const F* S0, Chunk<F>& c) {
  const int64_t dk = hd.dk, dv = hd.dv;
  for (int64_t i = 0; i < L; ++i) {
    F* o = hd.out + (t0 + i) * hd.vs;
    const F* qi = c.q + i * dk;
    std::fill(o, o + dv, F(0));
    for (int64_t r = 0; r < dk; ++r) {
      const F qr = c.gam[i] * qi[r];
      const F* s = S0 + r * dv;
      for (int64_t x = 0; x < dv; ++x) o[x] += qr * s[x];
    }
    for (int64_t j = 0; j <= i; ++j) {
      const F w = c.Gam[i * L + j] * dot(qi, c.k + j * dk, dk);
      const F* d = c.D + j * dv;
      for (int64_t x = 0; x < dv; ++x) o[x] += w * d[x];
    }
  }
}

// S <- S_L = gamma_L S + sum_j Gamma_Lj k_j D_j^T (the state after the chunk).
template <typename F>
void chunk_advance(const Head<F>& hd, int64_t L, F* S, const Chunk<F>& c) {
  const int64_t dk = hd.dk, dv = hd.dv;
  const F gl = c.gam[L - 1];
  for (int64_t i = 0; i < dk * dv; ++i) S[i] *= gl;
  for (int64_t j = 0; j < L; ++j) {
    const F w = c.Gam[(L - 1) * L + j];
    const F* kj = c.k + j * dk;
    const F* d = c.D + j * dv;
    for (int64_t r = 0; r < dk; ++r) {
      const F coef = w * kj[r];
      F* s = S + r * dv;
      for (int64_t x = 0; x < dv; ++x) s[x] += coef * d[x];
    }
  }
}

// The chunk's backward from its checkpoint S0: dS is d(S_L) on entry, d(S0) on exit (dSn is
// scratch of the same size); writes the chunk's rows of dq, dk, dv, dg, dbeta. The derivative of
// chunk_prepare / chunk_outputs / chunk_advance, term by term:
//   O = diag(gamma) Q S0 + (Gamma .* QK^T) D        S_L = gamma_L S0 + K^T diag(Gamma_L.) D
//   D = T R, R = diag(beta) V - diag(beta gamma) K S0, T = (I + A)^-1
// so dR = T^T dD, dA = -dR D^T (strictly lower), and G's gradient collects gamma's and Gamma's;
// dg is its reverse cumulative sum.
template <typename F>
void chunk_backward(const Head<F>& hd, const HeadGrad<F>& gd, int64_t t0, int64_t L, const F* S0, F* dS, F* dSn,
                    Chunk<F>& c) {
  const int64_t dk = hd.dk, dv = hd.dv, n = dk * dv;
  chunk_prepare(hd, t0, L, S0, c);
  for (int64_t i = 0; i < L; ++i) std::memcpy(c.dO + i * dv, gd.dout + (t0 + i) * hd.vs, sizeof(F) * dv);
  std::fill(c.dQ, c.dQ + L * dk, F(0));
  std::fill(c.dK, c.dK + L * dk, F(0));
  std::fill(c.dD, c.dD + L * dv, F(0));
  std::fill(c.dGam, c.dGam + L * L, F(0));
  std::fill(c.dgam, c.dgam + L, F(0));
  std::fill(c.db, c.db + L, F(0));

  // From O's first term: tmp_i = S0 dO_i; dQ_i = gamma_i tmp_i; dgamma_i = q_i.tmp_i;
  // d(S0) = gamma_L dS_L + sum_i gamma_i q_i dO_i^T; dgamma_L += <dS_L, S0>.
  const F gl = c.gam[L - 1];
  for (int64_t x = 0; x < n; ++x) dSn[x] = gl * dS[x];
  c.dgam[L - 1] += dot(dS, S0, n);
  for (int64_t i = 0; i < L; ++i) {
    const F* doi = c.dO + i * dv;
    const F* qi = c.q + i * dk;
    F* tmp = c.tmp + i * dk;
    for (int64_t r = 0; r < dk; ++r) {
      tmp[r] = dot(S0 + r * dv, doi, dv);
      const F coef = c.gam[i] * qi[r];
      F* ds = dSn + r * dv;
      for (int64_t x = 0; x < dv; ++x) ds[x] += coef * doi[x];
    }
    c.dgam[i] += dot(qi, tmp, dk);
    for (int64_t r = 0; r < dk; ++r) c.dQ[i * dk + r] = c.gam[i] * tmp[r];
  }
  // From O's second term, M_ij = Gamma_ij (q_i.k_j), j <= i: dM_ij = dO_i.D_j; dD_j += M_ij dO_i;
  // dQ_i += dM_ij Gamma_ij k_j; dK_j += dM_ij Gamma_ij q_i; dGamma_ij += dM_ij (q_i.k_j).
  for (int64_t i = 0; i < L; ++i) {
    const F* qi = c.q + i * dk;
    const F* doi = c.dO + i * dv;
    for (int64_t j = 0; j <= i; ++j) {
      const F* kj = c.k + j * dk;
      const F qk = dot(qi, kj, dk), gam = c.Gam[i * L + j];
      const F dm = dot(doi, c.D + j * dv, dv);
      const F m = gam * qk, p = dm * gam;
      F* ddj = c.dD + j * dv;
      for (int64_t x = 0; x < dv; ++x) ddj[x] += m * doi[x];
      F* dqi = c.dQ + i * dk;
      F* dkj = c.dK + j * dk;
      for (int64_t r = 0; r < dk; ++r) {
        dqi[r] += p * kj[r];
        dkj[r] += p * qi[r];
      }
      c.dGam[i * L + j] += dm * qk;
    }
  }
  // From S_L's sum: h_j = dS_L D_j; dK_j += Gamma_Lj h_j; dGamma_Lj += k_j.h_j;
  // dD_j += Gamma_Lj dS_L^T k_j.
  for (int64_t j = 0; j < L; ++j) {
    const F w = c.Gam[(L - 1) * L + j];
    const F* kj = c.k + j * dk;
    const F* dj = c.D + j * dv;
    F* ddj = c.dD + j * dv;
    F* dkj = c.dK + j * dk;
    F kh = 0;
    for (int64_t r = 0; r < dk; ++r) {
      const F* ds = dS + r * dv;
      const F h = dot(ds, dj, dv);
      dkj[r] += w * h;
      kh += kj[r] * h;
      const F coef = w * kj[r];
      for (int64_t x = 0; x < dv; ++x) ddj[x] += coef * ds[x];
    }
    c.dGam[(L - 1) * L + j] += kh;
  }
  // dR = T^T dD (dR_j = sum_{i>=j} T_ij dD_i).
  for (int64_t j = 0; j < L; ++j) {
    F* drj = c.dR + j * dv;
    std::fill(drj, drj + dv, F(0));
    for (int64_t i = j; i < L; ++i) {
      const F tij = c.Tm[i * L + j];
      const F* ddi = c.dD + i * dv;
      for (int64_t x = 0; x < dv; ++x) drj[x] += tij * ddi[x];
    }
  }
  // R_i = beta_i v_i - beta_i gamma_i S0^T k_i: dv_i = beta_i dR_i; dbeta_i += v_i.dR_i;
  // dKb_i = -S0 dR_i; dK_i += beta_i gamma_i dKb_i; dbeta_i += gamma_i k_i.dKb_i;
  // dgamma_i += beta_i k_i.dKb_i; d(S0) -= beta_i gamma_i k_i dR_i^T.
  for (int64_t i = 0; i < L; ++i) {
    const F* dri = c.dR + i * dv;
    const F* ki = c.k + i * dk;
    F* dvi = gd.dv + (t0 + i) * hd.vs;
    for (int64_t x = 0; x < dv; ++x) dvi[x] = c.bet[i] * dri[x];
    c.db[i] += dot(c.v + i * dv, dri, dv);
    F kdkb = 0;
    const F bg = c.bet[i] * c.gam[i];
    for (int64_t r = 0; r < dk; ++r) {
      const F dkb = -dot(S0 + r * dv, dri, dv);
      c.dK[i * dk + r] += bg * dkb;
      kdkb += ki[r] * dkb;
      const F coef = bg * ki[r];
      F* ds = dSn + r * dv;
      for (int64_t x = 0; x < dv; ++x) ds[x] -= coef * dri[x];
    }
    c.db[i] += c.gam[i] * kdkb;
    c.dgam[i] += c.bet[i] * kdkb;
  }
  // A_ij = beta_i Gamma_ij (k_i.k_j), j < i, with dA_ij = -dR_i.D_j.
  for (int64_t i = 0; i < L; ++i) {
    const F* ki = c.k + i * dk;
    const F* dri = c.dR + i * dv;
    for (int64_t j = 0; j < i; ++j) {
      const F* kj = c.k + j * dk;
      const F da = -dot(dri, c.D + j * dv, dv);
      const F kk = dot(ki, kj, dk), gam = c.Gam[i * L + j];
      c.db[i] += da * gam * kk;
      c.dGam[i * L + j] += da * c.bet[i] * kk;
      const F dkk = da * c.bet[i] * gam;
      F* dki = c.dK + i * dk;
      F* dkj = c.dK + j * dk;
      for (int64_t r = 0; r < dk; ++r) {
        dki[r] += dkk * kj[r];
        dkj[r] += dkk * ki[r];
      }
    }
  }
  // dG_i = dgamma_i gamma_i + sum_{j<i} dGamma_ij Gamma_ij - sum_{m>i} dGamma_mi Gamma_mi (the
  // diagonal's Gamma_ii = 1 does not depend on G); dg_i = sum_{m>=i} dG_m.
  F acc = 0;
  for (int64_t i = L - 1; i >= 0; --i) {
    F dG = c.dgam[i] * c.gam[i];
    for (int64_t j = 0; j < i; ++j) dG += c.dGam[i * L + j] * c.Gam[i * L + j];
    for (int64_t m = i + 1; m < L; ++m) dG -= c.dGam[m * L + i] * c.Gam[m * L + i];
    acc += dG;
    gd.dg[(t0 + i) * hd.gs] = acc;
    gd.dbeta[(t0 + i) * hd.gs] = c.db[i];
    F* dq = gd.dq + (t0 + i) * hd.ks;
    F* dkr = gd.dk + (t0 + i) * hd.ks;
    if (gd.accumulate) {
      for (int64_t r = 0; r < dk; ++r) {
        dq[r] += c.dQ[i * dk + r];
        dkr[r] += c.dK[i * dk + r];
      }
    } else {
      std::memcpy(dq, c.dQ + i * dk, sizeof(F) * dk);
      std::memcpy(dkr, c.dK + i * dk, sizeof(F) * dk);
    }
  }
  std::memcpy(dS, dSn, sizeof(F) * n);
}

// ---------------------------------------------------------------- drivers
// A thread's buffers: the state (forward) or the checkpoints and state gradients (backward),
// and the form's per-chunk scratch.
template <typename F>
struct Scratch {
  F *S, *u, *ddelta, *ck, *dS, *dSn, *states;
  Chunk<F> chunk;
  void bind(Arena<F>& a, const checks::DeltaRuleDims& d, DeltaRuleForm form, int64_t cap, int64_t chunks,
            bool backward) {
    const int64_t n = d.dk * d.dv;
    S = a.take(n), u = a.take(d.dv), ddelta = a.take(d.dv);
    if (backward) ck = a.take(std::max<int64_t>(chunks, 1) * n), dS = a.take(n), dSn = a.take(n);
    if (form == DeltaRuleForm::chunked) chunk.bind(a, cap, d.dk, d.dv, backward);
    else if (backward) states = a.take((cap + 1) * n);
  }
};

template <typename F>
struct Operands {
  const F *q, *k, *v, *g, *beta, *initial;  // initial: nullptr for zeros
  F *out, *final_state;                     // final_state: nullptr when not wanted
  const F* dout;
  const F* dfinal;  // nullptr for zeros
  F *dq, *dk, *dv, *dg, *dbeta, *dinitial;
};

// Runs fn(scratch, item) for item in [0, items) in parallel, each thread with its own slice of ws
// (the forward's items are the B Hv value heads, the backward's the B Hk key heads).
template <typename F, typename Fn>
void for_each_head(const checks::DeltaRuleDims& d, DeltaRuleForm form, int64_t cap, int64_t chunks, bool backward,
                   F* ws, int64_t per_thread, int64_t items, Fn&& fn) {
#pragma omp parallel
  {
    Arena<F> arena{ws + static_cast<int64_t>(omp_get_thread_num()) * per_thread};
    Scratch<F> s{};
    s.bind(arena, d, form, cap, chunks, backward);
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < items; ++item) fn(s, item);
  }
}

template <typename F>
void delta_rule_forward_kernel(const checks::DeltaRuleDims& d, const Operands<F>& x, DeltaRuleForm form, int64_t cap,
                               F* ws, int64_t per_thread) {
  const int64_t n = d.dk * d.dv;
  for_each_head<F>(d, form, cap, 0, false, ws, per_thread, d.B * d.H, [&](Scratch<F>& s, int64_t bh) {
    const Head<F> hd = head_of(d, bh, x.q, x.k, x.v, x.g, x.beta, x.out);
    if (x.initial != nullptr) std::memcpy(s.S, x.initial + bh * n, sizeof(F) * n);
    else std::fill(s.S, s.S + n, F(0));
    if (form == DeltaRuleForm::recurrent) {
      for (int64_t t = 0; t < d.T; ++t) recurrent_step(hd, t, s.S, s.u, hd.out + t * hd.vs);
    } else {
      for (int64_t t0 = 0; t0 < d.T; t0 += cap) {
        const int64_t L = std::min(cap, d.T - t0);
        chunk_prepare(hd, t0, L, s.S, s.chunk);
        chunk_outputs(hd, t0, L, s.S, s.chunk);
        chunk_advance(hd, L, s.S, s.chunk);
      }
    }
    if (x.final_state != nullptr) std::memcpy(x.final_state + bh * n, s.S, sizeof(F) * n);
  });
}

template <typename F>
void delta_rule_backward_kernel(const checks::DeltaRuleDims& d, const Operands<F>& x, DeltaRuleForm form, int64_t cap,
                                int64_t chunks, F* ws, int64_t per_thread) {
  const int64_t n = d.dk * d.dv;
  const int64_t group = d.H / d.Hk;  // value heads per key head
  // One (b, key head) per item: its value heads bh = b Hv + kh group + m, m = 0 .. group - 1, in
  // order on this thread; the first overwrites the shared dq / dk rows, the others add to them.
  for_each_head<F>(d, form, cap, chunks, true, ws, per_thread, d.B * d.Hk, [&](Scratch<F>& s, int64_t bk) {
    const int64_t b = bk / d.Hk, kh = bk % d.Hk;
    for (int64_t m = 0; m < group; ++m) {
      const int64_t bh = b * d.H + kh * group + m;
      const Head<F> hd = head_of(d, bh, x.q, x.k, x.v, x.g, x.beta, static_cast<F*>(nullptr));
      const int64_t row = b * d.T * d.H + bh % d.H;  // (b, t = 0, value head)
      const int64_t krow = b * d.T * d.Hk + kh;      // (b, t = 0, key head)
      const HeadGrad<F> gd{x.dout + row * d.dv, x.dq + krow * d.dk, x.dk + krow * d.dk, x.dv + row * d.dv,
                           x.dg + row,          x.dbeta + row,      m > 0};
      // The forward sweep: ck[c] = the state before chunk c.
      if (x.initial != nullptr) std::memcpy(s.S, x.initial + bh * n, sizeof(F) * n);
      else std::fill(s.S, s.S + n, F(0));
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t t0 = c * cap, L = std::min(cap, d.T - t0);
        std::memcpy(s.ck + c * n, s.S, sizeof(F) * n);
        if (c + 1 == chunks) break;  // the last chunk's end state is not needed
        if (form == DeltaRuleForm::recurrent) {
          for (int64_t t = t0; t < t0 + L; ++t) recurrent_step(hd, t, s.S, s.u, static_cast<F*>(nullptr));
        } else {
          chunk_prepare(hd, t0, L, s.S, s.chunk);
          chunk_advance(hd, L, s.S, s.chunk);
        }
      }
      // The chunks in reverse, d(state) flowing from the end to the start.
      if (x.dfinal != nullptr) std::memcpy(s.dS, x.dfinal + bh * n, sizeof(F) * n);
      else std::fill(s.dS, s.dS + n, F(0));
      for (int64_t c = chunks - 1; c >= 0; --c) {
        const int64_t t0 = c * cap, L = std::min(cap, d.T - t0);
        if (form == DeltaRuleForm::recurrent) {
          std::memcpy(s.states, s.ck + c * n, sizeof(F) * n);
          recurrent_chunk_backward(hd, gd, t0, L, s.states, s.dS, s.u, s.ddelta);
        } else {
          chunk_backward(hd, gd, t0, L, s.ck + c * n, s.dS, s.dSn, s.chunk);
        }
      }
      if (x.dinitial != nullptr) std::memcpy(x.dinitial + bh * n, s.dS, sizeof(F) * n);
    }
  });
}

// Elements of one thread's workspace slice.
template <typename F>
int64_t per_thread_elements(const checks::DeltaRuleDims& d, DeltaRuleForm form, int64_t cap, int64_t chunks,
                            bool backward) {
  Arena<F> counter;
  Scratch<F> s{};
  s.bind(counter, d, form, cap, chunks, backward);
  return counter.used;
}

template <typename F>
const F* data_or_null(const Tensor& t) {
  return t.defined() ? t.data<F>() : nullptr;
}
template <typename F>
F* mutable_or_null(const Tensor& t) {
  return t.defined() ? t.data<F>() : nullptr;
}

}  // namespace

void CpuBackend::delta_rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                    const Tensor& beta, const Tensor& initial_state, const Tensor& out,
                                    const Tensor& final_state, DeltaRuleForm form, int64_t chunk) {
  const char* op = "delta_rule_forward";
  const checks::DeltaRuleDims d = checks::check_delta_rule(q, k, v, g, beta, initial_state, out, final_state, chunk);
  const int64_t cap = std::min(chunk, std::max<int64_t>(d.T, 1));
  dispatch_float(q.dtype(), op, kBackend, [&]<typename F>() {
    const int64_t per_thread = per_thread_elements<F>(d, form, cap, 0, false);
    const Tensor ws = workspace(per_thread * omp_get_max_threads(), q.dtype());
    Operands<F> x{};
    x.q = q.data<F>(), x.k = k.data<F>(), x.v = v.data<F>(), x.g = g.data<F>(), x.beta = beta.data<F>();
    x.initial = data_or_null<F>(initial_state);
    x.out = out.data<F>(), x.final_state = mutable_or_null<F>(final_state);
    delta_rule_forward_kernel<F>(d, x, form, cap, ws.data<F>(), per_thread);
  });
}

void CpuBackend::delta_rule_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                     const Tensor& beta, const Tensor& initial_state, const Tensor& dout,
                                     const Tensor& dfinal_state, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                     const Tensor& dg, const Tensor& dbeta, const Tensor& dinitial_state,
                                     DeltaRuleForm form, int64_t chunk) {
  const char* op = "delta_rule_backward";
  const checks::DeltaRuleDims d = checks::check_delta_rule_backward(q, k, v, g, beta, initial_state, dout, dfinal_state,
                                                                    dq, dk, dv, dg, dbeta, dinitial_state, chunk);
  const int64_t cap = std::min(chunk, std::max<int64_t>(d.T, 1));
  const int64_t chunks = (d.T + cap - 1) / cap;
  dispatch_float(q.dtype(), op, kBackend, [&]<typename F>() {
    const int64_t per_thread = per_thread_elements<F>(d, form, cap, chunks, true);
    const Tensor ws = workspace(per_thread * omp_get_max_threads(), q.dtype());
    Operands<F> x{};
    x.q = q.data<F>(), x.k = k.data<F>(), x.v = v.data<F>(), x.g = g.data<F>(), x.beta = beta.data<F>();
    x.initial = data_or_null<F>(initial_state);
    x.dout = dout.data<F>(), x.dfinal = data_or_null<F>(dfinal_state);
    x.dq = dq.data<F>(), x.dk = dk.data<F>(), x.dv = dv.data<F>(), x.dg = dg.data<F>(), x.dbeta = dbeta.data<F>();
    x.dinitial = mutable_or_null<F>(dinitial_state);
    delta_rule_backward_kernel<F>(d, x, form, cap, chunks, ws.data<F>(), per_thread);
  });
}

}  // namespace loom::cpu_backend_detail
