// The distributed features whose element work is behind the Backend interface, on device memory
// (tests/strict_backend.h: the CPU kernels on memory host code may not read, as a GPU's) under
// mpirun: ZeRO-1/2/3 (the shard's zeroing and 1/N scaling, released ranges zeroed through the
// backend instead of returned to the OS) alone and under a low-precision recipe (FP8 current
// scaling, bf16 gradient reduction, loss scaling) train bitwise as the CPU backend does: every
// loss, every gradient norm and every final weight. So do the model-parallel layouts (their
// slicing through Backend::copy / copy_block): tp (+ sp), pp (1f1b, gpipe, zb-h1, interleaved),
// cp (ring, Ulysses) and ep with MoE, and a tp run's checkpoint files are byte-identical.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/train/layout.h"
#include "loom/train/parallelize.h"
#include "loom/train/state_gather.h"
#include "loom/train/trainer.h"
#include "mpi_layout.h"
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

// The distributed tests' model-parallel layouts (mpi_layout.h: tp + sp, pp under every
// schedule, cp ring and Ulysses, ep with MoE, and at 4 ranks their products), and tp alone.
std::vector<RunLayout> strict_layouts(int world) {
  std::vector<RunLayout> out = model_parallel_layouts(world);
  RunLayout plain_tp;
  plain_tp.dp = world / 2, plain_tp.tp = 2;
  out.push_back(plain_tp);
  return out;
}

// Four steps of `lay` on `backend`: per step the loss and the gradient norm, and the final weights.
std::vector<double> run_layout(Communicator& world, const RunLayout& lay, std::unique_ptr<Backend> backend,
                               std::vector<double>* params) {
  LayoutRun run(world, lay, std::move(backend));
  std::vector<double> out;
  for (int s = 0; s < 4; ++s) {
    const StepStats st = run.trainer->train_step(*run.data);
    out.push_back(st.loss);
    out.push_back(st.grad_norm);
  }
  *params = test::values(*run.backend, run.sliced.model.params());
  return out;
}

TEST(MpiStrict, ModelParallelOnDeviceMemoryIsBitwiseTheCpuRun) {
  auto world = make_mpi_communicator();
  ASSERT_GT(world->size(), 1);
  for (const RunLayout& lay : strict_layouts(world->size())) {
    std::vector<double> p_cpu, p_strict;
    const std::vector<double> expected = run_layout(*world, lay, make_cpu_backend(), &p_cpu);
    const std::vector<double> got = run_layout(*world, lay, std::make_unique<test::StrictBackend>(), &p_strict);
    EXPECT_EQ(got, expected) << lay.name();
    EXPECT_EQ(p_strict, p_cpu) << lay.name() << ": the final weights differ";
    for (double x : expected) EXPECT_TRUE(std::isfinite(x)) << lay.name();
  }
}

// A tp = 2 run (the rest data parallel) of two steps saved through TrainingState: the slices
// gathered whole (state_gather.cpp's tp_copy) from `backend`'s memory into checkpoint files
// under dir. Returns every file's bytes by name (rank 0; empty elsewhere).
std::map<std::string, std::string> save_tp_checkpoint(Communicator& world, Backend& backend, const std::string& dir) {
  LoomConfig config;
  config.model = model_preset("gpt2-tiny");
  config.parallel.tp = 2;
  config.train.batch_size = 2, config.train.seq_len = 16, config.train.steps = 4;
  ParallelLayout layout(config, world, backend);
  TrainingModel parts = parallelize(backend, config, layout);
  CpuAllocator host;  // the batch staged in host memory
  RankData data(host, config.model, layout.batch_group().rank(), layout.batch_group().size(), 2);
  for (int s = 0; s < 2; ++s) parts.trainer->train_step(data.source());
  TrainingState state(backend, config, layout, parts, dir, "config");
  const std::string path = state.save(nlohmann::json::object());
  world.barrier();
  std::map<std::string, std::string> files;
  if (world.rank() != 0) return files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(path)) {
    if (!entry.is_regular_file()) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    files[std::filesystem::relative(entry.path(), path).string()] =
        std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return files;
}

TEST(MpiStrict, TensorParallelCheckpointFromDeviceMemoryIsByteIdentical) {
  auto world = make_mpi_communicator();
  ASSERT_GT(world->size(), 1);
  const std::string root = (std::filesystem::temp_directory_path() / "loom_mpi_strict_ckpt").string();
  if (world->rank() == 0) std::filesystem::remove_all(root);
  world->barrier();
  auto cpu = make_cpu_backend();
  test::StrictBackend strict;
  const auto expected = save_tp_checkpoint(*world, *cpu, root + "/cpu");
  const auto got = save_tp_checkpoint(*world, strict, root + "/strict");
  if (world->rank() == 0) {
    size_t tensors = 0;  // the weights and the optimizer state
    for (const auto& [name, bytes] : expected) tensors += name.find(".safetensors") != std::string::npos;
    EXPECT_GT(tensors, 0u) << "no .safetensors file among " << expected.size();
    ASSERT_EQ(got.size(), expected.size());
    for (const auto& [name, bytes] : expected) {
      ASSERT_EQ(got.count(name), 1u) << name;
      EXPECT_TRUE(got.at(name) == bytes) << name << " differs between the strict and the CPU backend";
    }
    std::filesystem::remove_all(root);
  }
  world->barrier();
}

}  // namespace
}  // namespace loom
