#include "loom/backend/optim_checks.h"

#include <algorithm>
#include <initializer_list>
#include <utility>

#include "loom/backend/checks.h"
#include "loom/core/error.h"

namespace loom::checks {

namespace {

using Named = std::initializer_list<std::pair<const char*, const Tensor*>>;

// x is f32; each of `same` is f32 with x's numel, or undefined (an optional state operand).
int64_t check_flat(const char* op, const Tensor& x, const char* what, Named same) {
  expect_dtype(x, DTYPE_F32, op, what);
  for (const auto& [name, t] : same) {
    if (!t->defined()) continue;
    expect_dtype(*t, DTYPE_F32, op, name);
    expect_numel(*t, x.numel(), op, name);
  }
  return x.numel();
}

void expect_f32(const Tensor& t, int64_t n, const char* op, const char* what) {
  expect_dtype(t, DTYPE_F32, op, what);
  expect_numel(t, n, op, what);
}

// param, grad (and each defined one of `same`) f32 of one size; state f32 of rows + cols
// (factored) or of the segment's size (else).
FactoredSegment check_segment(const char* op, const Tensor& param, const Tensor& grad, const Tensor& state,
                              bool factored, Named same) {
  expect_dtype(param, DTYPE_F32, op, "param");
  const int64_t N = param.numel();
  for (const auto& [what, t] : same) {
    if (!t->defined()) continue;
    expect_dtype(*t, DTYPE_F32, op, what);
    expect_numel(*t, N, op, what);
  }
  expect_dtype(grad, DTYPE_F32, op, "grad");
  expect_numel(grad, N, op, "grad");
  const FactoredSegment s = factored ? FactoredSegment{rows_of(grad), grad.dim(-1)} : FactoredSegment{1, N};
  expect_dtype(state, DTYPE_F32, op, "state");
  expect_numel(state, factored ? s.m + s.n : N, op, "state");
  return s;
}

}  // namespace

int64_t check_sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf) {
  return check_flat("sgd_step", param, "param", {{"grad", &grad}, {"buf", &buf}});
}

int64_t check_adagrad_step(const Tensor& param, const Tensor& grad, const Tensor& sum) {
  LOOM_CHECK(sum.defined(), "adagrad_step: needs the sum operand");
  return check_flat("adagrad_step", param, "param", {{"grad", &grad}, {"sum", &sum}});
}

int64_t check_rmsprop_step(const Tensor& param, const Tensor& grad, const Tensor& square, const Tensor& avg,
                           const Tensor& buf) {
  LOOM_CHECK(square.defined(), "rmsprop_step: needs the square operand");
  return check_flat("rmsprop_step", param, "param",
                    {{"grad", &grad}, {"square", &square}, {"avg", &avg}, {"buf", &buf}});
}

int64_t check_adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& vmax) {
  LOOM_CHECK(m.defined() && v.defined(), "adam_step: needs the m and v operands");
  return check_flat("adam_step", param, "param", {{"grad", &grad}, {"m", &m}, {"v", &v}, {"vmax", &vmax}});
}

int64_t check_lion_step(const Tensor& param, const Tensor& grad, const Tensor& m) {
  LOOM_CHECK(m.defined(), "lion_step: needs the m operand");
  return check_flat("lion_step", param, "param", {{"grad", &grad}, {"m", &m}});
}

AdamMiniBlocks check_adam_mini_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v) {
  const char* op = "adam_mini_step";
  LOOM_CHECK(m.defined() && v.defined(), op, ": needs the m and v operands");
  const int64_t n = check_flat(op, param, "param", {{"grad", &grad}, {"m", &m}});
  expect_dtype(v, DTYPE_F32, op, "v");
  const int64_t nblocks = v.numel(), bn = n / std::max<int64_t>(nblocks, 1);
  LOOM_CHECK(nblocks > 0 && bn * nblocks == n, op, ": v ", v.describe(), " does not split ", param.describe(),
             " into whole blocks");
  return {n, nblocks, bn};
}

OptimMatrix check_scale_transpose(const Tensor& src, const Tensor& dst) {
  expect_dtype(src, DTYPE_F32, "scale_transpose", "src");
  expect_f32(dst, src.numel(), "scale_transpose", "dst");
  return {rows_of(src), src.dim(-1)};
}

int64_t check_axpy(const Tensor& y, const Tensor& x) { return check_flat("axpy", y, "y", {{"x", &x}}); }

int64_t check_muon_momentum(const Tensor& grad, const Tensor& buf, const Tensor& u) {
  LOOM_CHECK(buf.defined() && u.defined(), "muon_momentum: needs the buf and u operands");
  return check_flat("muon_momentum", grad, "grad", {{"buf", &buf}, {"u", &u}});
}

