// Operand validation of the model-parallel ops and the per-head RMSNorm (contracts in backend.h),
// shared by the CPU backend (cpu/cpu_parallel_ops.cpp, cpu/cpu_backend.cpp) and the CUDA backend
// (cuda/cuda_parallel_ops.cpp), so a bad call fails with the same one-line message naming the op
// and the operand on either. Each function checks one op's operands and returns the sizes the op
// needs; a check only one backend has (the CPU's scratch size, the CUDA kernels' head_dim limit)
// stays in that backend, after the shared call.
#pragma once
#include <cstdint>

#include "loom/backend/backend.h"
#include "loom/backend/checks.h"

namespace loom::checks {

// ---- The vocabulary-parallel ends (nn/vocab_parallel.h)

// n tokens of C columns.
struct VocabTokenDims {
  int64_t n, C;
};
// tokens (N) i32, weight (Vs >= valid, C) f32, out (N, C) f32.
VocabTokenDims check_vocab_embedding_forward(const Tensor& tokens, const Tensor& weight, int64_t valid, const Tensor& out);
// tokens (N) i32, dout (N, C) f32, dweight (Vs >= valid, C) f32.
VocabTokenDims check_vocab_embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dweight,
                                         int64_t valid);
// add_positions / positions_backward: activations (B, T, C) f32 and rows first .. first + T - 1
// of positions (Tmax, C) f32. Returns {B, T, C}.
Dims3 check_position_rows(const char* op, const Tensor& activations, const Tensor& positions, int64_t first);
// The vocab_ce_* ops: logits (N, Vs) f32 with valid <= Vs, targets (N) i32, the per-row f32
// operands (N). Each returns N.
int64_t check_vocab_ce_partials(const Tensor& logits, const Tensor& targets, int64_t valid, const Tensor& max,
                                const Tensor& target);
int64_t check_vocab_ce_sums(const Tensor& logits, const Tensor& max, int64_t valid, const Tensor& sums);
int64_t check_vocab_ce_finish(const Tensor& targets, const Tensor& lse, const Tensor& sums, const Tensor& losses);
// dlogits shaped as logits (its numel), f32.
int64_t check_vocab_ce_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t valid,
                                const Tensor& dlogits);

// ---- Ring attention (nn/context_parallel.h)

// q (B, Tl, H hd) of a ring op with an even Tl, H a positive multiple of KV.
struct RingOpDims {
  int64_t B, Tl, H, KV, hd;
};
// q; k, v (B, Tl, KV hd); out as q; m, l (B, H, Tl); all of q's dtype; block's rank and owner in
// [0, world). `scratch` is the backend's own.
RingOpDims check_ring_attention_merge(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& m, const Tensor& l, const RingBlock& block);
// out (B, Tl, H hd); lse, l (B, H, Tl) of out's dtype.
RingOpDims check_ring_attention_finish(const Tensor& out, const Tensor& lse, const Tensor& l, int64_t n_head);
// dout as out (B, Tl, H hd); D (B, H, Tl) of out's dtype.
RingOpDims check_attention_row_dot(const Tensor& dout, const Tensor& out, const Tensor& D, int64_t n_head);
// check_ring_attention_merge's q, k, v and block; dout, dq as q; lse, D (B, H, Tl); dk, dv as k.
RingOpDims check_ring_attention_block_backward(const Tensor& q, const Tensor& dout, const Tensor& lse, const Tensor& D,
                                             const Tensor& k, const Tensor& v, const Tensor& dq, const Tensor& dk,
                                             const Tensor& dv, const RingBlock& block);

// ---- Model-parallel slicing

// src and dst share a dtype; the block (non-negative) lies within both at their row strides.
void check_copy_block(const Tensor& src, const Tensor& dst, const BlockCopy& b);

// ---- Per-head RMSNorm (q/k norm)

// check_head_rows of x; returns x's rows (tokens).
int64_t check_head_rmsnorm_forward(const Tensor& x, const Tensor& weight, int64_t first, int64_t n, int64_t hd,
                                   const Tensor& in, const Tensor& rstd);
// check_head_rows of dx, and dweight shaped and typed as weight; returns dx's rows (tokens).
int64_t check_head_rmsnorm_backward(const Tensor& dx, const Tensor& in, const Tensor& weight, const Tensor& rstd,
                                    int64_t first, int64_t n, int64_t hd, const Tensor& dweight);

}  // namespace loom::checks
