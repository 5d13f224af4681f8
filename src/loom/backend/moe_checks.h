// Operand validation of the mixture-of-experts and multi-head latent attention ops (backend.h:
// moe_route ... moe_router_backward, mla_rope ... mla_attend_latents), shared by the CPU and CUDA
// backends so a bad call fails with the same one-line message on both. Each function checks one
// op's operands (dtypes, numels, shapes, routing and dimension ranges) and returns the sizes the
// op needs; what one backend checks alone (the CPU's scratch sizes, the CUDA kernels' 32-bit
// index limits, data-dependent index ranges) stays in that backend, after the shared call.
#pragma once
#include <cstdint>

#include "loom/backend/backend.h"

namespace loom::checks {

// ---- Mixture of experts (cpu/cpu_moe_ops.cpp, cuda/cuda_moe_ops.cpp).

// moe_route: logits (N, E), bias (E), scores (N, E), expert and gates (N, k), scratch f32 (its
// size is the backend's). Returns N.
int64_t check_moe_route(const Tensor& logits, const Tensor& bias, const Tensor& scores, const Tensor& expert,
                        const Tensor& gates, const Tensor& scratch, const MoeRouting& r);

// moe_assign: expert and row (N, k) i32, token i32, counts (3E + 1) i32, capacity >= 0 (the
// token array's length depends on the routing: the backend checks it).
struct MoeAssignDims {
  int64_t N, K, E;
};
MoeAssignDims check_moe_assign(const Tensor& expert, int64_t capacity, const Tensor& row, const Tensor& token,
                               const Tensor& counts);

// moe_dispatch: x (N, C) and rows (R, C) f32, token (R) i32 (its values are the backend's to check).
struct MoeDispatchDims {
  int64_t R, C, N;
};
MoeDispatchDims check_moe_dispatch(const Tensor& x, const Tensor& token, const Tensor& rows);

// moe_combine and its backward: rows / drows (R, C), row (N, k) i32, gates shaped as row (f32;
// optional in the forward, required in the backward), out / dout (N, C).
struct MoeCombineDims {
  int64_t N, C, K;
};
MoeCombineDims check_moe_combine(const Tensor& rows, const Tensor& row, const Tensor& gates, const Tensor& out);
MoeCombineDims check_moe_combine_backward(const Tensor& dout, const Tensor& row, const Tensor& gates,
                                          const Tensor& drows);

// moe_balance_stats: the router's operands, counts (3E + 1) i32, stats (4) f64, scratch f64 (its
// size is the backend's). Returns N, a whole number of sequences.
int64_t check_moe_balance_stats(const Tensor& logits, const Tensor& scores, const Tensor& expert,
                                const Tensor& counts, const Tensor& stats, const Tensor& scratch,
                                const MoeRouting& r);

// moe_router_backward: the router's operands, counts, row (N, k) i32, ye (R, C) and dy (N, C)
// f32, dlogits (N, E) f32, scratch f64 (its size is the backend's). Returns {N, C}.
struct MoeRouterBackwardDims {
  int64_t N, C;
};
MoeRouterBackwardDims check_moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& expert,
                                                const Tensor& row, const Tensor& ye, const Tensor& dy,
                                                const Tensor& counts, const Tensor& dlogits, const Tensor& scratch,
                                                const MoeRouting& r);

// ---- Multi-head latent attention (cpu/cpu_mla_ops.cpp, cuda/cuda_mla_ops.cpp).

// mla_rope: x (B, T, W) f32 holding `heads` slices of an even width dr at offset + h stride.
void check_mla_rope(const Tensor& x, int64_t heads, int64_t stride, int64_t offset, int64_t dr, int64_t pos_offset);

// One attention call's dimensions: qk = dn + dr, kvw = dn + dv.
struct MlaAttentionDims {
  int64_t B, T, H, dn, dr, dv, qk, kvw, window;
};
// mla_attention_forward: q (B,T,H qk), kr (B,T,d_r), kv (B,T,H (d_n + d_v)), probs (B,H,T,T),
// out (B,T,H d_v), all f32.
MlaAttentionDims check_mla_attention_forward(const Tensor& q, const Tensor& kr, const Tensor& kv,
                                             const Tensor& probs, const Tensor& out, const MlaDims& m);
// mla_attention_backward: the forward's operands with dout for out, dq / dkv / dkr shaped as q /
// kv / kr, dp_row f32 of at least T floats.
MlaAttentionDims check_mla_attention_backward(const Tensor& q, const Tensor& kr, const Tensor& kv,
                                              const Tensor& probs, const Tensor& dout, const Tensor& dq,
                                              const Tensor& dkv, const Tensor& dkr, const Tensor& dp_row,
                                              const MlaDims& m);

// mla_attend_latents: q (H qk), latents (count >= 1, d_c + d_r), kv_b (H (d_n + d_v), d_c),
// out (H d_v), all f32.
struct MlaLatentDims {
  int64_t H, dn, dr, dv, dc, qk, kvw, lw, count;
};
MlaLatentDims check_mla_attend_latents(const Tensor& q, const Tensor& latents, const Tensor& kv_b, const Tensor& out,
                                       const MlaDims& m);

}  // namespace loom::checks
