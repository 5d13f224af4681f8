#include "loom/backend/checks.h"

#include <utility>

#include "loom/core/error.h"

namespace loom::checks {

void expect_dtype(const Tensor& t, DType dtype, const char* op, const char* what) {
  LOOM_CHECK(t.defined(), op, ": ", what, " is undefined");
  LOOM_CHECK(t.dtype() == dtype, op, ": ", what, " is ", t.describe(), ", expected dtype ", dtype_name(dtype));
}

void expect_numel(const Tensor& t, int64_t numel, const char* op, const char* what) {
  LOOM_CHECK(t.numel() == numel, op, ": ", what, " is ", t.describe(), ", expected ", numel, " elements");
}

int64_t rows_of(const Tensor& t) { return t.ndim() == 0 || t.dim(-1) == 0 ? 0 : t.numel() / t.dim(-1); }

GemmDims check_gemm(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec, const Tensor* bias) {
  const char* op = "gemm";
  const bool bf16_in = a.dtype() == DTYPE_BF16;  // bf16 A and B, fp32 C (and bias), or bf16 C
  expect_dtype(b, a.dtype(), op, "B");
  const bool bf16_out = bf16_in && c.dtype() == DTYPE_BF16;
  if (!bf16_out) expect_dtype(c, bf16_in ? DTYPE_F32 : a.dtype(), op, "C");
  LOOM_CHECK(!bf16_out || spec.beta == 0.0f, op, ": a bf16 C is written, not accumulated (beta ", spec.beta,
             ", expected 0)");
  const int64_t batch = spec.batch;
  LOOM_CHECK(batch >= 1 && a.numel() % batch == 0 && b.numel() % batch == 0 && c.numel() % batch == 0, op,
             ": batch ", batch, " does not divide A ", a.describe(), ", B ", b.describe(), ", C ", c.describe());
  GemmDims d{};
  d.a_cols = a.dim(-1), d.b_cols = b.dim(-1), d.n = c.dim(-1);
  d.a_rows = a.numel() / batch / d.a_cols, d.b_rows = b.numel() / batch / d.b_cols;
  d.m = c.numel() / batch / d.n;
  const int64_t op_a_rows = spec.trans_a ? d.a_cols : d.a_rows;
  d.k = spec.trans_a ? d.a_rows : d.a_cols;
  const int64_t op_b_rows = spec.trans_b ? d.b_cols : d.b_rows, op_b_cols = spec.trans_b ? d.b_rows : d.b_cols;
  LOOM_CHECK(op_a_rows == d.m && op_b_rows == d.k && op_b_cols == d.n, op, ": shapes do not chain: op(A) (", op_a_rows,
             ", ", d.k, ") @ op(B) (", op_b_rows, ", ", op_b_cols, ") -> C (", d.m, ", ", d.n, "); A ", a.describe(),
             " B ", b.describe(), " C ", c.describe());
  if (spec.c_in) {
    expect_dtype(*spec.c_in, c.dtype(), op, "c_in");
    expect_numel(*spec.c_in, c.numel(), op, "c_in");
  }
  if (bias) {
    expect_dtype(*bias, bf16_in ? DTYPE_F32 : c.dtype(), op, "bias");
    expect_numel(*bias, d.n, op, "bias");
  }
  return d;
}

GemmDims check_gemm_gelu(const char* op, const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& other,
                         const GemmSpec& spec, const Tensor* bias, const Tensor* scratch) {
  LOOM_CHECK(spec.beta == 0.0f && spec.c_in == nullptr, op, ": the product is written, not accumulated (beta ",
             spec.beta, ", expected 0)");
  const Tensor& c = scratch != nullptr ? *scratch : pre;
  if (scratch != nullptr) expect_dtype(*scratch, DTYPE_F32, op, "scratch");
  const GemmDims d = check_gemm(a, b, c, spec, bias);
  expect_numel(pre, c.numel(), op, "pre");
  expect_numel(other, c.numel(), op, scratch != nullptr ? "dx" : "act");
  return d;
}

void check_elementwise(const char* op, const Tensor& x, std::initializer_list<const Tensor*> others) {
  for (const Tensor* t : others) {
    expect_dtype(*t, x.dtype(), op, "operand");
    expect_numel(*t, x.numel(), op, "operand");
  }
}

bool check_output(const char* op, const Tensor& x, const Tensor& out, int64_t numel) {
  const bool bf16 = out.dtype() == DTYPE_BF16 && x.dtype() == DTYPE_F32;
  LOOM_CHECK(out.dtype() == x.dtype() || bf16, op, ": out ", out.describe(), " must have x's dtype (",
             dtype_name(x.dtype()), "), or be bf16 for an f32 x");
  expect_numel(out, numel, op, "out");
  return bf16;
}

bool check_rounded_copy(const char* op, const Tensor& x, const Tensor& dx, const Tensor& dx16) {
  if (!dx16.defined()) return false;
  LOOM_CHECK(dx16.dtype() == DTYPE_BF16 && x.dtype() == DTYPE_F32, op, ": dx16 ", dx16.describe(),
             " must be bf16, for an f32 x (got ", dtype_name(x.dtype()), ")");
  expect_numel(dx16, dx.numel(), op, "dx16");
  return true;
}

bool check_bias_backward(const Tensor& dout, const Tensor& dbias) {
  const bool bf16 = dout.dtype() == DTYPE_BF16 && dbias.dtype() == DTYPE_F32;
  if (!bf16) expect_dtype(dbias, dout.dtype(), "bias_backward", "dbias");
  expect_numel(dbias, dout.dim(-1), "bias_backward", "dbias");
  return bf16;
}

void check_row_op(const char* op, const Tensor& x, std::initializer_list<const Tensor*> same,
                  std::initializer_list<const Tensor*> per_channel, std::initializer_list<const Tensor*> per_row) {
  check_elementwise(op, x, same);
  for (const Tensor* t : per_channel) {
    expect_dtype(*t, x.dtype(), op, "per-channel operand");
    expect_numel(*t, x.dim(-1), op, "per-channel operand");
  }
  for (const Tensor* t : per_row) {
    expect_dtype(*t, x.dtype(), op, "per-row statistic");
    expect_numel(*t, rows_of(x), op, "per-row statistic");
  }
}

Dims3 check_embedding(const char* op, const Tensor& tokens, const Tensor& table, const Tensor* positions,
                      const Tensor& activations) {
  expect_dtype(tokens, DTYPE_I32, op, "tokens");
  LOOM_CHECK(tokens.ndim() == 2, op, ": tokens must be (B, T), got ", tokens.describe());
  LOOM_CHECK(table.ndim() == 2, op, ": table must be (V, C), got ", table.describe());
  const int64_t seq_len = tokens.dim(1), channels = table.dim(1);
  // A bf16 table is embedding_forward's only (the backward writes an f32 or f64 table).
  const DType wide = table.dtype() == DTYPE_BF16 ? DTYPE_F32 : table.dtype();
  expect_dtype(activations, wide, op, "activations");
  expect_numel(activations, tokens.numel() * channels, op, "activations (B, T, C)");
  if (positions) {
    expect_dtype(*positions, wide, op, "positions");
    LOOM_CHECK(positions->ndim() == 2 && positions->dim(1) == channels && positions->dim(0) >= seq_len, op,
               ": positions must be (Tmax >= ", seq_len, ", ", channels, "), got ", positions->describe());
  }
  return {tokens.numel(), seq_len, channels};
}

void check_glu_shapes(const char* op, const Tensor& x, const Tensor& out) {
  LOOM_CHECK(x.dim(-1) == 2 * out.dim(-1) && rows_of(x) == rows_of(out), op, ": x must be (N, 2F) for out (N, F); x ",
             x.describe(), ", out ", out.describe());
}

ActivationIo check_activation(const char* op, const Tensor& x, const Tensor& out, int64_t numel, const Tensor* dout,
                              int64_t dout_numel) {
  const bool x16 = x.dtype() == DTYPE_BF16;
  if (dout) {
    expect_dtype(*dout, x16 ? DTYPE_F32 : x.dtype(), op, "dout");
    expect_numel(*dout, dout_numel, op, "dout");
  }
  if (!x16) return {false, check_output(op, x, out, numel)};
  LOOM_CHECK(out.dtype() == DTYPE_F32 || out.dtype() == DTYPE_BF16, op, ": out ", out.describe(),
             " must be f32 or bf16 for a bf16 x");
  expect_numel(out, numel, op, "out");
  return {true, out.dtype() == DTYPE_BF16};
}

void check_head_rows(const char* op, const Tensor& x, const Tensor& weight, int64_t first, int64_t n, int64_t hd,
                     const Tensor& in, const Tensor& rstd) {
  const int64_t tokens = rows_of(x);
  LOOM_CHECK(hd > 0 && n > 0 && first >= 0 && (first + n) * hd <= x.dim(-1), op, ": heads [", first, ", ", first + n,
             ") of ", hd, " do not fit in x ", x.describe());
  LOOM_CHECK(weight.ndim() == 1 && weight.dim(0) == hd, op, ": weight ", weight.describe(), " must be (", hd, ")");
  LOOM_CHECK(in.numel() == tokens * n * hd && rstd.numel() == tokens * n, op, ": in ", in.describe(), " / rstd ",
             rstd.describe(), " must hold ", tokens, " x ", n, " heads");
  for (const Tensor* t : {&weight, &in, &rstd}) {
    LOOM_CHECK(t->dtype() == x.dtype(), op, ": ", t->describe(), " must have x's dtype ", x.describe());
  }
}

void check_rope(const char* op, const Tensor& x, int64_t head_dim, int64_t n_heads) {
  LOOM_CHECK(x.ndim() == 3, op, ": x must be (B, T, W), got ", x.describe());
  LOOM_CHECK(head_dim % 2 == 0 && n_heads * head_dim <= x.dim(2), op, ": ", n_heads, " heads of dim ", head_dim,
             " (even) must fit in width ", x.dim(2));
}

void check_rope_rows(const Tensor& x, int64_t head_dim, int64_t n_heads, const std::vector<int64_t>& positions) {
  check_rope("rope_rows_forward", x, head_dim, n_heads);
  LOOM_CHECK(x.dim(1) == 1 && x.dim(0) == static_cast<int64_t>(positions.size()), "rope_rows_forward: x must be (n, 1, W) "
             "for ", positions.size(), " positions, got ", x.describe());
  for (size_t r = 0; r < positions.size(); ++r) {
    LOOM_CHECK(positions[r] >= 0, "rope_rows_forward: row ", r, " has position ", positions[r], " (expected >= 0)");
  }
}

Dims3 check_attention_sinks(const char* op, const Tensor& out, const Tensor& lse, const Tensor& sinks, int64_t n_head,
                            const Tensor* dout, const Tensor* dsinks) {
  LOOM_CHECK(out.ndim() == 3 && n_head > 0 && out.dim(2) % n_head == 0, op, ": out must be (B, T, H hd) with H = ",
             n_head, ", got ", out.describe());
  const int64_t B = out.dim(0), T = out.dim(1), H = n_head;
  LOOM_CHECK(lse.numel() == B * H * T && sinks.numel() == H && lse.dtype() == out.dtype() &&
                 sinks.dtype() == out.dtype(),
             op, ": lse must be (B, H, T) = (", B, ", ", H, ", ", T, ") and sinks (H) of out's dtype, got ",
             lse.describe(), " and ", sinks.describe());
  if (dout != nullptr) {
    LOOM_CHECK(dout->shape() == out.shape() && dout->dtype() == out.dtype() && dsinks != nullptr &&
                   dsinks->numel() == H && dsinks->dtype() == out.dtype(),
               op, ": dout must match out ", out.describe(), " and dsinks be (H) = (", H, "), got ", dout->describe(),
               " and ", dsinks != nullptr ? dsinks->describe() : std::string("none"));
  }
  return {B, T, out.dim(2) / n_head};
}

DType attention_compute_dtype(const Tensor& qkv, bool bf16_ops) {
  return bf16_ops && qkv.dtype() == DTYPE_BF16 ? DTYPE_F32 : qkv.dtype();
}

namespace {
// An attention operand in the compute dtype `wide`, or bf16 where the bf16 ops compute in f32.
void expect_attention_dtype(const Tensor& t, DType wide, bool bf16_ops, const char* op, const char* what) {
  if (!bf16_ops || t.dtype() != DTYPE_BF16 || wide != DTYPE_F32) expect_dtype(t, wide, op, what);
}
}  // namespace

Dims3 check_attention(const char* op, const Tensor& qkv, const Tensor& out, const Tensor& saved, int64_t n_head,
                      int64_t n_kv_head, int64_t window, bool flash, bool bf16_out) {
  LOOM_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0, op, ": n_head ", n_head,
             " must be a multiple of n_kv_head ", n_kv_head);
  LOOM_CHECK(qkv.ndim() == 3 && qkv.dim(2) % (n_head + 2 * n_kv_head) == 0, op,
             ": qkv must be (B, T, (H + 2 KV) hd), got ", qkv.describe());
  LOOM_CHECK(window >= 0, op, ": window must be >= 0, got ", window);
  const int64_t batch = qkv.dim(0), seq_len = qkv.dim(1), head_dim = qkv.dim(2) / (n_head + 2 * n_kv_head);
  const DType wide = attention_compute_dtype(qkv, bf16_out);
  expect_attention_dtype(out, wide, bf16_out, op, "out");
  expect_numel(out, batch * seq_len * n_head * head_dim, op, "out (B, T, H hd)");
  if (flash) {
    expect_dtype(saved, wide, op, "lse");
    expect_numel(saved, batch * n_head * seq_len, op, "lse (B, H, T)");
  } else {
    expect_dtype(saved, qkv.dtype(), op, "probs");
    expect_numel(saved, batch * n_head * seq_len * seq_len, op, "probs (B, H, T, T)");
  }
  return {batch, seq_len, head_dim};
}

