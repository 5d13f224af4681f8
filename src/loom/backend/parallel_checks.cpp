#include "loom/backend/parallel_checks.h"

#include <initializer_list>
#include <utility>

#include "loom/core/error.h"

namespace loom::checks {

namespace {

void expect_f32(const Tensor& t, const char* op, const char* what) { expect_dtype(t, DTYPE_F32, op, what); }

using NamedRows = std::initializer_list<std::pair<const char*, const Tensor*>>;

// Each of `rows` is f32 with n elements.
void expect_rows(const char* op, int64_t n, NamedRows rows) {
  for (const auto& [what, t] : rows) {
    expect_f32(*t, op, what);
    expect_numel(*t, n, op, what);
  }
}

// logits (N, Vs) f32 with valid <= Vs, targets (N) i32 when given, and the f32 rows (N) by name: returns N.
int64_t check_ce_rows(const char* op, const Tensor& logits, const Tensor* targets, int64_t valid, NamedRows rows) {
  expect_f32(logits, op, "logits");
  const int64_t n = rows_of(logits), V = logits.dim(-1);
  LOOM_CHECK(valid <= V, op, ": valid ", valid, " exceeds the ", V, " columns of ", logits.describe());
  if (targets != nullptr) {
    expect_dtype(*targets, DTYPE_I32, op, "targets");
    expect_numel(*targets, n, op, "targets");
  }
  expect_rows(op, n, rows);
  return n;
}

// (B, T, C) activations: 3 dims, f32.
void expect_activations(const Tensor& t, const char* op, const char* what) {
  expect_f32(t, op, what);
  LOOM_CHECK(t.ndim() == 3, op, ": ", what, " is ", t.describe(), ", expected (B, T, C)");
}

// q (B, Tl, H hd) of a ring op (and the per-row stats (B, H, Tl)), rank in [0, world).
RingOpDims ring_dims(const char* op, const Tensor& q, int64_t n_head, int64_t n_kv_head, int rank, int world) {
  LOOM_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0, op, ": n_head ", n_head,
             " must be a positive multiple of n_kv_head ", n_kv_head);
  LOOM_CHECK(q.ndim() == 3 && q.dim(2) % n_head == 0 && q.dim(1) % 2 == 0, op, ": q is ", q.describe(),
             ", expected (B, Tl, n_head * head_dim) with n_head ", n_head, " and an even Tl");
  LOOM_CHECK(world >= 1 && rank >= 0 && rank < world, op, ": rank ", rank, " outside [0, ", world, ")");
  return {q.dim(0), q.dim(1), n_head, n_kv_head, q.dim(2) / n_head};
}

void expect_like(const char* op, const char* what, const Tensor& t, const Tensor& like, const Shape& shape) {
  LOOM_CHECK(t.shape() == shape && t.dtype() == like.dtype(), op, ": ", what, " is ", t.describe(), ", expected ",
             dtype_name(like.dtype()), shape_str(shape));
}

// ring_dims of q for `block`, its owner in [0, world), and k, v (B, Tl, KV hd) of q's dtype.
RingOpDims check_block(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const RingBlock& block) {
  const RingOpDims d = ring_dims(op, q, block.n_head, block.n_kv_head, block.rank, block.world);
  LOOM_CHECK(block.owner >= 0 && block.owner < block.world, op, ": owner ", block.owner, " outside [0, ", block.world,
             ")");
  expect_like(op, "k", k, q, {d.B, d.Tl, d.KV * d.hd});
  expect_like(op, "v", v, q, {d.B, d.Tl, d.KV * d.hd});
  return d;
}

// The block's extent on one side fits in t: the last row ends within its numel.
void check_block_side(const char* what, const Tensor& t, int64_t row, int64_t col, int64_t stride, const BlockCopy& b) {
  LOOM_CHECK(t.defined(), "copy_block: ", what, " is undefined");
  LOOM_CHECK(row >= 0 && col >= 0 && col + b.cols <= stride &&
                 (b.rows == 0 || (row + b.rows - 1) * stride + col + b.cols <= t.numel()),
             "copy_block: ", b.rows, " x ", b.cols, " block at (", row, ", ", col, ") with row stride ", stride,
             " is outside ", what, " ", t.describe());
}

}  // namespace

// ---- The vocabulary-parallel ends

VocabTokenDims check_vocab_embedding_forward(const Tensor& tokens, const Tensor& weight, int64_t valid,
                                             const Tensor& out) {
  const char* op = "vocab_embedding_forward";
  expect_dtype(tokens, DTYPE_I32, op, "tokens");
  expect_f32(weight, op, "weight");
  expect_f32(out, op, "out");
  const int64_t n = tokens.numel(), C = weight.dim(1);
  LOOM_CHECK(weight.ndim() == 2 && out.numel() == n * C && valid <= weight.dim(0), "vocab-parallel embedding: out ",
             out.describe(), " and table ", weight.describe(), " do not fit ", n, " tokens");
  return {n, C};
}

VocabTokenDims check_vocab_embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dweight,
                                              int64_t valid) {
  const char* op = "vocab_embedding_backward";
  expect_dtype(tokens, DTYPE_I32, op, "tokens");
  expect_f32(dout, op, "dout");
  expect_f32(dweight, op, "dweight");
  const int64_t n = tokens.numel(), C = dweight.dim(1);
  LOOM_CHECK(dweight.ndim() == 2 && dout.numel() == n * C && valid <= dweight.dim(0), op, ": dout ",
             dout.describe(), " and dweight ", dweight.describe(), " do not fit ", n, " tokens");
  return {n, C};
}