int64_t check_newton_schulz_normalize(const Tensor& u, const Tensor& x) {
  expect_dtype(u, DTYPE_F32, "newton_schulz_normalize", "u");
  expect_f32(x, u.numel(), "scale_transpose", "dst");
  return u.numel();
}

int64_t check_decayed_update(const Tensor& param, const Tensor& u) {
  return check_flat("decayed_update", param, "param", {{"u", &u}});
}

SoftTargetRows check_soft_target_loss(const Tensor& logits, const Tensor& teacher, float temperature,
                                      const Tensor& losses, const Tensor& grad) {
  LOOM_CHECK(logits.dtype() == DTYPE_F32 && teacher.dtype() == DTYPE_F32 && grad.dtype() == DTYPE_F32 &&
             losses.dtype() == DTYPE_F32, "soft_target_loss: f32 operands expected");
  LOOM_CHECK(logits.numel() == teacher.numel() && logits.numel() == grad.numel() && logits.numel() > 0,
             "soft_target_loss: logits ", logits.describe(), ", teacher ", teacher.describe(), ", grad ", grad.describe());
  LOOM_CHECK(temperature > 0.0f, "soft_target_loss: temperature ", temperature, " must be > 0");
  const int64_t V = logits.dim(-1), N = logits.numel() / V;
  LOOM_CHECK(losses.numel() == N, "soft_target_loss: losses ", losses.describe(), " for ", N, " rows");
  return {N, V};
}

FactoredSegment check_adafactor_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m,
                                     const Tensor& u, bool factored) {
  return check_segment("adafactor_step", param, grad, state, factored, {{"m", &m}, {"u", &u}});
}

FactoredSegment check_sm3_step(const Tensor& param, const Tensor& grad, const Tensor& acc, bool factored) {
  return check_segment("sm3_step", param, grad, acc, factored, {});
}

FactoredSegment check_came_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m,
                                const Tensor& res, const Tensor& u, bool factored) {
  const char* op = "came_step";
  LOOM_CHECK(m.defined() && (res.defined() || !factored), op, ": needs the m operand, and res when factored");
  const FactoredSegment s = check_segment(op, param, grad, state, factored, {{"m", &m}, {"u", &u}});
  if (factored) expect_f32(res, s.m + s.n, op, "res");
  return s;
}

OptimMatrix check_leading_eigenvectors(const Tensor& s, const Tensor& p) {
  const char* op = "leading_eigenvectors";
  expect_dtype(s, DTYPE_F32, op, "s");
  expect_dtype(p, DTYPE_F32, op, "p");
  const int64_t n = s.dim(-1), r = p.dim(-1);
  LOOM_CHECK(rows_of(s) == n && rows_of(p) == n && r <= n, op, ": s ", s.describe(), " must be (n, n) and p ",
             p.describe(), " (n, r <= n)");
  return {n, r};
}

OptimMatrix check_gram_schmidt(const Tensor& y, const Tensor& fallback, const Tensor& p) {
  const char* op = "gram_schmidt";
  expect_dtype(y, DTYPE_F32, op, "y");
  expect_f32(fallback, y.numel(), op, "fallback");
  expect_f32(p, y.numel(), op, "p");
  return {rows_of(y), y.dim(-1)};
}

LdadamRotateDims check_ldadam_rotate(const Tensor& p, const Tensor& prev, const Tensor& m, const Tensor& v,
                                     const Tensor& mt, const Tensor& vt) {
  const char* op = "ldadam_rotate";
  check_flat(op, p, "p", {{"prev", &prev}});
  check_flat(op, m, "m", {{"v", &v}, {"mt", &mt}, {"vt", &vt}});
  const int64_t M = rows_of(p), r = p.dim(-1);
  if (r == 0) return {M, 0, 0};
  const int64_t N = m.numel() / r;
  LOOM_CHECK(r * N == m.numel(), op, ": m ", m.describe(), " is not (r, N) for p ", p.describe());
  return {M, r, N};
}

int64_t check_ldadam_adam(const Tensor& m, const Tensor& v, const Tensor& mt, const Tensor& vt, const Tensor& gh) {
  return check_flat("ldadam_adam", m, "m", {{"v", &v}, {"mt", &mt}, {"vt", &vt}, {"gh", &gh}});
}

OptimMatrix check_ldadam_apply(const Tensor& param, const Tensor& grad, const Tensor& d, const Tensor& e) {
  check_flat("ldadam_apply", param, "param", {{"grad", &grad}, {"d", &d}, {"e", &e}});
  return {rows_of(param), param.dim(-1)};
}

}  // namespace loom::checks