Dims3 check_attention_backward(const char* op, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                               const Tensor& saved, const Tensor& dqkv, int64_t n_head, int64_t n_kv_head,
                               int64_t window, bool flash, bool bf16_out) {
  const Dims3 dims = check_attention(op, qkv, out, saved, n_head, n_kv_head, window, flash, bf16_out);
  const DType wide = attention_compute_dtype(qkv, bf16_out);
  expect_attention_dtype(dout, wide, bf16_out, op, "dout");
  expect_numel(dout, out.numel(), op, "dout");
  expect_attention_dtype(dqkv, wide, bf16_out, op, "dqkv");
  expect_numel(dqkv, qkv.numel(), op, "dqkv");
  return dims;
}

void check_cross_entropy(const char* op, const Tensor& logits, const Tensor& targets, const Tensor& lse) {
  expect_dtype(targets, DTYPE_I32, op, "targets");
  expect_numel(targets, rows_of(logits), op, "targets");
  expect_dtype(lse, logits.dtype(), op, "lse");
  expect_numel(lse, rows_of(logits), op, "lse");
}

LossGradOut check_loss_and_grad(const char* op, const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                const Tensor& lse, const Tensor& dlogits, bool by_columns) {
  LOOM_CHECK(!by_columns || logits.ndim() == 2, op, ": logits by columns are a (vocab, rows) matrix, got ",
             logits.describe());
  const int64_t rows = by_columns ? logits.dim(1) : rows_of(logits);
  expect_dtype(targets, DTYPE_I32, op, "targets");
  expect_numel(targets, rows, op, "targets");
  for (const auto& [t, what] : {std::pair{&losses, "losses"}, std::pair{&lse, "lse"}}) {
    expect_dtype(*t, logits.dtype() == DTYPE_BF16 ? DTYPE_F32 : logits.dtype(), op, what);
    expect_numel(*t, rows, op, what);
  }
  expect_numel(dlogits, logits.numel(), op, "dlogits");
  const bool to_bf16 = dlogits.dtype() == DTYPE_BF16 && logits.dtype() == DTYPE_F32;
  LOOM_CHECK(to_bf16 || (dlogits.device_ptr() == logits.device_ptr() && dlogits.dtype() == logits.dtype()), op,
             ": dlogits is the logits (in place) or bf16, got ", dlogits.describe(), " for logits ", logits.describe());
  if (to_bf16) return LossGradOut::to_bf16;
  return logits.dtype() == DTYPE_BF16 ? LossGradOut::bf16_in_place : LossGradOut::in_place;
}

