// The CPU kernels of the gradient compression ops (Backend::topk_extract ... lowrank_expand; the
// contracts are in backend.h). Each validates its operands (f32 values, i32 indices and codes)
// and runs sequentially: the reductions follow the index order the contracts state.
#pragma once
#include "loom/backend/backend.h"

namespace loom::cpu {

void topk_extract(const Tensor& acc, const Tensor& idx, const Tensor& val, const Tensor& scratch);
void scatter_add(const Tensor& idx, const Tensor& val, const Tensor& out);
void scatter_zero(const Tensor& idx, const Tensor& x);
void dgc_accumulate(const Tensor& g, const Tensor& u, const Tensor& v, float momentum, double clip);
void onebit_encode(const Tensor& acc, const Tensor& words, const Tensor& scale);
void onebit_decode_add(const Tensor& words, const Tensor& scales, const Tensor& out);
void qsgd_encode(const Tensor& g, const Tensor& codes, const Tensor& norm, const QsgdSpec& spec);
void qsgd_decode_add(const Tensor& codes, const Tensor& norms, int levels, const Tensor& out);
void lowrank_project(const Tensor& m, const Tensor& q, const Tensor& out, bool transpose);
void orthonormalize_columns(const Tensor& p);
void lowrank_expand(const Tensor& p, const Tensor& q, const Tensor& out, float alpha, float beta);

}  // namespace loom::cpu
