// Every model-parallel layout of the distributed tests with device = "cuda", over NCCL, under
// mpirun, on the CUDA simulator (docs/cuda.md): tp + sp, pp under the 1f1b, gpipe, zb-h1 and
// interleaved schedules, cp ring and Ulysses (with ZeRO-1), ep with MoE, and at 4 ranks each
// beside data parallelism, MoE ep x pp and Llama tp + sp x pp; at 8 ranks dp2 x tp2 x pp2. Each
// layout trains four steps on the CUDA backend, its groups split from one communicator that sends
// device tensors to NCCL and host values to MPI (the layout's own wiring: train/layout.cpp), and
// on the CPU backend over MPI. The CPU runs of these layouts reproduce one process (mpi_test_tp,
// _pp, _cp, _moe), so agreeing with them is agreeing with one process.
//
// Tolerance (fp32 throughout): every loss, gradient norm and final weight within 5e-6 relative to
// the largest of its kind, the single-process CUDA trainer test's bound (test_cuda_sim_train.cpp):
// the simulated cuBLAS sums each product in k order, the CPU's GEMM in blocks, and NCCL's
// reductions add in another order than MPI's, so the last bits differ. The model-parallel layouts
// run twice: under SGD, every loss, norm and weight is compared; under AdamW (the layouts'
// optimizer) the losses and norms, not the weights, as mpi_test_pp.cpp does: sqrt(v) turns the
// reduction order's rounding in gradients that are zero in exact arithmetic into updates of up to
// lr. Measured for gpt2-tiny dp2 x pp2 at np 4: weights 6.2e-6 apart under AdamW (with ZeRO-1 or
// without), 1.9e-9 under SGD, gradient norms 7.3e-7 and 1.6e-8. The optimizers' own kernels are
// compared weight by weight in the data-parallel test below and in test_cuda_sim_train.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/comm/cuda_device_group.h"
#include "mpi_layout.h"
#include "test_util.h"

namespace loom {
namespace {

constexpr double kTolerance = 5e-6;

struct Run {
  std::vector<double> losses, norms, params;
};

// Four steps of `lay` on `backend`, its groups split from `world`.
Run run_layout(Communicator& world, const RunLayout& lay, std::unique_ptr<Backend> backend) {
  LayoutRun run(world, lay, std::move(backend));
  Run out;
  for (int s = 0; s < 4; ++s) {
    const StepStats st = run.trainer->train_step(*run.data);
    out.losses.push_back(st.loss);
    out.norms.push_back(st.grad_norm);
  }
  out.params = test::values(*run.backend, run.sliced.model.params());
  return out;
}

// norms_tolerance: the gradient norms' bound where the layout's gradients are not its devices'
// rounding apart (1-bit compression below). compare_weights: false for AdamW over a model-parallel
// layout (the header).
void expect_cuda_matches_cpu(Communicator& world, const RunLayout& lay, double norms_tolerance = kTolerance,
                             bool compare_weights = true) {
  const Run expected = run_layout(world, lay, make_cpu_backend());
  std::unique_ptr<Backend> cuda = make_backend("cuda");
  // The layout's wiring on a GPU: device tensors over NCCL, host values over MPI.
  std::unique_ptr<Communicator> device_world = make_cuda_device_group(world, *cuda);
  const Run got = run_layout(*device_world, lay, std::move(cuda));
  const double losses = test::max_rel_error(got.losses, expected.losses);
  const double norms = test::max_rel_error(got.norms, expected.norms);
  const double params = test::max_rel_error(got.params, expected.params);
  EXPECT_LT(losses, kTolerance) << lay.name();
  EXPECT_LT(norms, norms_tolerance) << lay.name();
  if (compare_weights) {
    EXPECT_LT(params, kTolerance) << lay.name() << ": the final weights differ";
  }
  for (double x : got.losses) EXPECT_TRUE(std::isfinite(x)) << lay.name();
  if (world.rank() == 0) {
    std::printf("[ cuda     ] %s: max relative difference to the CPU: losses %.2e, grad norms %.2e, weights %.2e%s\n",
                lay.name().c_str(), losses, norms, params, compare_weights ? "" : " (not compared)");
  }
}

// A model-parallel layout under SGD, all compared, and under its own optimizer, the weights not.
void expect_model_parallel_matches_cpu(Communicator& world, const RunLayout& lay) {
  RunLayout sgd = lay;
  sgd.optimizer = "sgd";
  expect_cuda_matches_cpu(world, sgd);
  expect_cuda_matches_cpu(world, lay, kTolerance, std::string(lay.optimizer) == "sgd");
}

TEST(CudaLayouts, ModelParallelOverNcclMatchesTheCpu) {
  auto world = make_mpi_communicator();
  if (world->size() != 2 && world->size() != 4) GTEST_SKIP() << "runs under np 2 or 4";
  for (const RunLayout& lay : model_parallel_layouts(world->size())) expect_model_parallel_matches_cpu(*world, lay);
}

TEST(CudaLayouts, DataParallelZeroAndOptimizersOverNcclMatchTheCpu) {
  auto world = make_mpi_communicator();
  if (world->size() != 2) GTEST_SKIP() << "runs under np 2";
  for (int zero : {1, 2, 3}) {
    RunLayout lay;
    lay.dp = 2, lay.zero = zero;
    expect_cuda_matches_cpu(*world, lay);
  }
  for (const char* optimizer : {"muon", "adafactor", "lion"}) {
    RunLayout lay;
    lay.preset = "llama-tiny", lay.dp = 2, lay.optimizer = optimizer;
    expect_cuda_matches_cpu(*world, lay);
  }
}

// Each gradient compressor (parallel/compress.h) between two data-parallel ranks, with the
// optimizer it suits (docs/parallel.md): its encode and decode ops on the device, its payload
// over NCCL.
TEST(CudaLayouts, GradientCompressionOverNcclMatchesTheCpu) {
  auto world = make_mpi_communicator();
  if (world->size() != 2) GTEST_SKIP() << "runs under np 2";
  for (const auto& [compression, optimizer] : {std::pair{"topk", "momentum"}, {"dgc", "sgd"}, {"onebit", "momentum"},
                                               {"qsgd", "adamw"}, {"powersgd", "adamw"}}) {
    RunLayout lay;
    lay.dp = 2, lay.compression = compression, lay.optimizer = optimizer;
    // 1-bit sends each element's sign times the bucket's mean |g|: an element that is rounding
    // noise on both devices (GPT-2's c_attn key bias, whose gradient is zero in exact arithmetic)
    // decodes to +scale on one and -scale on the other, which moves the gradient norm by about
    // 1e-4 relative (measured 2.0e-4; losses 6.5e-9, weights 2.7e-6): 1e-3 for its norms.
    const bool onebit = std::string(compression) == "onebit";
    expect_cuda_matches_cpu(*world, lay, onebit ? 1e-3 : kTolerance);
  }
}

TEST(CudaLayouts, ThreeDimensionsDp2Tp2Pp2OverNcclMatchTheCpu) {
  auto world = make_mpi_communicator();
  if (world->size() != 8) GTEST_SKIP() << "runs under np 8";
  RunLayout lay;
  lay.preset = "llama-tiny", lay.n_layer = 4, lay.dp = 2, lay.tp = 2, lay.sp = true, lay.pp = 2, lay.schedule = "zb-h1";
  expect_model_parallel_matches_cpu(*world, lay);
}

}  // namespace
}  // namespace loom
