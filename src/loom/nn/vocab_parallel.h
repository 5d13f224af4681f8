// The vocabulary-parallel ends of a tensor-parallel model (Megatron-LM, Shoeybi et al. 2019,
// section 3): each rank of the group holds rows [begin, begin + valid) of the embedding / head
// (parallel/tensor_parallel.h), so no rank ever holds full-vocabulary logits.
//   embedding:     out = the rows of the tokens in this rank's range, zero for the others; the
//                  caller all-reduces over the group (the g operator), then adds positions.
//   cross-entropy: from local logits (N, Vs): the row max (all-reduce max), the sum of
//                  exp(logit - max) (all-reduce sum) and the target's logit (all-reduce sum,
//                  from the rank that holds it) give lse = max + log(sum) and
//                  loss = lse - logit[target]: three all-reduces of N floats, never the logits.
//   backward:      d logit_j = scale (exp(logit_j - lse) - [j = target]) on the local columns,
//                  0 on the padding columns; no communication.
// The element loops are Backend ops (backend.h: vocab_embedding_forward ... vocab_ce_backward).
#pragma once
#include <cstdint>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/core/tensor.h"

namespace loom {

// tokens (B,T) i32, weight (Vs, C) f32, out (B,T,C).
void vocab_parallel_embedding_forward(Backend& backend, const Tensor& tokens, const Tensor& weight, int64_t begin,
                                      int64_t valid, const Tensor& out);
// d_weight (Vs, C) += the rows of d_out (B,T,C) for the tokens in range.
void vocab_parallel_embedding_backward(Backend& backend, const Tensor& tokens, const Tensor& d_out,
                                       const Tensor& d_weight, int64_t begin, int64_t valid);
// out (B,T,C) += positions (Tmax, C) rows first..first+T-1 (a sequence shard starts at first);
// d_positions (those rows) += the sum over the batch of d_out.
void add_positions(Backend& backend, const Tensor& out, const Tensor& positions, int64_t first = 0);
void positions_backward(Backend& backend, const Tensor& d_out, const Tensor& d_positions, int64_t first = 0);

// logits (N, Vs), targets (N) i32 (global token ids); losses, lse, sums (N; sums is scratch).
void vocab_parallel_cross_entropy_forward(Backend& backend, Communicator& tp, const Tensor& logits,
                                          const Tensor& targets, int64_t begin, int64_t valid, const Tensor& losses,
                                          const Tensor& lse, const Tensor& sums);
// In place when d_logits == logits.
void vocab_parallel_cross_entropy_backward(Backend& backend, const Tensor& logits, const Tensor& targets,
                                           const Tensor& lse, int64_t begin, int64_t valid, float scale,
                                           const Tensor& d_logits);

}  // namespace loom
