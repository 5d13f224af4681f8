#include "loom/backend/compress_checks.h"

#include "loom/backend/checks.h"
#include "loom/core/error.h"

namespace loom::checks {

namespace {

void expect_f32(const Tensor& t, const char* op, const char* what) { expect_dtype(t, DTYPE_F32, op, what); }
void expect_i32(const Tensor& t, const char* op, const char* what) { expect_dtype(t, DTYPE_I32, op, what); }

// (rows, cols) of a matrix operand: its first dim and the rest.
void matrix_dims(const Tensor& t, const char* op, const char* what, int64_t& rows, int64_t& cols) {
  LOOM_CHECK(t.ndim() >= 1 && t.dim(0) > 0, op, ": ", what, " is ", t.describe(), ", expected a matrix");
  rows = t.dim(0);
  cols = t.numel() / rows;
}

// Three f32 operands of a low-rank product: a (a_rows, a_cols) and b (b_rows, b_cols), and out.
struct MatrixPair {
  int64_t a_rows = 0, a_cols = 0, b_rows = 0, b_cols = 0;
};
MatrixPair lowrank_operands(const char* op, const Tensor& a, const Tensor& b, const Tensor& out, const char* a_name,
                            const char* b_name) {
  expect_f32(a, op, a_name);
  expect_f32(b, op, b_name);
  expect_f32(out, op, "out");
  MatrixPair d;
  matrix_dims(a, op, a_name, d.a_rows, d.a_cols);
  matrix_dims(b, op, b_name, d.b_rows, d.b_cols);
  return d;
}

// Checks R gathered rows of `per_rank` words each and R scalars; returns the words per rank.
int64_t gathered_words(const Tensor& words, const Tensor& scalars, const char* op) {
  expect_i32(words, op, "codes");
  expect_f32(scalars, op, "scales");
  const int64_t ranks = scalars.numel();
  LOOM_CHECK(ranks > 0 && words.numel() % ranks == 0, op, ": ", words.describe(), " is not ", ranks, " equal rows");
  return words.numel() / ranks;
}

// An encoder's operands: x (n) f32, words i32 of ceil(n / per_word), scalar (1) f32; returns n.
int64_t encoded_operands(const char* op, const Tensor& x, const Tensor& words, const Tensor& scalar, const char* x_name,
                         const char* words_name, const char* scalar_name, int64_t per_word) {
  expect_f32(x, op, x_name);
  expect_i32(words, op, words_name);
  expect_f32(scalar, op, scalar_name);
  const int64_t n = x.numel();
  expect_numel(words, (n + per_word - 1) / per_word, op, words_name);
  expect_numel(scalar, 1, op, scalar_name);
  return n;
}

// A decoder's operands: gathered_words' and out f32 of n `what` that fill a rank's row of
// per_word to a word; returns the words per rank.
int64_t decoded_operands(const char* op, const Tensor& words, const Tensor& scalars, const Tensor& out,
                         int64_t per_word, const char* what) {
  const int64_t w = gathered_words(words, scalars, op), n = out.numel();
  expect_f32(out, op, "out");
  LOOM_CHECK(w == (n + per_word - 1) / per_word, op, ": ", w, " words per rank do not hold ", n, " ", what);
  return w;
}

}  // namespace

TopkDims check_topk_extract(const Tensor& acc, const Tensor& idx, const Tensor& val, const Tensor& scratch) {
  const char* op = "topk_extract";
  expect_f32(acc, op, "acc");
  expect_i32(idx, op, "idx");
  expect_f32(val, op, "val");
  expect_i32(scratch, op, "scratch");
  const int64_t n = acc.numel(), k = idx.numel();
  expect_numel(val, k, op, "val");
  LOOM_CHECK(k >= 1 && k <= n, op, ": k = ", k, " must be in [1, ", n, "]");
  LOOM_CHECK(scratch.numel() >= n, op, ": scratch has ", scratch.numel(), " elements, expected at least ", n);
  return {n, k};
}

int64_t check_scatter_add(const Tensor& idx, const Tensor& val, const Tensor& out) {
  const char* op = "scatter_add";
  expect_i32(idx, op, "idx");
  expect_f32(val, op, "val");
  expect_f32(out, op, "out");
  expect_numel(val, idx.numel(), op, "val");
  return idx.numel();
}

void check_scatter_zero(const Tensor& idx, const Tensor& x) {
  const char* op = "scatter_zero";
  expect_i32(idx, op, "idx");
  expect_f32(x, op, "x");
}

int64_t check_dgc_accumulate(const Tensor& g, const Tensor& u, const Tensor& v) {
  const char* op = "dgc_accumulate";
  expect_f32(g, op, "g");
  expect_f32(u, op, "u");
  expect_f32(v, op, "v");
  const int64_t n = g.numel();
  expect_numel(u, n, op, "u");
  expect_numel(v, n, op, "v");
  return n;
}

int64_t check_onebit_encode(const Tensor& acc, const Tensor& words, const Tensor& scale) {
  return encoded_operands("onebit_encode", acc, words, scale, "acc", "words", "scale", 32);
}

int64_t check_onebit_decode_add(const Tensor& words, const Tensor& scales, const Tensor& out) {
  return decoded_operands("onebit_decode_add", words, scales, out, 32, "signs");
}

int64_t check_qsgd_encode(const Tensor& g, const Tensor& codes, const Tensor& norm, const QsgdSpec& spec) {
  const char* op = "qsgd_encode";
  const int64_t n = encoded_operands(op, g, codes, norm, "g", "codes", "norm", 4);
  LOOM_CHECK(spec.levels >= 1 && spec.levels <= 127, op, ": levels must be in [1, 127], got ", spec.levels);
  return n;
}

int64_t check_qsgd_decode_add(const Tensor& codes, const Tensor& norms, const Tensor& out) {
  return decoded_operands("qsgd_decode_add", codes, norms, out, 4, "codes");
}

LowrankDims check_lowrank_project(const Tensor& m, const Tensor& q, const Tensor& out, bool transpose) {
  const char* op = "lowrank_project";
  const auto [rows, cols, q_rows, r] = lowrank_operands(op, m, q, out, "m", "q");
  LOOM_CHECK(q_rows == (transpose ? rows : cols), op, ": q ", q.describe(), " does not match m ", m.describe());
  expect_numel(out, (transpose ? cols : rows) * r, op, "out");
  return {rows, cols, r};
}

PanelDims check_orthonormalize_columns(const Tensor& p) {
  const char* op = "orthonormalize_columns";
  expect_f32(p, op, "p");
  PanelDims d{0, 0};
  matrix_dims(p, op, "p", d.rows, d.r);
  return d;
}

LowrankDims check_lowrank_expand(const Tensor& p, const Tensor& q, const Tensor& out) {
  const char* op = "lowrank_expand";
  const auto [rows, r, cols, q_r] = lowrank_operands(op, p, q, out, "p", "q");
  LOOM_CHECK(q_r == r, op, ": q ", q.describe(), " and p ", p.describe(), " differ in rank");
  expect_numel(out, rows * cols, op, "out");
  return {rows, cols, r};
}

}  // namespace loom::checks
