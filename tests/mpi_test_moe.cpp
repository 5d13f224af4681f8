// Expert parallelism under mpirun: an MoE model (Llama blocks, 4 experts, top-2, a shared
// expert, a dense first layer; the sequence-wise balance loss, z-loss and the auxiliary-loss-free
// bias, dropless) trained with ep = 2 (np 2: dp = 2), ep = 4 (np 4), ep = 2 inside dp = 4,
// tp = 2 x dp = 2 with ep = 2, and pp = 2 x dp = 2 with ep = 2 reproduces the single-process losses (fp32, 10 steps, 1e-5
// relative) and, under SGD, every gradient. (The Switch loss is left out: its f_i P_i product is
// over each rank's own tokens, so data parallelism itself changes it, with or without ep.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/comm/device_mesh.h"
#include "loom/core/pages.h"
#include "loom/parallel/pipeline.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/train/trainer.h"
#include "mpi_fixture.h"

namespace loom {
namespace {

constexpr int kSteps = 10;


ModelConfig moe_model() {
  ModelConfig c = model_preset("moe-tiny");
  c.moe_seq_aux_alpha = 1e-2f, c.moe_z_alpha = 1e-3f, c.moe_bias_gamma = 1e-2f;
  return c;
}

TrainConfig train_config(int64_t batch, const char* optimizer) {
  TrainConfig tc;
  tc.batch_size = batch, tc.seq_len = 16, tc.grad_accum = 2, tc.steps = kSteps, tc.schedule.warmup = 3;
  tc.schedule.max_lr = 1e-2;
  tc.optim.name = optimizer;
  return tc;
}

struct Layout {
  int dp = 2, ep = 2, tp = 1, pp = 1;
  int zero = 0;  // ZeRO stage (with ep > 1 refused: the dp ranks hold different experts)
};

Curve expert_parallel(Communicator& world, const ModelConfig& config, const Layout& lay, int64_t batch,
                      const char* optimizer, int64_t* a2a_bytes) {
  const DeviceMesh mesh(world.size(), {{"pp", lay.pp}, {"dp", lay.dp / lay.ep}, {"ep", lay.ep}, {"cp", 1}, {"tp", lay.tp}});
  auto pp = mesh_group(world, mesh, "pp");
  auto dp = mesh_group(world, mesh, std::vector<std::string>{"dp", "ep"});  // the data-parallel ranks
  auto ep = mesh_group(world, mesh, "ep");
  auto tp = mesh_group(world, mesh, "tp");
  auto backend = make_cpu_backend();
  SlicedModel sliced(*backend, config, *tp);
  Transformer& model = sliced.model;
  model.set_expert_parallel(ep.get());
  std::unique_ptr<PipelineRunner> runner;
  if (lay.pp > 1) runner = std::make_unique<PipelineRunner>(model, *pp, make_pipe_schedule("1f1b", lay.pp, 2), batch, 16);
  DdpConfig ddp;
  ddp.zero_stage = lay.zero;
  Trainer trainer(*backend, model, train_config(batch, optimizer), dp.get(), ddp, runner.get());
  // The optimizer holds state for this rank's experts only (and, with ZeRO-1, its shard of that).
  int64_t domain = 0;
  for (const Range& r : trainer.domain()) domain += r.end - r.begin;
  const ParamLayout& layout = model.layout();
  int64_t experts = 0;
  for (const ParamSpec& p : layout.params) experts += p.name.find(".mlp.experts.") != std::string::npos ? p.numel : 0;
  int64_t buffers = 0;
  for (const ParamSpec& p : layout.params) buffers += p.role == ROLE_BUFFER ? p.numel : 0;
  if (lay.pp == 1) {
    EXPECT_EQ(domain, layout.total - experts + experts / lay.ep);
  }
  if (std::string(optimizer) == "adamw" && lay.zero == 0) {
    EXPECT_EQ(trainer.optimizer().state_bytes(), 8 * domain);  // (the routing bias too, at learning rate 0)
    EXPECT_GT(buffers, 0);
  }
  // Expert weights sharded: the other ranks' experts are not resident (whole pages at their edges may be).
  if (lay.pp == 1 && lay.zero == 0) {
    const int64_t foreign = experts - experts / lay.ep;
    const int64_t resident = resident_bytes(model.params());
    EXPECT_LE(resident, 4 * (layout.total - foreign) + 2 * 4096 * 2 * static_cast<int64_t>(model.foreign_expert_ranges().ranges().size()));
    EXPECT_LT(resident, 4 * layout.total);
  }
  RankData rows(backend->allocator(), config, dp->rank(), dp->size(), batch);
  Curve c;
  for (int s = 0; s < kSteps; ++s) {
    ep->reset_ledger();
    const StepStats st = trainer.train_step(rows.source());
    if (s == 0) *a2a_bytes = ep->ledger().sent[COLL_ALL_TO_ALL];
    // The all-to-all bytes, summed over the ranks, are exactly the routed rows that leave their
    // rank: 4 one-way trips (dispatch, combine, and both again in backward) of C floats each,
    // plus each forward's exchange of per-expert row counts (E/P int32 to each other rank).
    // Summed over the data-parallel ranks (every ep group), as the routing statistics are.
    const Tensor sent = Tensor::empty(backend->allocator(), {1}, DTYPE_F64, MEM_WORKSPACE);
    sent.data<double>()[0] = static_cast<double>(ep->ledger().sent[COLL_ALL_TO_ALL]);
    dp->all_reduce(sent);
    int64_t moved = 0, calls = 0;
    for (const MoeLayerStats& m : model.moe_stats()) moved += m.dispatched, calls += 2;  // 2 micro-batches
    const int64_t counts = lay.dp * calls * (lay.ep - 1) * (config.moe_experts / lay.ep) * 4;
    EXPECT_EQ(static_cast<int64_t>(sent.data<double>()[0]), 4 * moved * config.d_model * 4 + counts) << "step " << s;
    c.losses.push_back(st.loss);
    c.norms.push_back(st.grad_norm);
    // Every rank holds all its stage's gradients after the data-parallel all-reduce (experts too).
    if (lay.zero >= 2) continue;  // (gradients sharded)
    c.grads.push_back(sliced.whole_grads(*backend, runner ? runner->norm_ranges() : RangeSet{}, *tp, *pp));
  }
  return c;
}

void check(Communicator& world, const Layout& lay) {
  const ModelConfig config = moe_model();
  const int64_t batch = 2;
  for (const char* optimizer : {"sgd", "adamw"}) {
    const Curve ref = train_single(config, train_config(batch * lay.dp, optimizer), kSteps);
    int64_t bytes = 0;
    const Curve got = expert_parallel(world, config, lay, batch, optimizer, &bytes);
    double worst_loss = 0, worst_grad = 0;
    for (int s = 0; s < kSteps; ++s) {
      const double rel = std::abs(got.losses[s] - ref.losses[s]) / ref.losses[s];
      worst_loss = std::max(worst_loss, rel);
      EXPECT_LT(rel, 1e-5) << "dp " << lay.dp << " ep " << lay.ep << " tp " << lay.tp << " " << optimizer << " step " << s;
      if (std::string(optimizer) != "sgd" || lay.zero >= 2) continue;
      const double grel = gradient_rel_diff(got.grads[s].data(), ref.grads[s]);
      worst_grad = std::max(worst_grad, grel);
      EXPECT_LT(grel, 1e-5) << "gradient, step " << s;
    }
    if (world.rank() == 0) {
      std::printf("moe-tiny dp=%d (ep=%d) x tp=%d x pp=%d ZeRO-%d, %s: worst loss rel diff %.2e, gradient %.2e; all-to-all bytes "
                  "sent by rank 0 in step 1: %lld\n", lay.dp, lay.ep, lay.tp, lay.pp, lay.zero, optimizer, worst_loss, worst_grad,
                  static_cast<long long>(bytes));
    }
  }
}

TEST(MpiExpertParallel, ReproducesTheSingleProcessRun) {
  auto world = make_mpi_communicator();
  const int n = world->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "runs under np 2 and np 4";
  check(*world, {n, n});  // ep over every rank
  check(*world, {n, 1, 1, 1, 2});  // no ep: ZeRO-2 over dp (the routing bias at learning rate 0)
  if (n == 4) {
    check(*world, {4, 2});        // ep = 2 inside dp = 4
    check(*world, {2, 2, 2});     // tp = 2 x dp = 2, ep = 2
    check(*world, {2, 2, 1, 2});  // pp = 2 x dp = 2, ep = 2 (the MoE layer on the second stage)
  }
}

}  // namespace
}  // namespace loom