int64_t check_bf16_weight_linear(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor* bias) {
  LOOM_CHECK(w.dtype() == DTYPE_BF16 && w.ndim() == 2, "bf16_weight_linear: w must be a bf16 (rows, cols) matrix, got ",
             w.describe());
  const int64_t rows = w.dim(0), cols = w.dim(1);
  LOOM_CHECK(x.dtype() == DTYPE_F32 && cols > 0 && x.numel() % cols == 0, "bf16_weight_linear: x ", x.describe(),
             " for ", cols, " columns");
  const int64_t n = x.numel() / cols;
  LOOM_CHECK(y.dtype() == DTYPE_F32 && y.numel() == n * rows, "bf16_weight_linear: y ", y.describe(), " for (", n, ", ",
             rows, ")");
  LOOM_CHECK(bias == nullptr || (bias->dtype() == DTYPE_F32 && bias->numel() == rows), "bf16_weight_linear: bias for ",
             rows, " rows");
  return n;
}

// ---- The gated delta rule

namespace {
// t is defined with dtype like's and shape `shape`, else "op: what is f32(..), expected f32(..) legend".
void expect_delta_operand(const char* op, const char* what, const Tensor& t, const Tensor& like, const Shape& shape,
                          const char* legend) {
  LOOM_CHECK(t.defined(), op, ": ", what, " is undefined, expected ", dtype_name(like.dtype()), shape_str(shape), " ",
             legend);
  LOOM_CHECK(t.dtype() == like.dtype() && t.shape() == shape, op, ": ", what, " is ", t.describe(), ", expected ",
             dtype_name(like.dtype()), shape_str(shape), " ", legend);
}

// The inputs both directions read: q, k, v, g, beta and the initial state where defined. q and k
// have Hk heads, v (and so g, beta, the states) Hv, a multiple of Hk.
DeltaRuleDims check_delta_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                 const Tensor& beta, const Tensor& initial_state, int64_t chunk) {
  LOOM_CHECK(q.defined() && q.ndim() == 4 && q.dim(2) > 0, op, ": q is ", q.defined() ? q.describe() : "undefined",
             ", expected 4 dimensions (B, T, Hk, d_k), Hk >= 1");
  DeltaRuleDims d{q.dim(0), q.dim(1), 0, q.dim(3), 0, q.dim(2)};
  LOOM_CHECK(v.defined() && v.ndim() == 4 && v.dim(0) == d.B && v.dim(1) == d.T && v.dim(2) > 0 &&
                 v.dim(2) % d.Hk == 0 && v.dtype() == q.dtype(),
             op, ": v is ", v.defined() ? v.describe() : "undefined", ", expected ", dtype_name(q.dtype()), "(", d.B,
             ", ", d.T, ", Hv, d_v) (B, T, Hv, d_v) with Hv a multiple of q's ", d.Hk, " heads");
  d.H = v.dim(2);
  d.dv = v.dim(3);
  LOOM_CHECK(d.dk > 0 && d.dv > 0, op, ": d_k ", d.dk, " and d_v ", d.dv, " must be positive");
  LOOM_CHECK(chunk >= 1, op, ": chunk ", chunk, " must be >= 1");
  expect_delta_operand(op, "k", k, q, q.shape(), "(B, T, Hk, d_k)");
  expect_delta_operand(op, "g", g, q, {d.B, d.T, d.H}, "(B, T, Hv)");
  expect_delta_operand(op, "beta", beta, q, {d.B, d.T, d.H}, "(B, T, Hv)");
  if (initial_state.defined()) {
    expect_delta_operand(op, "initial_state", initial_state, q, {d.B, d.H, d.dk, d.dv}, "(B, Hv, d_k, d_v)");
  }
  return d;
}
}  // namespace

