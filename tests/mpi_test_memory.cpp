// loom memory's estimate (memory/estimate.h) against what real ranks of each model-parallel
// layout allocate: the activation stores and the optimizer state, to the byte, on every rank
// (np 2: tp + sequence parallel, pp with 1F1B / ZB-H1, cp ring / Ulysses, ep; np 4 also with
// data parallelism and ZeRO-1, and interleaved pp).
#include <gtest/gtest.h>

#include <cstdio>

#include "loom/memory/estimate.h"
#include "mpi_layout.h"

namespace loom {
namespace {

// Builds the layout on the world, runs one step and compares this rank's bytes with the estimate
// for its pipeline rank.
void check(Communicator& world, const RunLayout& lay) {
  LayoutRun run(world, lay);
  run.trainer->train_step(*run.data);
  const TrainConfig& tc = run.tc;
  MemoryPlan plan;
  plan.model = run.config, plan.batch = kLayoutBatch, plan.seq_len = kLayoutSeq, plan.optim = tc.optim;
  plan.zero_stage = lay.zero, plan.ranks = lay.dp * lay.ep;
  plan.tp = lay.tp, plan.sequence_parallel = lay.sp;
  plan.pp = lay.pp, plan.schedule = parse_enum<PipeScheduleKind>(lay.schedule, "schedule"), plan.micro = tc.grad_accum, plan.virtual_stages = lay.virtual_stages;
  plan.cp = lay.cp, plan.ulysses = lay.ulysses, plan.ep = lay.ep;
  const MemoryEstimate est = estimate_memory(plan, run.pp->rank());
  const MemoryTracker& mem = run.backend->allocator().tracker();
  EXPECT_EQ(static_cast<int64_t>(mem.current(MEM_ACTIVATIONS)), est.bytes[MEM_ACTIVATIONS]) << lay.name() << " rank "
                                                                                            << world.rank();
  // ZeRO: the estimate is rank 0's shard, the largest; the other ranks hold at most as much.
  const int64_t state = static_cast<int64_t>(mem.current(MEM_OPTIMIZER_STATE));
  if (lay.zero > 0 && run.reduce->rank() != 0) {
    EXPECT_LE(state, est.bytes[MEM_OPTIMIZER_STATE]) << lay.name() << " rank " << world.rank();
  } else {
    EXPECT_EQ(state, est.bytes[MEM_OPTIMIZER_STATE]) << lay.name() << " rank " << world.rank();
  }
  if (world.rank() == 0) {
    std::printf("%-52s rank 0: activations %8lld B, optimizer state %8lld B (estimated %lld, %lld)\n", lay.name().c_str(),
                static_cast<long long>(mem.current(MEM_ACTIVATIONS)), static_cast<long long>(state),
                static_cast<long long>(est.bytes[MEM_ACTIVATIONS]), static_cast<long long>(est.bytes[MEM_OPTIMIZER_STATE]));
  }
}

TEST(MpiMemoryEstimate, ModelParallelLayoutsMatchTheirAllocationsToTheByte) {
  auto world = make_mpi_communicator();
  const int n = world->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "runs under np 2 and 4";
  for (const RunLayout& lay : model_parallel_layouts(n)) check(*world, lay);
}

}  // namespace
}  // namespace loom
