// DDP under mpirun: N ranks with B rows each reproduce a single process with B*N rows of the
// same global batches (computed in the same process as the reference), step by step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "loom/comm/communicator.h"
#include "mpi_fixture.h"
#include "strict_backend.h"
#include "test_util.h"
#include "loom/parallel/ddp.h"
#include "loom/parallel/zero.h"
#include "loom/train/trainer.h"

namespace loom {
namespace {

std::vector<double> run(Communicator* comm, int64_t batch, int steps, std::vector<double>* params, int64_t zero = 0,
                        int64_t* state_bytes = nullptr, double topk = 0.0, const char* compression = "topk",
                        const char* optimizer = "adamw", double lr = 1e-2) {
  ModelConfig config = model_preset("gpt2-tiny");
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(7);
  TrainConfig tc;
  tc.batch_size = batch, tc.seq_len = 16, tc.grad_accum = 2, tc.steps = steps, tc.schedule.warmup = 3;
  tc.schedule.max_lr = lr;
  tc.optim.name = optimizer;
  if (tc.optim.name == "momentum") tc.optim.momentum = 0.9;
  DdpConfig ddp;
  ddp.bucket_bytes = 16 << 10;  // several buckets on a 100k-parameter model, launched during backward
  ddp.zero_stage = zero;
  if (topk > 0.0) ddp.compression = parse_enum<Compression>(compression, "compression"), ddp.topk_ratio = topk;
  Trainer trainer(*backend, model, tc, comm, ddp);
  RankData data(backend->allocator(), config, comm ? comm->rank() : 0, comm ? comm->size() : 1, batch);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) losses.push_back(trainer.train_step(data.source()).loss);
  if (state_bytes) *state_bytes = backend->allocator().tracker().current(MEM_OPTIMIZER_STATE);
  const float* p = model.params().data<float>();
  params->assign(p, p + model.params().numel());
  return losses;
}

// DDP on device memory (tests/strict_backend.h: memory host code may not read, as a GPU's): the
// bucket all-reduces and the averaging go through the communicator and the backend only, and
// the run is bitwise the CPU backend's: losses and every final weight.
std::vector<double> run_on(Backend& backend, Communicator& comm, std::vector<double>* params) {
  ModelConfig config = model_preset("gpt2-tiny");
  Transformer model(backend, config);
  model.init_weights(7);
  TrainConfig tc;
  tc.batch_size = 2, tc.seq_len = 16, tc.grad_accum = 2, tc.steps = 6, tc.schedule.warmup = 3;
  DdpConfig ddp;
  ddp.bucket_bytes = 16 << 10;
  Trainer trainer(backend, model, tc, &comm, ddp);
  CpuAllocator host;  // the batch is staged in host memory; the trainer writes it to the backend
  RankData data(host, config, comm.rank(), comm.size(), 2);
  std::vector<double> losses;
  for (int s = 0; s < 6; ++s) losses.push_back(trainer.train_step(data.source()).loss);
  *params = test::values(backend, model.params());
  return losses;
}

TEST(MpiDdp, DeviceMemoryRunIsBitwiseTheCpuRun) {
  auto comm = make_mpi_communicator();
  auto cpu = make_cpu_backend();
  test::StrictBackend strict;
  std::vector<double> p_cpu, p_strict;
  const std::vector<double> expected = run_on(*cpu, *comm, &p_cpu);
  const std::vector<double> got = run_on(strict, *comm, &p_strict);
  EXPECT_EQ(got, expected);
  EXPECT_EQ(p_strict, p_cpu);
}

TEST(MpiDdp, ReproducesTheSingleProcessLossCurve) {
  auto comm = make_mpi_communicator();
  const int n = comm->size();
  ASSERT_GT(n, 1);
  std::vector<double> p_ref, p_ddp;
  const std::vector<double> ref = run(nullptr, 2 * n, 20, &p_ref);
  comm->reset_ledger();
  const std::vector<double> ddp = run(comm.get(), 2, 20, &p_ddp);
  double worst = 0.0;
  for (size_t s = 0; s < ref.size(); ++s) {
    const double rel = std::abs(ddp[s] - ref[s]) / std::abs(ref[s]);
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 1e-5) << "step " << s << ": " << ddp[s] << " vs " << ref[s];
  }
  EXPECT_LT(ref.back(), 0.95 * ref.front());  // it trains (measured 4.59 -> 3.98)
  double perr = 0.0, pmax = 0.0;
  for (size_t i = 0; i < p_ref.size(); ++i) {
    perr = std::max(perr, std::abs(p_ddp[i] - p_ref[i]));
    pmax = std::max(pmax, std::abs(p_ref[i]));
  }
  // Adam divides by sqrt(v): where a gradient is ~0 its fp32 reduction-order noise becomes a
  // visible update, so the weights agree less tightly than the loss (measured 2.2e-4 of the
  // largest weight after 20 steps at lr 1e-2, i.e. 2% of one step's lr; the loss to 2.5e-6).
  EXPECT_LT(perr / pmax, 1e-3);
  // One sync per step (the last micro-batch), every bucket of the 4-byte gradients, plus the loss.
  const ByteLedger& l = comm->ledger();
  EXPECT_GT(l.calls[COLL_ALL_REDUCE], 20 * 2);
  if (comm->rank() == 0) {
    std::printf("ddp np=%d: 20 steps, worst loss rel diff %.2e, params rel diff %.2e, all-reduce calls %lld, sent %lld bytes\n",
                n, worst, perr / pmax, static_cast<long long>(l.calls[COLL_ALL_REDUCE]),
                static_cast<long long>(l.sent[COLL_ALL_REDUCE]));
  }
}

