// The attention module of a block, one function pair per kind of its plan (nn/plan.h): the
// queries, keys and values (after RoPE) in saved.qkv -> saved.attn, and back from d_attn to
// d_qkv. MLA projects its own q/k/v from the normed input and runs from the block (nn/mla.h).
#pragma once
#include "loom/backend/backend.h"
#include "loom/nn/block.h"
#include "loom/nn/plan.h"

namespace loom {

// cp: the context-parallel group and its buffers (ring and ulysses only).
void attention_forward(Backend& backend, const LayerPlan& plan, const ModelConfig& config, ContextParallel* cp,
                       BlockSaved& s);
void attention_backward(Backend& backend, const LayerPlan& plan, const ModelConfig& config, ContextParallel* cp,
                        const BlockSaved& s, BlockScratch& k);

}  // namespace loom