DeltaRuleDims check_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                               const Tensor& initial_state, const Tensor& out, const Tensor& final_state,
                               int64_t chunk) {
  const char* op = "delta_rule_forward";
  const DeltaRuleDims d = check_delta_inputs(op, q, k, v, g, beta, initial_state, chunk);
  expect_delta_operand(op, "out", out, q, v.shape(), "(B, T, Hv, d_v)");
  if (final_state.defined()) {
    expect_delta_operand(op, "final_state", final_state, q, {d.B, d.H, d.dk, d.dv}, "(B, Hv, d_k, d_v)");
  }
  return d;
}

DeltaRuleDims check_delta_rule_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                        const Tensor& beta, const Tensor& initial_state, const Tensor& dout,
                                        const Tensor& dfinal_state, const Tensor& dq, const Tensor& dk,
                                        const Tensor& dv, const Tensor& dg, const Tensor& dbeta,
                                        const Tensor& dinitial_state, int64_t chunk) {
  const char* op = "delta_rule_backward";
  const DeltaRuleDims d = check_delta_inputs(op, q, k, v, g, beta, initial_state, chunk);
  expect_delta_operand(op, "dout", dout, q, v.shape(), "(B, T, Hv, d_v)");
  if (dfinal_state.defined()) {
    expect_delta_operand(op, "dfinal_state", dfinal_state, q, {d.B, d.H, d.dk, d.dv}, "(B, Hv, d_k, d_v)");
  }
  expect_delta_operand(op, "dq", dq, q, q.shape(), "(B, T, Hk, d_k)");
  expect_delta_operand(op, "dk", dk, q, q.shape(), "(B, T, Hk, d_k)");
  expect_delta_operand(op, "dv", dv, q, v.shape(), "(B, T, Hv, d_v)");
  expect_delta_operand(op, "dg", dg, q, g.shape(), "(B, T, Hv)");
  expect_delta_operand(op, "dbeta", dbeta, q, g.shape(), "(B, T, Hv)");
  if (dinitial_state.defined()) {
    expect_delta_operand(op, "dinitial_state", dinitial_state, q, {d.B, d.H, d.dk, d.dv}, "(B, Hv, d_k, d_v)");
  }
  return d;
}


