// The CPU kernels of the mixture-of-experts and latent-attention ops (Backend::moe_route ...
// mla_attend_latents; the contracts are in backend.h): the element loops of nn/moe.cpp and
// nn/mla.cpp. Each validates its operands; the OpenMP schedules fix every summation order, so
// results do not depend on the thread count.
#pragma once
#include "loom/backend/backend.h"

namespace loom::cpu {

void moe_route(const Tensor& logits, const Tensor& bias, const Tensor& scores, const Tensor& expert,
               const Tensor& gates, const Tensor& scratch, const MoeRouting& routing);
void moe_assign(const Tensor& expert, int64_t capacity, const Tensor& row, const Tensor& token, const Tensor& counts);
void moe_dispatch(const Tensor& x, const Tensor& token, const Tensor& rows);
void moe_combine(const Tensor& rows, const Tensor& row, const Tensor& gates, const Tensor& out);
void moe_combine_backward(const Tensor& dout, const Tensor& row, const Tensor& gates, const Tensor& drows);
void moe_balance_stats(const Tensor& logits, const Tensor& scores, const Tensor& expert, const Tensor& counts,
                       const Tensor& stats, const Tensor& scratch, const MoeRouting& routing);
void moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& expert, const Tensor& row,
                         const Tensor& ye, const Tensor& dy, const Tensor& counts, const Tensor& dlogits,
                         const Tensor& scratch, const MoeRouting& routing);

void mla_rope(const Tensor& x, int64_t heads, int64_t stride, int64_t offset, int64_t rope_dim, const RopeSpec& rope,
              int64_t pos_offset, bool inverse);
void mla_attention_forward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs, const Tensor& out,
                           const MlaDims& dims);
void mla_attention_backward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs,
                            const Tensor& dout, const Tensor& dq, const Tensor& dkv, const Tensor& dkr,
                            const Tensor& dp_row, const MlaDims& dims);
void mla_attend_latents(const Tensor& q, const Tensor& latents, const Tensor& kv_b, const Tensor& out,
                        const MlaDims& dims);

}  // namespace loom::cpu
