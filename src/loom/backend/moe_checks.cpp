#include "loom/backend/moe_checks.h"

#include <algorithm>

#include "loom/backend/checks.h"
#include "loom/core/error.h"

namespace loom::checks {

namespace {

void expect_f32(const Tensor& t, const char* op, const char* what) { expect_dtype(t, DTYPE_F32, op, what); }
void expect_i32(const Tensor& t, const char* op, const char* what) { expect_dtype(t, DTYPE_I32, op, what); }

// (N, E) router logits and the routing's per-token operands: returns N.
int64_t check_router(const char* op, const Tensor& logits, const Tensor& scores, const Tensor& expert,
                     const MoeRouting& r) {
  LOOM_CHECK(r.experts >= 1 && r.top_k >= 1 && r.top_k <= std::min<int64_t>(r.experts, 64) && r.groups >= 1 &&
                 r.experts % r.groups == 0 && r.topk_groups >= 1 && r.topk_groups <= r.groups && r.seq_len >= 1,
             op, ": bad routing (", r.experts, " experts in ", r.groups, " groups, top ", r.top_k, " of the best ",
             r.topk_groups, " groups, sequences of ", r.seq_len, ")");
  expect_f32(logits, op, "logits");
  LOOM_CHECK(logits.dim(-1) == r.experts, op, ": logits ", logits.describe(), " for ", r.experts, " experts");
  const int64_t N = rows_of(logits);
  expect_f32(scores, op, "scores");
  expect_numel(scores, N * r.experts, op, "scores");
  expect_i32(expert, op, "expert");
  expect_numel(expert, N * r.top_k, op, "expert");
  return N;
}

// counts: moe_assign's (3E + 1) i32.
void check_counts(const char* op, const Tensor& counts, int64_t E) {
  expect_i32(counts, op, "counts");
  expect_numel(counts, 3 * E + 1, op, "counts");
}

// row (N, k) i32 and, when defined, gates shaped as row (f32); rows and out f32 of one width C.
void check_combine(const char* op, const Tensor& rows, const Tensor& row, const Tensor& gates, const Tensor& out) {
  expect_f32(rows, op, "rows");
  expect_f32(out, op, "out");
  expect_i32(row, op, "row");
  LOOM_CHECK(rows.dim(-1) == out.dim(-1) && rows_of(out) == rows_of(row), op, ": rows ", rows.describe(), ", row ",
             row.describe(), " and out ", out.describe(), " do not match (R, C), (N, k), (N, C)");
  if (gates.defined()) {
    expect_f32(gates, op, "gates");
    expect_numel(gates, row.numel(), op, "gates");
  }
}

void expect_shape(const char* op, const char* what, const Tensor& t, const Shape& shape) {
  LOOM_CHECK(t.shape() == shape && t.dtype() == DTYPE_F32, op, ": ", what, " is ", t.describe(), ", expected f32",
             shape_str(shape));
}

// q (B,T,H qk), kr (B,T,d_r), kv (B,T,H (d_n + d_v)), probs (B,H,T,T), out / dout (B,T,H d_v).
MlaAttentionDims check_mla_attention(const char* op, const Tensor& q, const Tensor& kr, const Tensor& kv,
                                     const Tensor& probs, const Tensor& out, const MlaDims& m) {
  LOOM_CHECK(m.n_head >= 1 && m.nope >= 0 && m.rope >= 0 && m.v >= 1 && m.nope + m.rope >= 1 && m.window >= 0 &&
                 q.ndim() == 3,
             op, ": bad dimensions (", m.n_head, " heads, d_n ", m.nope, ", d_r ", m.rope, ", d_v ", m.v,
             ", window ", m.window, ") or q ", q.describe());
  MlaAttentionDims d{q.dim(0), q.dim(1), m.n_head, m.nope, m.rope, m.v, m.nope + m.rope, m.nope + m.v, m.window};
  expect_shape(op, "q", q, {d.B, d.T, d.H * d.qk});
  expect_shape(op, "kr", kr, {d.B, d.T, d.dr});
  expect_shape(op, "kv", kv, {d.B, d.T, d.H * d.kvw});
  expect_shape(op, "probs", probs, {d.B, d.H, d.T, d.T});
  expect_shape(op, "out", out, {d.B, d.T, d.H * d.dv});
  return d;
}

}  // namespace

int64_t check_moe_route(const Tensor& logits, const Tensor& bias, const Tensor& scores, const Tensor& expert,
                        const Tensor& gates, const Tensor& scratch, const MoeRouting& r) {
  const char* op = "moe_route";
  const int64_t N = check_router(op, logits, scores, expert, r);
  expect_f32(bias, op, "bias");
  expect_numel(bias, r.experts, op, "bias");
  expect_f32(gates, op, "gates");
  expect_numel(gates, N * r.top_k, op, "gates");
  expect_f32(scratch, op, "scratch");
  return N;
}

MoeAssignDims check_moe_assign(const Tensor& expert, int64_t capacity, const Tensor& row, const Tensor& token,
                               const Tensor& counts) {
  const char* op = "moe_assign";
  expect_i32(expert, op, "expert");
  expect_i32(row, op, "row");
  expect_i32(token, op, "token");
  expect_i32(counts, op, "counts");
  LOOM_CHECK(counts.numel() >= 4 && (counts.numel() - 1) % 3 == 0 && row.shape() == expert.shape() &&
                 expert.ndim() == 2 && capacity >= 0,
             op, ": expert ", expert.describe(), ", row ", row.describe(), ", counts ", counts.describe(),
             ", capacity ", capacity, ": expected (N, k), (N, k), (3E + 1), capacity >= 0");
  return {expert.dim(0), expert.dim(1), (counts.numel() - 1) / 3};
}

MoeDispatchDims check_moe_dispatch(const Tensor& x, const Tensor& token, const Tensor& rows) {
  const char* op = "moe_dispatch";
  expect_f32(x, op, "x");
  expect_f32(rows, op, "rows");
  expect_i32(token, op, "token");
  const int64_t R = rows_of(rows), C = rows.dim(-1), N = rows_of(x);
  LOOM_CHECK(x.dim(-1) == C, op, ": x ", x.describe(), " and rows ", rows.describe(), " differ in width");
  expect_numel(token, R, op, "token");
  return {R, C, N};
}

MoeCombineDims check_moe_combine(const Tensor& rows, const Tensor& row, const Tensor& gates, const Tensor& out) {
  check_combine("moe_combine", rows, row, gates, out);
  return {rows_of(out), out.dim(-1), row.dim(-1)};
}

MoeCombineDims check_moe_combine_backward(const Tensor& dout, const Tensor& row, const Tensor& gates,
                                          const Tensor& drows) {
  const char* op = "moe_combine_backward";
  LOOM_CHECK(gates.defined(), op, ": needs the gates");
  check_combine(op, drows, row, gates, dout);
  return {rows_of(dout), dout.dim(-1), row.dim(-1)};
}

int64_t check_moe_balance_stats(const Tensor& logits, const Tensor& scores, const Tensor& expert,
                                const Tensor& counts, const Tensor& stats, const Tensor& scratch,
                                const MoeRouting& r) {
  const char* op = "moe_balance_stats";
  const int64_t N = check_router(op, logits, scores, expert, r);
  const int64_t T = r.seq_len;
  LOOM_CHECK(N % T == 0, op, ": ", N, " tokens are not sequences of ", T);
  check_counts(op, counts, r.experts);
  expect_dtype(stats, DTYPE_F64, op, "stats");
  expect_numel(stats, 4, op, "stats");
  expect_dtype(scratch, DTYPE_F64, op, "scratch");
  return N;
}

MoeRouterBackwardDims check_moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& expert,
                                                const Tensor& row, const Tensor& ye, const Tensor& dy,
                                                const Tensor& counts, const Tensor& dlogits, const Tensor& scratch,
                                                const MoeRouting& r) {
  const char* op = "moe_router_backward";
  const int64_t N = check_router(op, logits, scores, expert, r);
  const int64_t E = r.experts, K = r.top_k, T = r.seq_len, C = dy.dim(-1);
  LOOM_CHECK(N % T == 0, op, ": ", N, " tokens are not sequences of ", T);
  check_counts(op, counts, E);
  expect_i32(row, op, "row");
  expect_numel(row, N * K, op, "row");
  expect_f32(ye, op, "ye");
  expect_f32(dy, op, "dy");
  expect_numel(dy, N * C, op, "dy");
  LOOM_CHECK(ye.dim(-1) == C, op, ": ye ", ye.describe(), " and dy ", dy.describe(), " differ in width");
  expect_f32(dlogits, op, "dlogits");
  expect_numel(dlogits, N * E, op, "dlogits");
  expect_dtype(scratch, DTYPE_F64, op, "scratch");
  return {N, C};
}

