// The measured cost of activation checkpointing (memory/recompute.h's budget plan,
// Transformer::measure_recompute_seconds): each block's recomputation timed on a scratch record.
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include "loom/arch/config.h"
#include "loom/backend/backend.h"
#include "loom/nn/block.h"

namespace loom {

// Seconds of recomputing each of `blocks` under each policy for a (batch, seq_len) micro-batch:
// the fastest of `repeats` runs on scratch records of record_plan (workspace, freed on return);
// none: 0; MoE blocks (which always keep everything): infinity.
std::vector<std::array<double, RECOMPUTE_COUNT>> measure_recompute_seconds(Backend& backend, const ModelConfig& config,
                                                                            std::vector<Block>& blocks,
                                                                            const LayerPlan& record_plan, int64_t batch,
                                                                            int64_t seq_len, int repeats);

}  // namespace loom