// ZeRO-1: the same loss curve as one process, with each rank holding the AdamW moments of its
// shard only: 8 bytes x (its elements) = 8 Psi / N within the padding of one shard.
TEST(MpiDdp, Zero1ShardsTheOptimizerStateAndKeepsTheCurve) {
  auto comm = make_mpi_communicator();
  const int n = comm->size();
  std::vector<double> p_ref, p_zero;
  int64_t ref_bytes = 0, zero_bytes = 0;
  const std::vector<double> ref = run(nullptr, 2 * n, 20, &p_ref, 0, &ref_bytes);
  const std::vector<double> zero = run(comm.get(), 2, 20, &p_zero, 1, &zero_bytes);
  for (size_t s = 0; s < ref.size(); ++s) EXPECT_LT(std::abs(zero[s] - ref[s]) / std::abs(ref[s]), 1e-5) << "step " << s;
  const int64_t P = static_cast<int64_t>(p_ref.size());
  const ShardRange r = shard_range(P, comm->rank(), n);
  EXPECT_EQ(ref_bytes, 8 * P);  // fp32 AdamW: exp_avg + exp_avg_sq
  EXPECT_EQ(zero_bytes, 8 * (r.end - r.begin));
  EXPECT_LE(zero_bytes, 8 * ((P + n - 1) / n));
  auto backend = make_cpu_backend();  // outlives the tensors below
  Tensor total = Tensor::zeros(backend->allocator(), {1}, DTYPE_F64, MEM_WORKSPACE);
  total.data<double>()[0] = static_cast<double>(zero_bytes);
  comm->all_reduce(total);
  EXPECT_EQ(total.data<double>()[0], static_cast<double>(8 * P));  // the shards tile the state exactly
  // Every rank ends with all the parameters, equal to the others' (the all-gather).
  Tensor first = Tensor::zeros(backend->allocator(), {P}, DTYPE_F32, MEM_WORKSPACE);
  for (int64_t i = 0; i < P; ++i) first.data<float>()[i] = static_cast<float>(p_zero[static_cast<size_t>(i)]);
  comm->broadcast(first, 0);
  for (int64_t i = 0; i < P; ++i) ASSERT_EQ(first.data<float>()[i], static_cast<float>(p_zero[static_cast<size_t>(i)])) << i;
  if (comm->rank() == 0) {
    std::printf("zero-1 np=%d: optimizer state %lld bytes on rank 0 of %lld without sharding (%.3f)\n", n,
                static_cast<long long>(zero_bytes), static_cast<long long>(ref_bytes),
                static_cast<double>(zero_bytes) / static_cast<double>(ref_bytes));
  }
}

// Top-K on the DDP path: ratio 1 sends every entry and reproduces the single-process curve;
// ratio 0.05 sends 5% of the entries (wire bytes by the formula) and still trains, with a
// stated loss gap after 20 steps.
TEST(MpiDdp, TopKCompression) {
  auto comm = make_mpi_communicator();
  const int n = comm->size();
  std::vector<double> p_ref, p_c;
  const std::vector<double> ref = run(nullptr, 2 * n, 20, &p_ref);
  const std::vector<double> full = run(comm.get(), 2, 20, &p_c, 0, nullptr, 1.0);
  for (size_t s = 0; s < ref.size(); ++s) EXPECT_LT(std::abs(full[s] - ref[s]) / ref[s], 1e-5) << "step " << s;
  comm->reset_ledger();
  const std::vector<double> sparse = run(comm.get(), 2, 20, &p_c, 0, nullptr, 0.05);
  const int64_t gathered = comm->ledger().sent[COLL_ALL_GATHER];
  double tail_ref = 0, tail_sparse = 0;
  for (size_t s = 15; s < 20; ++s) tail_ref += ref[s] / 5, tail_sparse += sparse[s] / 5;
  EXPECT_LT(tail_sparse, sparse[0]);                           // it trains
  // The stated gap: measured +10.8% (np 2) after only 20 steps of a tiny model at 5% density.
  EXPECT_LT(std::abs(tail_sparse - tail_ref) / tail_ref, 0.15);
  if (comm->rank() == 0) {
    std::printf("topk 5%% np=%d: last-5 loss %.4f vs uncompressed %.4f (%+.2f%%); all-gather bytes sent %lld over 20 steps\n",
                n, tail_sparse, tail_ref, 100 * (tail_sparse - tail_ref) / tail_ref, static_cast<long long>(gathered));
  }
}