Dims3 check_position_rows(const char* op, const Tensor& act, const Tensor& positions, int64_t first) {
  expect_activations(act, op, "activations");
  expect_f32(positions, op, "positions");
  LOOM_CHECK(positions.ndim() == 2 && positions.dim(1) == act.dim(2) && first >= 0 &&
                 first + act.dim(1) <= positions.dim(0),
             op, ": positions ", positions.describe(), " has no rows ", first, " .. ", first + act.dim(1) - 1,
             " of width ", act.dim(2));
  return {act.dim(0), act.dim(1), act.dim(2)};
}

int64_t check_vocab_ce_partials(const Tensor& logits, const Tensor& targets, int64_t valid, const Tensor& max,
                                const Tensor& target) {
  return check_ce_rows("vocab_ce_partials", logits, &targets, valid, {{"max", &max}, {"target", &target}});
}

int64_t check_vocab_ce_sums(const Tensor& logits, const Tensor& max, int64_t valid, const Tensor& sums) {
  return check_ce_rows("vocab_ce_sums", logits, nullptr, valid, {{"max", &max}, {"sums", &sums}});
}

int64_t check_vocab_ce_finish(const Tensor& targets, const Tensor& lse, const Tensor& sums, const Tensor& losses) {
  const char* op = "vocab_ce_finish";
  const int64_t n = lse.numel();
  expect_rows(op, n, {{"lse", &lse}, {"sums", &sums}, {"losses", &losses}});
  expect_dtype(targets, DTYPE_I32, op, "targets");
  expect_numel(targets, n, op, "targets");
  return n;
}

int64_t check_vocab_ce_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t valid,
                                const Tensor& dlogits) {
  const char* op = "vocab_ce_backward";
  const int64_t n = check_ce_rows(op, logits, &targets, valid, {{"lse", &lse}});
  expect_f32(dlogits, op, "dlogits");
  expect_numel(dlogits, logits.numel(), op, "dlogits");
  return n;
}

// ---- Ring attention

RingOpDims check_ring_attention_merge(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                      const Tensor& m, const Tensor& l, const RingBlock& block) {
  const char* op = "ring_attention_merge";
  const RingOpDims d = check_block(op, q, k, v, block);
  expect_like(op, "out", out, q, q.shape());
  expect_like(op, "m", m, q, {d.B, d.H, d.Tl});
  expect_like(op, "l", l, q, {d.B, d.H, d.Tl});
  return d;
}

RingOpDims check_ring_attention_finish(const Tensor& out, const Tensor& lse, const Tensor& l, int64_t n_head) {
  const char* op = "ring_attention_finish";
  const RingOpDims d = ring_dims(op, out, n_head, 1, 0, 1);
  expect_like(op, "lse", lse, out, {d.B, d.H, d.Tl});
  expect_like(op, "l", l, out, {d.B, d.H, d.Tl});
  return d;
}

RingOpDims check_attention_row_dot(const Tensor& dout, const Tensor& out, const Tensor& D, int64_t n_head) {
  const char* op = "attention_row_dot";
  const RingOpDims d = ring_dims(op, out, n_head, 1, 0, 1);
  expect_like(op, "dout", dout, out, out.shape());
  expect_like(op, "D", D, out, {d.B, d.H, d.Tl});
  return d;
}

RingOpDims check_ring_attention_block_backward(const Tensor& q, const Tensor& dout, const Tensor& lse,
                                               const Tensor& D, const Tensor& k, const Tensor& v, const Tensor& dq,
                                               const Tensor& dk, const Tensor& dv, const RingBlock& block) {
  const char* op = "ring_attention_block_backward";
  const RingOpDims d = check_block(op, q, k, v, block);
  expect_like(op, "dout", dout, q, q.shape());
  expect_like(op, "dq", dq, q, q.shape());
  expect_like(op, "lse", lse, q, {d.B, d.H, d.Tl});
  expect_like(op, "D", D, q, {d.B, d.H, d.Tl});
  expect_like(op, "dk", dk, q, k.shape());
  expect_like(op, "dv", dv, q, k.shape());
  return d;
}

// ---- Model-parallel slicing

void check_copy_block(const Tensor& src, const Tensor& dst, const BlockCopy& b) {
  LOOM_CHECK(src.defined() && dst.defined() && src.dtype() == dst.dtype(), "copy_block: src ",
             src.defined() ? src.describe() : "undefined", " and dst ", dst.defined() ? dst.describe() : "undefined",
             " must share a dtype");
  LOOM_CHECK(b.rows >= 0 && b.cols >= 0, "copy_block: negative block ", b.rows, " x ", b.cols);
  check_block_side("src", src, b.src_row, b.src_col, b.src_stride, b);
  check_block_side("dst", dst, b.dst_row, b.dst_col, b.dst_stride, b);
}

// ---- Per-head RMSNorm

int64_t check_head_rmsnorm_forward(const Tensor& x, const Tensor& weight, int64_t first, int64_t n, int64_t hd,
                                   const Tensor& in, const Tensor& rstd) {
  check_head_rows("head_rmsnorm_forward", x, weight, first, n, hd, in, rstd);
  return rows_of(x);
}

int64_t check_head_rmsnorm_backward(const Tensor& dx, const Tensor& in, const Tensor& weight, const Tensor& rstd,
                                    int64_t first, int64_t n, int64_t hd, const Tensor& dweight) {
  const char* op = "head_rmsnorm_backward";
  check_head_rows(op, dx, weight, first, n, hd, in, rstd);
  LOOM_CHECK(dweight.shape() == weight.shape() && dweight.dtype() == weight.dtype(), op, ": dweight ",
             dweight.describe(), " must match weight ", weight.describe());
  return rows_of(dx);
}

}  // namespace loom::checks
