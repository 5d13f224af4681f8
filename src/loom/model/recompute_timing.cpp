#include "loom/model/recompute_timing.h"

#include <algorithm>
#include <chrono>
#include <limits>

#include "loom/model/init.h"

namespace loom {

std::vector<std::array<double, RECOMPUTE_COUNT>> measure_recompute_seconds(Backend& backend, const ModelConfig& config,
                                                                            std::vector<Block>& blocks,
                                                                            const LayerPlan& record_plan, int64_t batch,
                                                                            int64_t seq_len, int repeats) {
  Allocator& alloc = backend.allocator();
  const int64_t C = config.d_model;
  // A scratch record (workspace, freed on return) with a deterministic input in the range of a
  // residual stream; its other fields come from the first forward.
  const SavedShape shape{.batch = batch, .seq_len = seq_len, .category = MEM_WORKSPACE};
  BlockSaved kept = allocate_block_saved(alloc, config, record_plan, shape);
  BlockSaved full = allocate_block_saved(alloc, config, record_plan, shape);
  const Tensor out = Tensor::empty(alloc, {batch * seq_len * std::max(C, config.n_head * config.head_dim())},
                                   DTYPE_F32, MEM_WORKSPACE);
  fill_normal(backend, kept.input, 1, 0, 1.0f);
  std::vector<std::array<double, RECOMPUTE_COUNT>> seconds(static_cast<size_t>(config.n_layer));
  for (int64_t l = 0; l < config.n_layer; ++l) {
    Block& b = blocks[static_cast<size_t>(l)];
    seconds[l][RECOMPUTE_NONE] = 0.0;
    if (b.is_moe()) {  // (MoE blocks always keep everything)
      seconds[l][RECOMPUTE_SELECTIVE] = seconds[l][RECOMPUTE_FULL] = std::numeric_limits<double>::infinity();
      continue;
    }
    b.set_recording(false);
    b.forward(backend, kept, out.view(0, kept.input.shape()));
    for (const RecomputePolicy p : {RECOMPUTE_SELECTIVE, RECOMPUTE_FULL}) {
      double fastest = std::numeric_limits<double>::infinity();
      for (int r = 0; r < repeats; ++r) {
        BlockSaved f = full;
        const auto start = std::chrono::steady_clock::now();
        b.recompute(backend, kept, p, f, out);
        fastest = std::min(fastest, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      seconds[l][p] = fastest;
    }
    b.set_recording(true);
  }
  return seconds;
}

}  // namespace loom
