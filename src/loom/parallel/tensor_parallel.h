// Tensor parallelism (Shoeybi et al., "Megatron-LM", 2019): each of the tp ranks of a group
// holds a slice of every block's weights and of the vocabulary:
//   attention   split by heads: rank r holds query heads [r H/tp, (r+1) H/tp) and kv heads
//               [r KV/tp, (r+1) KV/tp) (GQA-aware: KV % tp == 0), i.e. the rows of those heads
//               in the fused QKV weight (column-parallel) and the matching columns of the
//               output projection (row-parallel);
//   MLP         split by the hidden dimension: rows [r F/tp, (r+1) F/tp) of the first weight
//               (for SwiGLU of both its gate and up halves) and those columns of the second;
//   vocabulary  rows [r Vs, min(V, (r+1) Vs)) of the embedding / head with Vs = ceil(V / tp)
//               (the last slice padded with rows no token uses, masked out of the softmax);
//   the rest    (norms, position embeddings, the row-parallel layers' biases) replicated.
// A rank's slice is itself a model config: the same d_model and head width with H/tp heads,
// KV/tp kv heads, F/tp hidden and Vs vocabulary rows, so the block and the flat buffers work
// unchanged; the conjugate operators f (identity forward, all-reduce backward) and g
// (all-reduce forward, identity backward) sit in the block's sub-layers (nn/attention.cpp,
// nn/mlp.cpp, nn/layer.cpp) and model/transformer.cpp.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/tensor.h"
#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"

namespace loom {

// The model config of one rank's slice; throws naming parallel.tp when heads, kv heads or the
// MLP width do not divide.
ModelConfig tp_local_config(const ModelConfig& global, int tp);

struct VocabRange {
  int64_t begin = 0;  // first token id of this rank's rows
  int64_t valid = 0;  // rows that are real tokens (the rest pad the last slice)
};
VocabRange tp_vocab_range(const ModelConfig& global, int rank, int tp);

// Copies between a whole model's flat per-parameter buffer (parameters, gradients or an
// element-wise optimizer state, in the global layout) and rank's slice (local layout).
// to_local: global -> local (padding rows zeroed). Otherwise local -> global: writes rank's
// slice into its positions of `global`, the replicated parameters only when write_replicated
// (so that summing every rank's contribution over the group gives the whole buffer once).
// Both buffers are `backend`'s memory: the slices move with Backend::copy and copy_block.
void tp_copy(Backend& backend, const ModelConfig& global_config, const Tensor& global, const ModelConfig& local_config, const Tensor& local,
             int rank, int tp, bool to_local, bool write_replicated = true);

// A slice's flat ranges of replicated parameters ([begin, end) pairs, in order), from its
// local config: their gradients are equal on every rank of the group (counted once in a norm).
std::vector<std::pair<int64_t, int64_t>> tp_replicated_ranges(const ModelConfig& local_config);

}  // namespace loom
