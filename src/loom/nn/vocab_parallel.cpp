// The vocabulary-parallel ends: the element loops are Backend ops (vocab_embedding_forward ...
// vocab_ce_backward); this file adds the all-reduces of the cross-entropy between them.
#include "loom/nn/vocab_parallel.h"

namespace loom {

void vocab_parallel_embedding_forward(Backend& backend, const Tensor& tokens, const Tensor& weight, int64_t begin,
                                      int64_t valid, const Tensor& out) {
  backend.vocab_embedding_forward(tokens, weight, begin, valid, out);
}

void vocab_parallel_embedding_backward(Backend& backend, const Tensor& tokens, const Tensor& d_out,
                                       const Tensor& d_weight, int64_t begin, int64_t valid) {
  backend.vocab_embedding_backward(tokens, d_out, d_weight, begin, valid);
}

void add_positions(Backend& backend, const Tensor& out, const Tensor& positions, int64_t first) {
  backend.add_positions(out, positions, first);
}

void positions_backward(Backend& backend, const Tensor& d_out, const Tensor& d_positions, int64_t first) {
  backend.positions_backward(d_out, d_positions, first);
}

void vocab_parallel_cross_entropy_forward(Backend& backend, Communicator& tp, const Tensor& logits,
                                          const Tensor& targets, int64_t begin, int64_t valid, const Tensor& losses,
                                          const Tensor& lse, const Tensor& sums) {
  // lse holds the row max and losses the target's logit until vocab_ce_finish.
  backend.vocab_ce_partials(logits, targets, begin, valid, lse, losses);
  tp.all_reduce(lse, REDUCE_MAX);
  tp.all_reduce(losses, REDUCE_SUM);  // exactly one rank holds each target
  backend.vocab_ce_sums(logits, lse, valid, sums);
  tp.all_reduce(sums, REDUCE_SUM);
  backend.vocab_ce_finish(targets, lse, sums, losses);
}

void vocab_parallel_cross_entropy_backward(Backend& backend, const Tensor& logits, const Tensor& targets,
                                           const Tensor& lse, int64_t begin, int64_t valid, float scale,
                                           const Tensor& d_logits) {
  backend.vocab_ce_backward(logits, targets, lse, begin, valid, scale, d_logits);
}

}  // namespace loom
