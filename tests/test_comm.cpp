// The single-process communicator: collectives are identities or copies, and the ledger books
// calls but no bytes (nothing leaves the process).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/comm/device_mesh.h"
#include "loom/core/error.h"
#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"
#include "loom/parallel/compress.h"
#include "test_util.h"

namespace loom {
namespace {

// 8 ranks as pp=2 x dp=2 x tp=2: tp groups are neighbours, pp stages 4 ranks apart.
// A launcher's rank variables are read strictly: OpenMPI's world size "4x" is a one-line error
// naming the variable, where a lenient parse would have read 4 (or atoi's 0 for "x4").
TEST(DetectLaunch, AMalformedRankVariableIsAOneLineError) {
  if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) GTEST_SKIP() << "running under mpirun";
  setenv("OMPI_COMM_WORLD_SIZE", "4x", 1);
  const std::string message = test::error_of([] { (void)detect_launch(); });
  unsetenv("OMPI_COMM_WORLD_SIZE");
  EXPECT_NE(message.find("environment variable OMPI_COMM_WORLD_SIZE='4x': expected a whole number from 0 to"),
            std::string::npos)
      << message;
  EXPECT_EQ(detect_launch().launcher, "none");
}

TEST(DeviceMesh, CoordinatesAndGroups) {
  const DeviceMesh mesh(8, {{"pp", 2}, {"dp", 0}, {"tp", 2}});
  EXPECT_EQ(mesh.size("dp"), 2);  // 0: the ranks left
  EXPECT_EQ(mesh.describe(), "pp=2 x dp=2 x tp=2");
  EXPECT_EQ(mesh.coord(5, "pp"), 1);
  EXPECT_EQ(mesh.coord(5, "dp"), 0);
  EXPECT_EQ(mesh.coord(5, "tp"), 1);
  EXPECT_EQ(mesh.group(5, "tp"), (std::vector<int>{4, 5}));
  EXPECT_EQ(mesh.group(5, "dp"), (std::vector<int>{5, 7}));
  EXPECT_EQ(mesh.group(5, "pp"), (std::vector<int>{1, 5}));
  for (int r = 0; r < 8; ++r) {  // coordinates and ranks are a bijection
    EXPECT_EQ(mesh.coord(r, "pp") * 4 + mesh.coord(r, "dp") * 2 + mesh.coord(r, "tp"), r);
  }
  EXPECT_THROW(DeviceMesh(6, {{"dp", 4}, {"tp", 2}}), Error);
  EXPECT_THROW(DeviceMesh(8, {{"dp", 0}, {"tp", 0}}), Error);
  EXPECT_THROW(DeviceMesh(6, {{"dp", 0}, {"tp", 4}}), Error);
  EXPECT_THROW(mesh.size("ep"), Error);
  EXPECT_EQ(training_mesh(4, 0, 1, 1, 1).size("dp"), 4);
  EXPECT_EQ(training_mesh(4, 0, 2, 1, 1).size("dp"), 2);
  EXPECT_EQ(training_mesh(8, 0, 2, 2, 1).size("dp"), 2);
  EXPECT_EQ(training_mesh(4, 0, 1, 1, 2).size("dp"), 2);
}

TEST(LocalComm, CollectivesOfOneRank) {
  auto comm = make_local_communicator();
  auto backend = make_cpu_backend();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  Tensor x = test::random_tensor(backend->allocator(), {17}, DTYPE_F32, 1);
  const std::vector<double> before = test::values(x);
  comm->all_reduce(x);
  EXPECT_EQ(test::values(x), before);
  Tensor y = Tensor::zeros(backend->allocator(), {17}, DTYPE_F32, MEM_WORKSPACE);
  comm->reduce_scatter(x, y);
  EXPECT_EQ(test::values(y), before);
  Tensor z = Tensor::zeros(backend->allocator(), {17}, DTYPE_F32, MEM_WORKSPACE);
  comm->all_gather(y, z);
  EXPECT_EQ(test::values(z), before);
  EXPECT_EQ(comm->ledger().calls[COLL_ALL_REDUCE], 1);
  EXPECT_EQ(comm->ledger().total_sent(), 0);
  Tensor bad = Tensor::zeros(backend->allocator(), {16}, DTYPE_F32, MEM_WORKSPACE);
  EXPECT_THROW(comm->reduce_scatter(x, bad), Error);
  EXPECT_THROW(comm->send(x, 1), Error);
}

// Top-K with error feedback: over 6 steps, sum of what was sent + the residual = sum of the
// gradients (fp32 rounding); each step sends exactly k entries, the largest of gradient +
// residual; ratio 1 sends everything and leaves no residual.
TEST(TopKCompression, ErrorFeedbackInvariantAndSelection) {
  auto comm = make_local_communicator();
  auto backend = make_cpu_backend();
  const int64_t n = 1000, k = 37;
  auto topk = make_topk_compressor(*backend, n + 10, static_cast<double>(k) / n);
  std::vector<double> grad_sum(n, 0.0), sent_sum(n, 0.0);
  for (int step = 0; step < 6; ++step) {
    Tensor g = test::random_tensor(backend->allocator(), {n}, DTYPE_F32, 100 + step);
    std::vector<double> acc(n);
    for (int64_t i = 0; i < n; ++i) {
      grad_sum[i] += g.data<float>()[i];
      acc[i] = static_cast<double>(g.data<float>()[i]) + topk->residual().data<float>()[10 + i];
    }
    topk->reduce(*comm, g, 10);  // a bucket at offset 10 of the flat gradient
    int64_t nonzero = 0;
    double smallest_sent = 1e30, largest_kept = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const float s = g.data<float>()[i];
      sent_sum[i] += s;
      if (s != 0.0f) {
        ++nonzero;
        smallest_sent = std::min(smallest_sent, std::abs(acc[i]));
      } else {
        largest_kept = std::max(largest_kept, std::abs(acc[i]));
      }
    }
    EXPECT_EQ(nonzero, k) << "step " << step;
    EXPECT_GE(smallest_sent, largest_kept) << "step " << step;
  }
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(sent_sum[i] + topk->residual().data<float>()[10 + i], grad_sum[i], 1e-5) << i;
  }
  auto all = make_topk_compressor(*backend, n, 1.0);
  Tensor g = test::random_tensor(backend->allocator(), {n}, DTYPE_F32, 9);
  const std::vector<double> before = test::values(g);
  all->reduce(*comm, g, 0);
  EXPECT_EQ(test::values(g), before);
  EXPECT_EQ(test::values(all->residual()), std::vector<double>(n, 0.0));
}

