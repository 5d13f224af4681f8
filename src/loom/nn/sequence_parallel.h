// Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
// Transformer Models", 2022, section 4.2.2): inside a tensor-parallel group the residual stream
// and the norms run on sequence shards, rank r holding positions [r T/t, (r+1) T/t) of every
// sequence; the tensor-parallel all-reduce after a row-parallel layer becomes a reduce-scatter
// to the shards, and the input of a column-parallel layer an all-gather of the shards (the
// conjugate pair g = reduce-scatter forward / all-gather backward, f the reverse), at the same
// bytes. The norms' parameter gradients are then partial sums over the group (summed once a step).
//
// Tensors are (B, T, C) with T split: the shards are strided in memory, so the collectives go
// through a (t, B, T/t, C) staging buffer (Backend::copy_block moves the shards in and out of it).
#pragma once
#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/core/tensor.h"

namespace loom {

// full (B, T, C) = the shards (B, T/t, C) of the group, in rank order along T.
void sequence_all_gather(Backend& backend, Communicator& tp, const Tensor& local, const Tensor& full, const Tensor& staging);
// local (B, T/t, C) = this rank's rows of the sum over the group of full (B, T, C).
void sequence_reduce_scatter(Backend& backend, Communicator& tp, const Tensor& full, const Tensor& local, const Tensor& staging);

}  // namespace loom
