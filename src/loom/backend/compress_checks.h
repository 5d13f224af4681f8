// Operand validation of the gradient compression ops (contracts in backend.h), shared by the CPU
// (cpu/cpu_compress.cpp) and CUDA (cuda/cuda_compress_ops.cpp) backends so that a bad call fails
// with the same one-line message on both. Each function checks one op's operands in the order the
// op always did and returns the sizes the op needs; a check only one backend makes (CUDA's int32
// limits, the index range read back after a scatter) stays in that backend, after the call.
#pragma once
#include <cstdint>

#include "loom/backend/backend.h"

namespace loom::checks {

// acc (n) f32, idx (k) i32 and val (k) f32 with 1 <= k <= n, scratch i32 of at least n.
struct TopkDims {
  int64_t n, k;
};
TopkDims check_topk_extract(const Tensor& acc, const Tensor& idx, const Tensor& val, const Tensor& scratch);
// idx i32, val f32 of idx's numel, out f32: returns idx's numel.
int64_t check_scatter_add(const Tensor& idx, const Tensor& val, const Tensor& out);
// idx i32, x f32.
void check_scatter_zero(const Tensor& idx, const Tensor& x);
// g, u, v f32 of one numel: returns it.
int64_t check_dgc_accumulate(const Tensor& g, const Tensor& u, const Tensor& v);
// acc (n) f32, words i32 of ceil(n / 32), scale (1) f32: returns n.
int64_t check_onebit_encode(const Tensor& acc, const Tensor& words, const Tensor& scale);
// words i32 of R equal rows, scales (R) f32, out f32 of n whose signs fill a row: returns the
// words per rank.
int64_t check_onebit_decode_add(const Tensor& words, const Tensor& scales, const Tensor& out);
// g (n) f32, codes i32 of ceil(n / 4), norm (1) f32, spec.levels in [1, 127]: returns n.
int64_t check_qsgd_encode(const Tensor& g, const Tensor& codes, const Tensor& norm, const QsgdSpec& spec);
// codes i32 of R equal rows, norms (R) f32, out f32 of n whose codes fill a row: returns the
// words per rank.
int64_t check_qsgd_decode_add(const Tensor& codes, const Tensor& norms, const Tensor& out);

// A low-rank product's sizes: m (rows, cols), q of rank r.
struct LowrankDims {
  int64_t rows, cols, r;
};
// m (rows, cols), q (cols, r) or (rows, r) when transposed, out of (rows or cols) * r; all f32.
LowrankDims check_lowrank_project(const Tensor& m, const Tensor& q, const Tensor& out, bool transpose);
// p (rows, r) f32: returns {rows, r}.
struct PanelDims {
  int64_t rows, r;
};
PanelDims check_orthonormalize_columns(const Tensor& p);
// p (rows, r), q (cols, r), out of rows * cols; all f32.
LowrankDims check_lowrank_expand(const Tensor& p, const Tensor& q, const Tensor& out);

}  // namespace loom::checks