// ---- Qwen3-Next's linear-attention helpers: the causal depthwise convolution and the gates

ConvDims check_causal_conv1d(const char* op, const Tensor& x, const Tensor& weight, const Tensor& initial,
                             const Tensor& y, const char* y_name, const Tensor& final_state) {
  LOOM_CHECK(x.defined() && x.ndim() == 3, op, ": x is ", x.defined() ? x.describe() : "undefined",
             ", expected 3 dimensions (B, T, C)");
  ConvDims d{x.dim(0), x.dim(1), x.dim(2), 0};
  LOOM_CHECK(weight.defined() && weight.ndim() == 2 && weight.dim(0) == d.C && weight.dim(1) >= 1 &&
                 weight.dtype() == x.dtype(),
             op, ": weight is ", weight.defined() ? weight.describe() : "undefined", ", expected ",
             dtype_name(x.dtype()), "(", d.C, ", K) (C, K), K >= 1");
  d.K = weight.dim(1);
  if (initial.defined()) expect_delta_operand(op, "initial", initial, x, {d.B, d.K - 1, d.C}, "(B, K-1, C)");
  expect_delta_operand(op, y_name, y, x, x.shape(), "(B, T, C)");
  if (final_state.defined()) expect_delta_operand(op, "final", final_state, x, {d.B, d.K - 1, d.C}, "(B, K-1, C)");
  return d;
}