// DGC at momentum 0, no clipping and no warm-up is Top-K: bitwise the same output and residual
// over 5 calls (a bucket at offset 10 of the flat gradient).
TEST(DgcCompression, MomentumZeroIsTopK) {
  auto comm = make_local_communicator();
  auto backend = make_cpu_backend();
  const int64_t n = 500;
  auto topk = make_topk_compressor(*backend, n + 10, 0.03);
  auto dgc = make_dgc_compressor(*backend, n + 10, {.ratio = 0.03, .momentum = 0.0});
  for (int step = 0; step < 5; ++step) {
    Tensor a = test::random_tensor(backend->allocator(), {n}, DTYPE_F32, 300 + step);
    Tensor b = test::random_tensor(backend->allocator(), {n}, DTYPE_F32, 300 + step);
    topk->reduce(*comm, a, 10);
    dgc->reduce(*comm, b, 10);
    EXPECT_EQ(test::values(b), test::values(a)) << "step " << step;
    EXPECT_EQ(test::values(dgc->residual()), test::values(topk->residual())) << "step " << step;
  }
}

// DGC with momentum 0.9, against a float64 reference of u = m u + g, v = v + u: each call sends
// exactly k entries, the largest |v|; u and v are zero at the sent entries (momentum factor
// masking) and follow the reference elsewhere; sum(sent) + v = sum over calls of u (before masking).
TEST(DgcCompression, MomentumCorrectionAndFactorMasking) {
  auto comm = make_local_communicator();
  auto backend = make_cpu_backend();
  const int64_t n = 400, k = 12, off = 5;
  const double m = 0.9;
  auto dgc = make_dgc_compressor(*backend, n + off, {.ratio = static_cast<double>(k) / n, .momentum = m});
  std::vector<double> u(n, 0.0), v(n, 0.0), u_sum(n, 0.0), sent_sum(n, 0.0);
  for (int step = 0; step < 8; ++step) {
    Tensor g = test::random_tensor(backend->allocator(), {n}, DTYPE_F32, 400 + step);
    for (int64_t i = 0; i < n; ++i) {
      u[i] = m * u[i] + g.data<float>()[i];
      v[i] += u[i];
      u_sum[i] += u[i];
    }
    dgc->reduce(*comm, g, off);
    const float* du = dgc->momentum()->data<float>() + off;
    const float* dv = dgc->residual().data<float>() + off;
    int64_t sent = 0;
    double smallest_sent = 1e30, largest_kept = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const float s = g.data<float>()[i];
      sent_sum[i] += s;
      if (s != 0.0f) {
        ++sent;
        smallest_sent = std::min(smallest_sent, std::abs(v[i]));
        EXPECT_NEAR(s, v[i], 1e-5) << "step " << step << " element " << i;
        EXPECT_EQ(du[i], 0.0f) << "step " << step << " element " << i;
        EXPECT_EQ(dv[i], 0.0f) << "step " << step << " element " << i;
        u[i] = v[i] = 0.0;  // the reference masks the same entries
      } else {
        largest_kept = std::max(largest_kept, std::abs(v[i]));
        EXPECT_NEAR(du[i], u[i], 1e-5) << "step " << step << " element " << i;
        EXPECT_NEAR(dv[i], v[i], 1e-5) << "step " << step << " element " << i;
      }
    }
    EXPECT_EQ(sent, k) << "step " << step;
    EXPECT_GE(smallest_sent, largest_kept - 1e-5) << "step " << step;
    for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(sent_sum[i] + dv[i], u_sum[i], 1e-5) << "step " << step << " " << i;
  }
  EXPECT_EQ(dgc->momentum()->numel(), n + off);
}

