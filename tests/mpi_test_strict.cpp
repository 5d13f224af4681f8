// The distributed features whose element work is behind the Backend interface, on device memory
// (tests/strict_backend.h: the CPU kernels on memory host code may not read, as a GPU's) under
// mpirun: ZeRO-1/2/3 (the shard's zeroing and 1/N scaling, released ranges zeroed through the
// backend instead of returned to the OS) alone and under a low-precision recipe (FP8 current
// scaling, bf16 gradient reduction, loss scaling) train bitwise as the CPU backend does: every
// loss, every gradient norm and every final weight.
#include <gtest/gtest.h>

#include <vector>

#include "loom/comm/communicator.h"
#include "loom/train/trainer.h"
#include "mpi_fixture.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

struct ZeroCase {
  int stage;
  const char* compute;  // precision.compute
  const char* reduce;   // precision.reduce
  bool loss_scaling;
};

TrainConfig zero_train_config(const ZeroCase& c) {
  TrainConfig tc;
  tc.batch_size = 2, tc.seq_len = 16, tc.grad_accum = 2, tc.steps = 4, tc.schedule.warmup = 2;
  tc.precision.compute = c.compute, tc.precision.reduce = c.reduce, tc.loss_scaling = c.loss_scaling;
  return tc;
}

std::vector<double> run_on(Backend& backend, Communicator& comm, const ZeroCase& c, std::vector<double>* params) {
  const ModelConfig config = model_preset("gpt2-tiny");
  Transformer model(backend, config);
  model.init_weights(7);
  const TrainConfig tc = zero_train_config(c);
  DdpConfig ddp;
  ddp.zero_stage = c.stage;
  Trainer trainer(backend, model, tc, &comm, ddp);
  CpuAllocator host;  // the batch is staged in host memory; the trainer writes it to the backend
  RankData data(host, config, comm.rank(), comm.size(), 2);
  std::vector<double> out;
  for (int s = 0; s < 4; ++s) {
    const StepStats st = trainer.train_step(data.source());
    out.push_back(st.loss);
    out.push_back(st.grad_norm);
  }
  trainer.gather_params();  // ZeRO-3: the weights whole again
  *params = test::values(backend, model.params());
  return out;
}

TEST(MpiStrict, ZeroOnDeviceMemoryIsBitwiseTheCpuRun) {
  auto comm = make_mpi_communicator();
  ASSERT_GT(comm->size(), 1);
  for (const ZeroCase& c : {ZeroCase{1, "f32", "f32", false}, ZeroCase{2, "f32", "f32", false},
                            ZeroCase{3, "f32", "f32", false}, ZeroCase{2, "fp8-current", "bf16", false},
                            ZeroCase{3, "fp16", "f32", true}}) {
    auto cpu = make_cpu_backend();
    test::StrictBackend strict;
    std::vector<double> p_cpu, p_strict;
    const std::vector<double> expected = run_on(*cpu, *comm, c, &p_cpu);
    const std::vector<double> got = run_on(strict, *comm, c, &p_strict);
    EXPECT_EQ(got, expected) << "zero " << c.stage << " compute " << c.compute << " reduce " << c.reduce;
    EXPECT_EQ(p_strict, p_cpu) << "zero " << c.stage << " compute " << c.compute;
  }
}

}  // namespace
}  // namespace loom
