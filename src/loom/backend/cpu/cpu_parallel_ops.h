// The CPU kernels of the model-parallel ops (Backend::vocab_embedding_forward ...
// ring_attention_block_backward; the contracts are in backend.h): the element loops of the
// vocabulary-parallel ends (nn/vocab_parallel.h) and of ring attention (nn/context_parallel.h).
// Each validates its operands; the OpenMP schedules fix every summation order, so results do
// not depend on the thread count.
#pragma once
#include "loom/backend/backend.h"

namespace loom::cpu {

void vocab_embedding_forward(const Tensor& tokens, const Tensor& weight, int64_t begin, int64_t valid,
                             const Tensor& out);
void vocab_embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dweight, int64_t begin,
                              int64_t valid);
void add_positions(const Tensor& out, const Tensor& positions, int64_t first);
void positions_backward(const Tensor& dout, const Tensor& dpositions, int64_t first);
void vocab_ce_partials(const Tensor& logits, const Tensor& targets, int64_t begin, int64_t valid, const Tensor& max,
                       const Tensor& target);
void vocab_ce_sums(const Tensor& logits, const Tensor& max, int64_t valid, const Tensor& sums);
void vocab_ce_finish(const Tensor& targets, const Tensor& lse, const Tensor& sums, const Tensor& losses);
void vocab_ce_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t begin, int64_t valid,
                       float scale, const Tensor& dlogits);
void ring_attention_merge(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& m,
                          const Tensor& l, const Tensor& scratch, const RingBlock& block);
void ring_attention_finish(const Tensor& out, const Tensor& lse, const Tensor& l, int64_t n_head);
void attention_row_dot(const Tensor& dout, const Tensor& out, const Tensor& D, int64_t n_head);
void ring_attention_block_backward(const Tensor& q, const Tensor& dout, const Tensor& lse, const Tensor& D,
                                   const Tensor& k, const Tensor& v, const Tensor& dq, const Tensor& dk,
                                   const Tensor& dv, const RingBlock& block);
// Model-parallel slicing: a strided 2-D block copy (exact).
void copy_block(const Tensor& src, const Tensor& dst, const BlockCopy& block);

}  // namespace loom::cpu