// Sparsity warm-up at ratio 0.001 over 8 calls per bucket: S = 4 stages of 2 calls each, densities
// 1/4, 1/16, 1/64, 1/256, then 0.001: k = floor(d n) for n = 1000 is 250, 62, 15, 3, then 1. Each
// bucket (offset) counts its own calls; warmup_steps = 0 sends k = 1 from the first call.
TEST(DgcCompression, SparsityWarmupSchedule) {
  auto comm = make_local_communicator();
  auto backend = make_cpu_backend();
  const int64_t n = 1000;
  auto dgc = make_dgc_compressor(*backend, 2 * n, {.ratio = 0.001, .momentum = 0.9, .warmup_steps = 8});
  auto count = [&](GradCompressor& c, int64_t offset, uint64_t seed) {
    Tensor g = test::random_tensor(backend->allocator(), {n}, DTYPE_F32, seed);
    c.reduce(*comm, g, offset);
    int64_t nonzero = 0;
    for (int64_t i = 0; i < n; ++i) nonzero += g.data<float>()[i] != 0.0f;
    return nonzero;
  };
  const std::vector<int64_t> expect = {250, 250, 62, 62, 15, 15, 3, 3, 1, 1, 1};
  for (size_t t = 0; t < expect.size(); ++t) {
    EXPECT_EQ(count(*dgc, n, 500 + t), expect[t]) << "bucket at n, call " << t;  // the later bucket first, as DDP
    EXPECT_EQ(count(*dgc, 0, 600 + t), expect[t]) << "bucket at 0, call " << t;
  }
  auto none = make_dgc_compressor(*backend, n, {.ratio = 0.001});
  EXPECT_EQ(count(*none, 0, 700), 1);
  // ratio 0.1: one warm-up stage (1/4 > 0.1 > 1/16) over all 3 warm-up calls.
  auto one = make_dgc_compressor(*backend, n, {.ratio = 0.1, .warmup_steps = 3});
  for (const int64_t k : {250, 250, 250, 100, 100}) EXPECT_EQ(count(*one, 0, 800 + k), k);
}

