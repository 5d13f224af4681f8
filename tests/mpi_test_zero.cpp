// ZeRO-2 and ZeRO-3 under mpirun: the single-process loss curve of the same global batch, the
// ZeRO paper's model-state bytes per rank (measured: resident pages of the parameter and
// gradient buffers, the optimizer's allocation), and ZeRO-3's 1.5x communication volume.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "loom/comm/communicator.h"
#include "mpi_fixture.h"
#include "loom/core/pages.h"
#include "loom/arch/param_layout.h"
#include "loom/memory/estimate.h"
#include "loom/parallel/zero.h"
#include "loom/train/trainer.h"

namespace loom {
namespace {

struct RunResult {
  std::vector<double> losses;
  std::vector<float> params;  // gathered whole at the end
  int64_t resident_params = 0, resident_grads = 0, optimizer_bytes = 0;  // after the last step
  ByteLedger ledger;
};

// A model of about 0.5M parameters (2 MiB of fp32), so that page granularity (4 KiB at each
// shard edge) is small next to a shard.
ModelConfig zero_model(bool large) {
  ModelConfig c = model_preset("gpt2-tiny");
  if (large) c.vocab_size = 512, c.d_model = 96, c.d_ff = 384, c.n_layer = 3, c.n_head = 4, c.n_kv_head = 4;
  return c;
}

RunResult run(Communicator* comm, int64_t batch, int steps, int64_t zero, int64_t accum, bool large,
              const char* optimizer = "adamw", const ModelConfig* model_config = nullptr) {
  const ModelConfig config = model_config != nullptr ? *model_config : zero_model(large);
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(7);
  TrainConfig tc;
  tc.batch_size = batch, tc.seq_len = 16, tc.grad_accum = accum, tc.steps = steps, tc.schedule.warmup = 3;
  tc.schedule.max_lr = 1e-2;
  tc.optim.name = optimizer;
  DdpConfig ddp;
  ddp.bucket_bytes = 16 << 10;
  ddp.zero_stage = zero;
  Trainer trainer(*backend, model, tc, comm, ddp);
  RankData data(backend->allocator(), config, comm ? comm->rank() : 0, comm ? comm->size() : 1, batch);
  if (comm != nullptr) comm->reset_ledger();
  RunResult r;
  for (int s = 0; s < steps; ++s) r.losses.push_back(trainer.train_step(data.source()).loss);
  if (comm != nullptr) r.ledger = comm->ledger();
  r.resident_params = resident_bytes(model.params());
  r.resident_grads = resident_bytes(model.grads());
  r.optimizer_bytes = static_cast<int64_t>(backend->allocator().tracker().current(MEM_OPTIMIZER_STATE));
  trainer.gather_params();
  const float* p = model.params().data<float>();
  r.params.assign(p, p + model.params().numel());
  return r;
}

void expect_same_curve(const RunResult& a, const RunResult& ref, const char* what) {
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    EXPECT_LT(std::abs(a.losses[s] - ref.losses[s]) / std::abs(ref.losses[s]), 1e-5)
        << what << " step " << s << ": " << a.losses[s] << " vs " << ref.losses[s];
  }
}

TEST(MpiZero, Stages2And3ReproduceTheSingleProcessLossCurve) {
  auto comm = make_mpi_communicator();
  const int n = comm->size();
  const RunResult ref = run(nullptr, 2 * n, 20, 0, 2, false);
  for (int64_t stage : {2, 3}) {
    const RunResult z = run(comm.get(), 2, 20, stage, 2, false);
    expect_same_curve(z, ref, stage == 2 ? "zero-2" : "zero-3");
    double worst = 0.0;
    for (size_t s = 0; s < ref.losses.size(); ++s) {
      worst = std::max(worst, std::abs(z.losses[s] - ref.losses[s]) / std::abs(ref.losses[s]));
    }
    // Every rank ends with the same whole parameters.
    auto backend = make_cpu_backend();
    Tensor first = Tensor::empty(backend->allocator(), {static_cast<int64_t>(z.params.size())}, DTYPE_F32, MEM_WORKSPACE);
    std::copy(z.params.begin(), z.params.end(), first.data<float>());
    comm->broadcast(first, 0);
    for (size_t i = 0; i < z.params.size(); ++i) ASSERT_EQ(first.data<float>()[i], z.params[i]) << i;
    if (comm->rank() == 0) std::printf("zero-%lld np=%d: 20 steps, worst loss rel diff %.2e\n", static_cast<long long>(stage), n, worst);
  }
}

// LoRA (peft.method = lora) under plain DDP and ZeRO-1: the single-process curve (1e-5 relative),
// the base weights unchanged bit for bit, the adapters within 1e-5 of their largest element
// after 6 steps of momentum SGD (linear in the gradient, so the reduction order's rounding
// stays rounding; Adam's per-element normalisation magnifies it where a gradient is near 0),
// the optimizer's state (4 bytes per parameter) only for this rank's part of the adapters, and
// DDP's wire bytes those of the adapters' gradients alone (the frozen base has no bucket).
// ZeRO-2/3 shard the whole buffer, the frozen base too (stage 3 its parameters): a rank's
// optimizer state is the adapters inside its shard, and its resident gradient bytes no more than
// those plus the pages at the edges (of the shard, of the adapters, of the buffer); the adapters' gradients are reduce-scattered once per
// micro-batch, after the whole backward.
TEST(MpiZero, LoraReproducesTheSingleProcessCurveAndSendsOnlyAdapterGradients) {
  auto comm = make_mpi_communicator();
  const int n = comm->size();
  ModelConfig config = zero_model(true);
  config.peft_method = PeftMethod::lora, config.lora_rank = 4, config.lora_alpha = 8.0f;
  config.lora_targets = "q,k,v,o,up,down";
  const ParamLayout layout = build_param_layout(config);
  const int64_t base = lora_begin(config, layout), adapters = layout.total - base;
  const RunResult ref = run(nullptr, 2 * n, 6, 0, 1, true, "momentum", &config);
  const RunResult ref2 = run(nullptr, 2 * n, 6, 0, 2, true, "momentum", &config);  // 2 micro-batches a step
  for (int64_t stage = 0; stage <= 3; ++stage) {
    const RunResult r = run(comm.get(), 2, 6, stage, stage >= 2 ? 2 : 1, true, "momentum", &config);
    const RunResult& want = stage >= 2 ? ref2 : ref;
    expect_same_curve(r, want, "lora");
    for (int64_t i = 0; i < base; ++i) ASSERT_EQ(r.params[static_cast<size_t>(i)], want.params[static_cast<size_t>(i)]) << i;
    double worst = 0.0, scale = 0.0;
    for (int64_t i = base; i < layout.total; ++i) {
      const auto k = static_cast<size_t>(i);
      worst = std::max(worst, static_cast<double>(std::abs(r.params[k] - want.params[k])));
      scale = std::max(scale, static_cast<double>(std::abs(want.params[k])));
    }
    worst /= scale;
    EXPECT_LT(worst, 1e-5) << "stage " << stage;
    // Stage 1 shards the adapters; stages 2 and 3 the whole buffer, of which this rank trains
    // the adapters inside its shard.
    const ShardRange whole = shard_range(layout.total, comm->rank(), n);
    const int64_t mine = stage >= 2 ? std::max<int64_t>(0, whole.end - std::max(whole.begin, base))
                                    : shard_range(adapters, comm->rank(), n).end - shard_range(adapters, comm->rank(), n).begin;
    EXPECT_EQ(r.optimizer_bytes, 4 * (stage >= 1 ? mine : adapters)) << "stage " << stage;
    if (stage <= 1) {  // every rank's adapters' gradients, nothing of the frozen base's
      EXPECT_LE(r.resident_grads, 4 * adapters + 2 * 4096) << "stage " << stage;
    } else {
      // A page at each edge: the shard's two, the adapters' start, the buffer's end.
      EXPECT_LE(r.resident_grads, 4 * mine + 4 * 4096) << "stage " << stage;
      if (stage == 3) {
        EXPECT_LE(r.resident_params, 4 * (whole.end - whole.begin) + 4 * 4096);
      }
      // loom memory's estimate: the rank holding the most adapters (memory/estimate.cpp).
      int64_t most = 0;
      for (int k = 0; k < n; ++k) {
        const ShardRange z = shard_range(layout.total, k, n);
        most = std::max<int64_t>(most, std::max<int64_t>(0, z.end - std::max(z.begin, base)));
      }
      MemoryPlan plan;
      plan.model = config, plan.batch = 2, plan.seq_len = 16, plan.zero_stage = static_cast<int>(stage), plan.ranks = n;
      plan.optim.name = "momentum";
      const MemoryEstimate est = estimate_memory(plan);
      EXPECT_EQ(est.bytes[MEM_OPTIMIZER_STATE], 4 * most) << "stage " << stage;
      EXPECT_EQ(est.bytes[MEM_GRADIENTS], 4 * most) << "stage " << stage;
      EXPECT_EQ(est.bytes[MEM_PARAMETERS], 4 * (stage == 3 ? shard_range(layout.total, 0, n).shard : layout.total));
    }
    if (stage == 0) {  // all-reduce of the adapters' gradients (+ 16 bytes a step of loss and norm)
      const double wire = static_cast<double>(r.ledger.sent[COLL_ALL_REDUCE]);
      const double formula = 6.0 * 2.0 * (n - 1) / n * 4.0 * static_cast<double>(adapters);
      EXPECT_NEAR(wire, formula, 6.0 * 64.0) << "DDP bytes sent";
    }
    if (comm->rank() == n - 1) {  // (the last rank: under ZeRO-2/3 it holds the adapters)
      std::printf("lora zero-%lld np=%d, rank %d: %lld adapter of %lld parameters, optimizer %lld bytes, resident "
                  "parameters %lld and gradients %lld bytes, worst adapter diff %.2e of the largest\n",
                  static_cast<long long>(stage), n, comm->rank(), static_cast<long long>(adapters),
                  static_cast<long long>(layout.total), static_cast<long long>(r.optimizer_bytes),
                  static_cast<long long>(r.resident_params), static_cast<long long>(r.resident_grads), worst);
    }
  }
}

// Loss masks under data parallelism: a global batch whose rows count different numbers of
// targets (supervised data: the prompts masked), split over the ranks (and into 2 micro-batches
// each), gives the one-process loss curve within 1e-5 and the same weights after 6 steps of
// momentum SGD: the loss is the mean over the step's counted positions on every rank together.
// (MaskedWindows: tests/mpi_fixture.h.)
TEST(MpiZero, LossMasksReproduceTheSingleProcessCurve) {
  auto comm = make_mpi_communicator();
  const int n = comm->size();
  const ModelConfig config = zero_model(false);
  const auto run_masked = [&](Communicator* c, int64_t batch, int64_t accum, int64_t zero) {
    auto backend = make_cpu_backend();
    Transformer model(*backend, config);
    model.init_weights(7);
    TrainConfig tc;
    tc.batch_size = batch, tc.seq_len = 16, tc.grad_accum = accum, tc.steps = 6, tc.schedule.max_lr = 1e-2;
    tc.optim.name = "momentum";
    DdpConfig ddp;
    ddp.zero_stage = zero;
    Trainer trainer(*backend, model, tc, c, ddp);
    RandomWindowSource stream(mpi_test_corpus(5000, static_cast<int32_t>(config.vocab_size)), 11);
    MaskedWindows global(stream, 16);
    std::unique_ptr<RankSliceSource> slice;
    if (c != nullptr) slice = std::make_unique<RankSliceSource>(global, backend->allocator(), c->rank(), n, batch, 16);
    BatchSource& data = slice ? static_cast<BatchSource&>(*slice) : global;
    RunResult r;
    for (int s = 0; s < 6; ++s) r.losses.push_back(trainer.train_step(data).loss);
    trainer.gather_params();
    r.params.assign(model.params().data<float>(), model.params().data<float>() + model.params().numel());
    return r;
  };
  const RunResult ref = run_masked(nullptr, 2 * n, 2, 0);  // 2 micro-batches of the global rows
  for (int64_t zero : {0, 2}) {
    const RunResult r = run_masked(comm.get(), 2, 2, zero);
    expect_same_curve(r, ref, zero == 0 ? "masked ddp" : "masked zero-2");
    double worst = 0.0, scale = 0.0;
    for (size_t i = 0; i < ref.params.size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::abs(r.params[i] - ref.params[i])));
      scale = std::max(scale, static_cast<double>(std::abs(ref.params[i])));
    }
    EXPECT_LT(worst / scale, 1e-5) << "zero " << zero;
    if (comm->rank() == 0) {
      std::printf("loss masks np=%d zero-%lld: 6 steps, losses %.6f .. %.6f, worst weight diff %.2e of the largest\n",
                  n, static_cast<long long>(zero), r.losses.front(), r.losses.back(), worst / scale);
    }
  }
}