void check_causal_conv1d_grads(const char* op, const ConvDims& d, const Tensor& x, const Tensor& dx,
                               const Tensor& dweight, const Tensor& dinitial) {
  expect_delta_operand(op, "dx", dx, x, x.shape(), "(B, T, C)");
  expect_delta_operand(op, "dweight", dweight, x, {d.C, d.K}, "(C, K)");
  if (dinitial.defined()) expect_delta_operand(op, "dinitial", dinitial, x, {d.B, d.K - 1, d.C}, "(B, K-1, C)");
}

GateDims check_delta_gates(const char* op, const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias,
                           const Tensor& g, const char* g_name, const Tensor& beta, const char* beta_name) {
  LOOM_CHECK(a_log.defined() && a_log.ndim() == 1 && a_log.dim(0) >= 1, op, ": a_log is ",
             a_log.defined() ? a_log.describe() : "undefined", ", expected 1 dimension (H), H >= 1");
  const int64_t H = a_log.dim(0);
  LOOM_CHECK(ba.defined() && ba.ndim() >= 1 && ba.dim(-1) == 2 * H && ba.dtype() == a_log.dtype(), op, ": ba is ",
             ba.defined() ? ba.describe() : "undefined", ", expected ", dtype_name(a_log.dtype()), "(N, ", 2 * H,
             ") (N, 2H) = [b | a] for a_log's ", H, " heads");
  expect_delta_operand(op, "dt_bias", dt_bias, ba, a_log.shape(), "(H)");
  Shape rows = ba.shape();
  rows[rows.size() - 1] = H;
  expect_delta_operand(op, g_name, g, ba, rows, "(N, H)");
  expect_delta_operand(op, beta_name, beta, ba, rows, "(N, H)");
  return {rows_of(ba), H};
}

void check_delta_gates_grads(const char* op, const Tensor& ba, const Tensor& a_log, const Tensor& dba,
                             const Tensor& da_log, const Tensor& ddt_bias) {
  expect_delta_operand(op, "dba", dba, ba, ba.shape(), "(N, 2H)");
  expect_delta_operand(op, "da_log", da_log, ba, a_log.shape(), "(H)");
  expect_delta_operand(op, "ddt_bias", ddt_bias, ba, a_log.shape(), "(H)");
}

}  // namespace loom::checks