// Local clipping: a gradient whose norm exceeds the threshold is scaled to norm = threshold
// (ratio 1 and momentum 0 send it whole); below the threshold it passes unchanged; a bucket of a
// quarter of the flat gradient is clipped to its share, threshold x sqrt(1/4).
TEST(DgcCompression, LocalGradientClipping) {
  auto comm = make_local_communicator();
  auto backend = make_cpu_backend();
  const int64_t n = 100;
  auto norm = [](const Tensor& t) {
    double sq = 0.0;
    for (const double x : test::values(t)) sq += x * x;
    return std::sqrt(sq);
  };
  const DgcOptions clip = {.ratio = 1.0, .momentum = 0.0, .clip_norm = 2.0};
  auto dgc = make_dgc_compressor(*backend, n, clip);
  Tensor g = test::random_tensor(backend->allocator(), {n}, DTYPE_F32, 900);
  const std::vector<double> before = test::values(g);
  const double norm_before = norm(g);
  ASSERT_GT(norm_before, 4.0);
  dgc->reduce(*comm, g, 0);
  EXPECT_NEAR(norm(g), 2.0, 1e-6);
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(g.data<float>()[i], before[i] * 2.0 / norm_before, 1e-6) << i;

  auto fresh = make_dgc_compressor(*backend, n, clip);
  Tensor small = test::random_tensor(backend->allocator(), {n}, DTYPE_F32, 901, 0.1);
  const std::vector<double> unchanged = test::values(small);
  ASSERT_LT(norm(small), 2.0);
  fresh->reduce(*comm, small, 0);
  EXPECT_EQ(test::values(small), unchanged);

  auto share = make_dgc_compressor(*backend, 4 * n, clip);
  Tensor part = test::random_tensor(backend->allocator(), {n}, DTYPE_F32, 902);
  share->reduce(*comm, part, 3 * n);
  EXPECT_NEAR(norm(part), 1.0, 1e-6);
}

// 1-bit with error feedback: what is sent is +-scale with scale = mean |gradient + residual|,
// the invariant sum(sent) + residual = sum(gradients) holds over 6 steps.
TEST(OneBitCompression, SendsSignTimesMeanMagnitudeWithErrorFeedback) {
  auto comm = make_local_communicator();
  auto backend = make_cpu_backend();
  const int64_t n = 100;  // not a multiple of 32
  auto onebit = make_onebit_compressor(*backend, n);
  std::vector<double> grad_sum(n, 0.0), sent_sum(n, 0.0);
  for (int step = 0; step < 6; ++step) {
    Tensor g = test::random_tensor(backend->allocator(), {n}, DTYPE_F32, 200 + step);
    std::vector<double> acc(n);
    double l1 = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      grad_sum[i] += g.data<float>()[i];
      acc[i] = static_cast<double>(g.data<float>()[i]) + onebit->residual().data<float>()[i];
      l1 += std::abs(acc[i]);
    }
    onebit->reduce(*comm, g, 0);
    for (int64_t i = 0; i < n; ++i) {
      const double expect = (acc[i] < 0 ? -1.0 : 1.0) * (l1 / n);
      EXPECT_NEAR(g.data<float>()[i], expect, 1e-5 * (l1 / n)) << "step " << step << " element " << i;
      sent_sum[i] += g.data<float>()[i];
    }
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(sent_sum[i] + onebit->residual().data<float>()[i], grad_sum[i], 1e-5) << i;
}