// Model-state bytes per rank after a step, fp32 weights and AdamW (K = 8): measured against
// the ZeRO paper's formulas, within whole pages: the partial pages at the shard's two edges
// and at the buffer's two ends stay resident (measured: 1 to 2 pages beyond 4 bytes x shard).
TEST(MpiZero, ModelStateBytesFollowTheZeroFormulas) {
  auto comm = make_mpi_communicator();
  const int n = comm->size(), rank = comm->rank();
  const int64_t P = param_count(zero_model(true));
  const ShardRange own = shard_range(P, rank, n);
  const int64_t mine = own.end - own.begin;
  const int64_t slack = 4 * 4096;  // a partial page at each end of the shard and of the buffer
  RunResult runs[4];
  for (int64_t stage = 0; stage <= 3; ++stage) {
    runs[stage] = run(comm.get(), 1, 2, stage, 1, true);
    const RunResult& r = runs[stage];
    const int64_t params = stage == 3 ? 4 * mine : 4 * P;
    const int64_t grads = stage >= 2 ? 4 * mine : 4 * P;
    const int64_t optim = stage >= 1 ? 8 * mine : 8 * P;
    EXPECT_NEAR(static_cast<double>(r.resident_params), static_cast<double>(params), slack) << "stage " << stage;
    EXPECT_NEAR(static_cast<double>(r.resident_grads), static_cast<double>(grads), slack) << "stage " << stage;
    EXPECT_EQ(r.optimizer_bytes, optim) << "stage " << stage;
    // The paper's totals: 16P, 4P + 4P + 8P/N, 4P + 12P/N, 16P/N (here per rank, its shard).
    const double formula = stage == 0 ? 16.0 * P : stage == 1 ? 8.0 * P + 8.0 * P / n : stage == 2 ? 4.0 * P + 12.0 * P / n : 16.0 * P / n;
    const double measured = static_cast<double>(r.resident_params + r.resident_grads + r.optimizer_bytes);
    EXPECT_NEAR(measured, formula, 2 * slack + 16.0 * n) << "stage " << stage;  // + the last shard's padding
    if (rank == 0) {
      std::printf("zero-%lld np=%d P=%lld: params %lld, grads %lld, optimizer %lld bytes = %.0f (formula %.0f, %.4f)\n",
                  static_cast<long long>(stage), n, static_cast<long long>(P), static_cast<long long>(r.resident_params),
                  static_cast<long long>(r.resident_grads), static_cast<long long>(r.optimizer_bytes), measured, formula,
                  measured / formula);
    }
  }
  // Communication per step (one micro-batch): DDP all-reduces 2(N-1)/N x 4P; ZeRO-3 gathers the
  // parameters twice and reduce-scatters the gradients once, 3 (4P - 4 x own) = 1.5x.
  const double ddp = static_cast<double>(runs[0].ledger.sent[COLL_ALL_REDUCE]);
  const double z3 = static_cast<double>(runs[3].ledger.sent[COLL_ALL_GATHER] + runs[3].ledger.sent[COLL_REDUCE_SCATTER]);
  const double z3_formula = 2.0 * 3.0 * 4.0 * static_cast<double>(P - mine);       // 2 steps
  EXPECT_EQ(z3, z3_formula);
  EXPECT_NEAR(z3 / ddp, 1.5, 1.5 * (16.0 * n / (4.0 * P) + 1e-4));  // loss/norm all-reduces: 16 bytes a step
  const double z2 = static_cast<double>(runs[2].ledger.sent[COLL_ALL_GATHER] + runs[2].ledger.sent[COLL_REDUCE_SCATTER]);
  EXPECT_NEAR(z2 / ddp, 1.0, 1e-3);
  // Other optimizers' K at stage 3: (4 + 4 + K) P / N with K = 0 (SGD) and 4 (Lion's momentum).
  for (const auto& [optimizer, k] : {std::pair<const char*, int64_t>{"sgd", 0}, {"lion", 4}}) {
    const RunResult r = run(comm.get(), 1, 2, 3, 1, true, optimizer);
    EXPECT_EQ(r.optimizer_bytes, k * mine) << optimizer;
    const double measured = static_cast<double>(r.resident_params + r.resident_grads + r.optimizer_bytes);
    EXPECT_NEAR(measured, static_cast<double>((8 + k) * P) / n, 2 * slack + 16.0 * n) << optimizer;
  }
  if (rank == 0) {
    std::printf("bytes sent per rank over 2 steps, np=%d: DDP %.0f, ZeRO-2 %.0f (%.4fx), ZeRO-3 %.0f (%.4fx)\n", n, ddp, z2,
                z2 / ddp, z3, z3 / ddp);
  }
}

}  // namespace
}  // namespace loom
