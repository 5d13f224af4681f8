// Operand validation of the optimizer ops and the soft-target loss (contracts in backend.h),
// shared by the CPU (cpu/cpu_optim_ops.cpp, cpu_optim_factored.cpp, cpu_soft_target.cpp) and CUDA
// (cuda/cuda_optim_ops.cpp, cuda_optim_factored_ops.cpp) backends so that a bad call fails with
// the same one-line message on both. Each function checks one op's operands in the order the op
// always did and returns the sizes the op needs; a check only one backend makes stays in that
// backend, after the call. Unless said otherwise every operand is f32 and an optional state
// operand may be undefined (it is then not checked).
#pragma once
#include <cstdint>

#include "loom/backend/backend.h"

namespace loom::checks {

// The elementwise optimizers: param f32; grad and the state operands f32 of param's numel (the
// required ones defined). Each returns param's numel.
int64_t check_sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf);
int64_t check_adagrad_step(const Tensor& param, const Tensor& grad, const Tensor& sum);
int64_t check_rmsprop_step(const Tensor& param, const Tensor& grad, const Tensor& square, const Tensor& avg,
                           const Tensor& buf);
int64_t check_adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& vmax);
int64_t check_lion_step(const Tensor& param, const Tensor& grad, const Tensor& m);
// Adam-mini: param, grad, m of n elements; v (nblocks) splits them into whole blocks of bn.
struct AdamMiniBlocks {
  int64_t n, nblocks, bn;
};
AdamMiniBlocks check_adam_mini_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v);

// A matrix operand's (rows, cols): rows_of and its last dim.
struct OptimMatrix {
  int64_t rows, cols;
};
// src and dst of one numel: returns src's (rows, cols).
OptimMatrix check_scale_transpose(const Tensor& src, const Tensor& dst);
// y and x of one numel: returns it.
int64_t check_axpy(const Tensor& y, const Tensor& x);
int64_t check_muon_momentum(const Tensor& grad, const Tensor& buf, const Tensor& u);
// u, then x as scale_transpose's dst (the op's second step is scale_transpose, whose messages it
// gives): returns u's numel.
int64_t check_newton_schulz_normalize(const Tensor& u, const Tensor& x);
int64_t check_decayed_update(const Tensor& param, const Tensor& u);

// logits (N, V), teacher and grad of its numel, losses (N), temperature > 0.
struct SoftTargetRows {
  int64_t rows, vocab;
};
SoftTargetRows check_soft_target_loss(const Tensor& logits, const Tensor& teacher, float temperature,
                                      const Tensor& losses, const Tensor& grad);

// The factored optimizers' segment: (rows, cols) of grad when factored, else one row of its
// elements. param, grad (and the optional m, u) of one size; state of rows + cols (factored) or
// of the segment's size (else).
struct FactoredSegment {
  int64_t m, n;
};
FactoredSegment check_adafactor_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m,
                                     const Tensor& u, bool factored);
FactoredSegment check_sm3_step(const Tensor& param, const Tensor& grad, const Tensor& acc, bool factored);
// CAME: m defined, and res (rows + cols) when factored.
FactoredSegment check_came_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m,
                                const Tensor& res, const Tensor& u, bool factored);

// LDAdam. s (n, n) and p (n, r <= n): returns {n, r}.
OptimMatrix check_leading_eigenvectors(const Tensor& s, const Tensor& p);
// y (n, r), fallback and p of its numel: returns {n, r}.
OptimMatrix check_gram_schmidt(const Tensor& y, const Tensor& fallback, const Tensor& p);
// p and prev (M, r); m, v, mt, vt (r, N) of one numel. With r = 0 the (r, N) check is left to the
// caller (N is then 0).
struct LdadamRotateDims {
  int64_t rows, r, cols;
};
LdadamRotateDims check_ldadam_rotate(const Tensor& p, const Tensor& prev, const Tensor& m, const Tensor& v,
                                     const Tensor& mt, const Tensor& vt);
// m, v, mt, vt, gh of one numel: returns it.
int64_t check_ldadam_adam(const Tensor& m, const Tensor& v, const Tensor& mt, const Tensor& vt, const Tensor& gh);
// param, grad, d, e of one numel: returns param's (rows, cols).
OptimMatrix check_ldadam_apply(const Tensor& param, const Tensor& grad, const Tensor& d, const Tensor& e);

}  // namespace loom::checks