void check_mla_rope(const Tensor& x, int64_t heads, int64_t stride, int64_t offset, int64_t dr, int64_t pos_offset) {
  const char* op = "mla_rope";
  expect_dtype(x, DTYPE_F32, op, "x");
  LOOM_CHECK(x.ndim() == 3 && dr > 0 && dr % 2 == 0 && heads >= 1 && offset >= 0 && pos_offset >= 0 &&
                 offset + (heads - 1) * stride + dr <= x.dim(2),
             op, ": x ", x.describe(), " has no ", heads, " slices of width ", dr, " at ", offset, " + h ", stride);
}

MlaAttentionDims check_mla_attention_forward(const Tensor& q, const Tensor& kr, const Tensor& kv,
                                             const Tensor& probs, const Tensor& out, const MlaDims& m) {
  return check_mla_attention("mla_attention_forward", q, kr, kv, probs, out, m);
}

MlaAttentionDims check_mla_attention_backward(const Tensor& q, const Tensor& kr, const Tensor& kv,
                                              const Tensor& probs, const Tensor& dout, const Tensor& dq,
                                              const Tensor& dkv, const Tensor& dkr, const Tensor& dp_row,
                                              const MlaDims& m) {
  const char* op = "mla_attention_backward";
  const MlaAttentionDims d = check_mla_attention(op, q, kr, kv, probs, dout, m);
  expect_shape(op, "dq", dq, q.shape());
  expect_shape(op, "dkv", dkv, kv.shape());
  expect_shape(op, "dkr", dkr, kr.shape());
  expect_dtype(dp_row, DTYPE_F32, op, "dp_row");
  LOOM_CHECK(dp_row.numel() >= d.T, op, ": dp_row ", dp_row.describe(), " holds fewer than T = ", d.T, " floats");
  return d;
}

MlaLatentDims check_mla_attend_latents(const Tensor& q, const Tensor& latents, const Tensor& kv_b, const Tensor& out,
                                       const MlaDims& m) {
  const char* op = "mla_attend_latents";
  const int64_t H = m.n_head, dn = m.nope, dr = m.rope, dv = m.v, dc = m.latent, qk = dn + dr, kvw = dn + dv;
  const int64_t lw = dc + dr;
  LOOM_CHECK(H >= 1 && dc >= 1 && qk >= 1 && dv >= 1 && latents.ndim() == 2 && latents.dim(1) == lw &&
                 latents.dim(0) >= 1,
             op, ": latents ", latents.describe(), " for d_c ", dc, " + d_r ", dr, " (at least one position)");
  expect_dtype(latents, DTYPE_F32, op, "latents");
  expect_dtype(q, DTYPE_F32, op, "q");
  expect_numel(q, H * qk, op, "q");
  expect_shape(op, "kv_b", kv_b, {H * kvw, dc});
  expect_dtype(out, DTYPE_F32, op, "out");
  expect_numel(out, H * dv, op, "out");
  return {H, dn, dr, dv, dc, qk, kvw, lw, latents.dim(0)};
}

}  // namespace loom::checks