// 1-bit with error feedback, QSGD (s = 127) and PowerSGD (r = 4) on the DDP path: fewer bytes, and it trains.
TEST(MpiDdp, OneBitAndQsgdCompression) {
  auto comm = make_mpi_communicator();
  const int n = comm->size();
  std::vector<double> p_ref, p_c;
  const std::vector<double> ref = run(nullptr, 2 * n, 20, &p_ref);
  for (const char* hook : {"onebit", "qsgd", "powersgd"}) {
    comm->reset_ledger();
    const std::vector<double> c = run(comm.get(), 2, 20, &p_c, 0, nullptr, 1.0, hook);
    double tail_ref = 0, tail = 0;
    for (size_t s = 15; s < 20; ++s) tail_ref += ref[s] / 5, tail += c[s] / 5;
    EXPECT_LT(tail, c[0]) << hook;                                   // it trains
    EXPECT_LT(std::abs(tail - tail_ref) / tail_ref, 0.15) << hook;  // stated bound; measured in docs/parallel.md
    if (comm->rank() == 0) {
      std::printf("%s np=%d: last-5 loss %.4f vs uncompressed %.4f (%+.2f%%); gather + all-reduce bytes sent %lld over 20 steps\n",
                  hook, n, tail, tail_ref, 100 * (tail - tail_ref) / tail_ref,
                  static_cast<long long>(comm->ledger().sent[COLL_ALL_GATHER] + comm->ledger().sent[COLL_ALL_REDUCE]));
    }
  }
}

// DGC (momentum correction in the hook, plain SGD) at 5% density against uncompressed
// momentum SGD (m = 0.9) of the same global batch: the same bytes as Top-K, a stated loss gap.
TEST(MpiDdp, DgcCompression) {
  auto comm = make_mpi_communicator();
  const int n = comm->size();
  std::vector<double> p_ref, p_c;
  const std::vector<double> ref = run(nullptr, 2 * n, 20, &p_ref, 0, nullptr, 0.0, "topk", "momentum", 0.1);
  comm->reset_ledger();
  const std::vector<double> c = run(comm.get(), 2, 20, &p_c, 0, nullptr, 0.05, "dgc", "sgd", 0.1);
  double tail_ref = 0, tail = 0;
  for (size_t s = 15; s < 20; ++s) tail_ref += ref[s] / 5, tail += c[s] / 5;
  EXPECT_LT(tail, c[0]);                                   // it trains
  EXPECT_LT(std::abs(tail - tail_ref) / tail_ref, 0.15);  // stated bound; measured in docs/parallel.md
  if (comm->rank() == 0) {
    std::printf("dgc 5%% np=%d: last-5 loss %.4f vs momentum SGD %.4f (%+.2f%%); all-gather bytes sent %lld over 20 steps\n",
                n, tail, tail_ref, 100 * (tail - tail_ref) / tail_ref,
                static_cast<long long>(comm->ledger().sent[COLL_ALL_GATHER]));
  }
}

// Every hook's buffers (codes, gathered codes, P and Q) are allocated when DataParallel is built:
// three steps of every bucket reduced and averaged allocate nothing (the tracker's peak stays
// where construction left it), DGC's densest warm-up step included.
TEST(MpiDdp, CompressedStepsAllocateNothing) {
  auto comm = make_mpi_communicator();
  auto backend = make_cpu_backend();
  const ParamLayout layout = build_param_layout(model_preset("gpt2-tiny"));
  Tensor grads = Tensor::zeros(backend->allocator(), {layout.total}, DTYPE_F32, MEM_GRADIENTS);
  for (const char* hook : {"topk", "dgc", "onebit", "qsgd", "powersgd"}) {
    DdpConfig ddp;
    ddp.bucket_bytes = 16 << 10;
    ddp.compression = parse_enum<Compression>(hook, "compression"), ddp.topk_ratio = 0.05, ddp.dgc.warmup_steps = 2;
    DataParallel dp(*comm, *backend, grads, layout, ddp);
    MemoryTracker& mem = backend->allocator().tracker();
    const size_t before = mem.current_total();
    mem.reset_peaks();
    for (int step = 0; step < 3; ++step) {
      float* g = grads.data<float>();
      for (int64_t i = 0; i < layout.total; ++i) g[i] = std::sin(0.01f * static_cast<float>(i + 7 * step + comm->rank()));
      for (const DataParallel::Bucket& b : dp.buckets()) dp.ready_from(b.begin);
      dp.finish();
    }
    EXPECT_EQ(mem.peak_total(), before) << hook;
    EXPECT_EQ(mem.current_total(), before) << hook;
  }
}

}  // namespace
}  // namespace loom