// QSGD is unbiased: the mean of 20000 decoded vectors (different draws) is within 5 standard
// errors of v for every element, each decoded value is ||v|| sign(v_i) l / s with l one of the
// two levels around |v_i| s / ||v||, and the same draw index repeats exactly.
TEST(QsgdCompression, UnbiasedOnTheTwoNearestLevels) {
  auto comm = make_local_communicator();
  auto backend = make_cpu_backend();
  const int64_t n = 24;
  const int s = 4;
  auto qsgd = make_qsgd_compressor(*backend, n, s, 77);
  Tensor v = test::random_tensor(backend->allocator(), {n}, DTYPE_F32, 5);
  double sq = 0.0;
  for (int64_t i = 0; i < n; ++i) sq += static_cast<double>(v.data<float>()[i]) * v.data<float>()[i];
  const double norm = std::sqrt(sq);
  const int draws = 20000;
  std::vector<double> mean(n, 0.0), m2(n, 0.0);
  Tensor g = Tensor::zeros(backend->allocator(), {n}, DTYPE_F32, MEM_WORKSPACE);
  for (int d = 0; d < draws; ++d) {
    std::copy_n(v.data<float>(), n, g.data<float>());
    qsgd->reduce(*comm, g, 0);
    for (int64_t i = 0; i < n; ++i) {
      const double q = g.data<float>()[i], x = std::abs(v.data<float>()[i]) / norm * s;
      const double level = std::abs(q) * s / norm;
      ASSERT_TRUE(std::abs(level - std::floor(x)) < 1e-4 || std::abs(level - std::floor(x) - 1) < 1e-4) << level << " " << x;
      mean[i] += q / draws;
      m2[i] += q * q / draws;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const double se = std::sqrt(std::max(m2[i] - mean[i] * mean[i], 1e-30) / draws);
    EXPECT_LT(std::abs(mean[i] - v.data<float>()[i]), 5 * se + 1e-7) << i;
  }
}

// PowerSGD: at full rank (r >= min(rows, cols)) the compressed gradient is the gradient itself
// and the residual vanishes; at rank 1, sent + residual = gradient (error feedback) and a
// rank-1 matrix is still sent exactly.
TEST(PowerSgdCompression, FullRankIsExactAndErrorFeedbackHolds) {
  auto comm = make_local_communicator();
  auto backend = make_cpu_backend();
  const ParamLayout layout = build_param_layout(model_preset("gpt2-tiny"));
  auto full = make_powersgd_compressor(*backend, layout, 1000, 3);
  Tensor g = test::random_tensor(backend->allocator(), {layout.total}, DTYPE_F32, 21);
  const std::vector<double> before = test::values(g);
  full->reduce(*comm, g, 0);
  // Exact up to fp32: P and Q travel as f32, so P P^T = I only to ~r 2^-24 per entry, summed over
  // up to 128 columns (measured 2e-5 of the largest gradient; classical single-pass Gram-Schmidt
  // in f32 gave 6e-5, hence the two double-precision passes).
  EXPECT_LT(test::max_rel_error(test::values(g), before), 1e-4);
  double res = 0.0;
  for (int64_t i = 0; i < layout.total; ++i) res = std::max(res, std::abs(static_cast<double>(full->residual().data<float>()[i])));
  EXPECT_LT(res, 1e-4);

  auto low = make_powersgd_compressor(*backend, layout, 1, 3);
  std::vector<double> grad_sum(static_cast<size_t>(layout.total), 0.0), sent_sum(grad_sum);
  for (int step = 0; step < 3; ++step) {
    Tensor h = test::random_tensor(backend->allocator(), {layout.total}, DTYPE_F32, 40 + step);
    for (int64_t i = 0; i < layout.total; ++i) grad_sum[static_cast<size_t>(i)] += h.data<float>()[i];
    low->reduce(*comm, h, 0);
    for (int64_t i = 0; i < layout.total; ++i) sent_sum[static_cast<size_t>(i)] += h.data<float>()[i];
  }
  double worst = 0.0, moved = 0.0;
  for (int64_t i = 0; i < layout.total; ++i) {
    const double r = low->residual().data<float>()[i];
    worst = std::max(worst, std::abs(sent_sum[static_cast<size_t>(i)] + r - grad_sum[static_cast<size_t>(i)]));
    moved = std::max(moved, std::abs(r));
  }
  EXPECT_LT(worst, 1e-4);
  EXPECT_GT(moved, 0.1);  // rank 1 really compressed: a residual is left
  // A rank-1 matrix goes through rank 1 exactly (after one warm step the power iteration has it).
  const ParamSpec& wte = layout.find("wte.weight");
  auto one = make_powersgd_compressor(*backend, layout, 1, 4);
  Tensor m = Tensor::zeros(backend->allocator(), {layout.total}, DTYPE_F32, MEM_WORKSPACE);
  const int64_t rows = wte.shape[0], cols = wte.shape[1];
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < cols; ++c) m.data<float>()[wte.offset + i * cols + c] = static_cast<float>((i % 7 - 3) * (c % 5 + 1));
  }
  const std::vector<double> rank1 = test::values(m.view(wte.offset, {wte.numel}));
  one->reduce(*comm, m, 0);
  EXPECT_LT(test::max_rel_error(test::values(m.view(wte.offset, {wte.numel})), rank1), 1e-5);
}

}  // namespace
}  // namespace loom
