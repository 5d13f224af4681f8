// The soft-target loss of the Backend interface (backend.h: soft_target_loss, the distillation
// loss of Hinton, Vinyals and Dean 2015), in the manner of test_backend_optim_ops.cpp: each case
// builds random logits and teacher logits in host memory, runs the op on the CPU backend and on the
// backend under test (copies written with Backend::write, read back with Backend::read) and
// compares losses and grad:
//   - with the CPU's, within kCpuTol of max |cpu| (the row sums are in double on both, but in
//     another order on a GPU: a fixed tree there, the CPU's loop here, so an ulp may differ);
//   - with a naive double reference written here from the contract, within 1e-5 of max |ref|.
// The outputs start as NaN on the backend under test, so an element it skips cannot pass; a second
// run gives the same bytes (the sums have a fixed order); the teacher against itself gives zero
// loss and zero gradient; a bad operand throws one line naming the op.
// Backends: "strict" (the CPU kernel on memory host code may not read), and "cuda", skipped where the build has no CUDA
// backend, no GPU is visible or the backend does not state capabilities().every_optimizer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/error.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

constexpr double kRefTol = 1e-5;  // f32 results against the double reference, relative to max |ref|
constexpr double kCpuTol = 1e-6;  // against the CPU backend's results (another summation order)

// The contract in double for one row: losses = T^2 KL(p_t || p_s), grad = grad_scale T (p_s - p_t).
void reference_row(const double* s, const double* t, int64_t V, double T, double grad_scale, double* loss, double* grad) {
  double ms = -1e300, mt = -1e300;
  for (int64_t v = 0; v < V; ++v) ms = std::max(ms, s[v] / T), mt = std::max(mt, t[v] / T);
  double zs = 0, zt = 0;
  for (int64_t v = 0; v < V; ++v) zs += std::exp(s[v] / T - ms), zt += std::exp(t[v] / T - mt);
  double kl = 0;
  for (int64_t v = 0; v < V; ++v) {
    const double lps = s[v] / T - ms - std::log(zs), lpt = t[v] / T - mt - std::log(zt);
    kl += std::exp(lpt) * (lpt - lps);
    grad[v] = grad_scale * T * (std::exp(lps) - std::exp(lpt));
  }
  *loss = T * T * kl;
}

double max_rel_error(const std::vector<double>& got, const std::vector<double>& want) {
  double scale = 1e-30, err = 0.0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) err = std::max(err, std::isfinite(got[i]) ? std::abs(got[i] - want[i]) : 1e30);
  return err / scale;
}

class BackendLossOpsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string skip;
    backend_ = test::op_test_backend(GetParam(), &BackendCapabilities::every_optimizer, &skip);
    if (!backend_) GTEST_SKIP() << skip;
  }

  struct Result {
    std::vector<float> losses, grad;
  };

  // The op on `backend` with copies of the inputs; the outputs start as NaN.
  Result run(Backend& backend, const Tensor& s, const Tensor& t, float temperature, float grad_scale) {
    const int64_t V = s.dim(-1), N = s.numel() / V;
    Tensor ds = Tensor::empty(backend.allocator(), s.shape(), DTYPE_F32, MEM_WORKSPACE);
    Tensor dt = Tensor::empty(backend.allocator(), t.shape(), DTYPE_F32, MEM_WORKSPACE);
    Tensor losses = Tensor::empty(backend.allocator(), {N}, DTYPE_F32, MEM_WORKSPACE);
    Tensor grad = Tensor::empty(backend.allocator(), s.shape(), DTYPE_F32, MEM_WORKSPACE);
    backend.write(ds, s.raw_data());
    backend.write(dt, t.raw_data());
    const std::vector<float> nan_rows(static_cast<size_t>(N), std::numeric_limits<float>::quiet_NaN());
    const std::vector<float> nan_grad(static_cast<size_t>(N * V), std::numeric_limits<float>::quiet_NaN());
    backend.write(losses, nan_rows.data());
    backend.write(grad, nan_grad.data());
    backend.soft_target_loss(ds, dt, temperature, grad_scale, losses, grad);
    Result r{std::vector<float>(static_cast<size_t>(N)), std::vector<float>(static_cast<size_t>(N * V))};
    backend.read(losses, r.losses.data());
    backend.read(grad, r.grad.data());
    return r;
  }

  Tensor f32(Shape shape, uint64_t seed, double scale) { return test::random_tensor(host_, std::move(shape), DTYPE_F32, seed, scale); }

  // Compares the backend under test with the CPU and with the double reference.
  void check(const std::string& what, const Tensor& s, const Tensor& t, float temperature, float grad_scale) {
    const int64_t V = s.dim(-1), N = s.numel() / V;
    const Result cpu = run(*cpu_, s, t, temperature, grad_scale);
    const Result got = run(*backend_, s, t, temperature, grad_scale);
    const std::vector<double> sv = test::values(s), tv = test::values(t);
    std::vector<double> ref_losses(static_cast<size_t>(N)), ref_grad(static_cast<size_t>(N * V));
    for (int64_t i = 0; i < N; ++i) {
      reference_row(sv.data() + i * V, tv.data() + i * V, V, temperature, grad_scale, &ref_losses[i], ref_grad.data() + i * V);
    }
    const auto as_double = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
    EXPECT_LE(max_rel_error(as_double(got.losses), as_double(cpu.losses)), kCpuTol) << what << ": losses against the CPU";
    EXPECT_LE(max_rel_error(as_double(got.grad), as_double(cpu.grad)), kCpuTol) << what << ": grad against the CPU";
    EXPECT_LE(max_rel_error(as_double(got.losses), ref_losses), kRefTol) << what << ": losses against the double reference";
    EXPECT_LE(max_rel_error(as_double(got.grad), ref_grad), kRefTol) << what << ": grad against the double reference";
    const Result again = run(*backend_, s, t, temperature, grad_scale);
    EXPECT_EQ(std::memcmp(again.losses.data(), got.losses.data(), got.losses.size() * sizeof(float)), 0) << what << ": losses, second run";
    EXPECT_EQ(std::memcmp(again.grad.data(), got.grad.data(), got.grad.size() * sizeof(float)), 0) << what << ": grad, second run";
  }

  CpuAllocator host_;
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  std::unique_ptr<Backend> backend_;
};

TEST_P(BackendLossOpsTest, SoftTargetLossMatchesTheCpuAndTheDoubleKl) {
  // Rows shorter than a block, rows over a block (V > 256: every thread holds several elements),
  // and a 3-D operand (rows = all but the last dimension).
  for (const float T : {1.0f, 2.5f}) {
    check("(6, 37) T " + std::to_string(T), f32({6, 37}, 1, 3.0), f32({6, 37}, 2, 3.0), T, 0.25f);
    check("(3, 1000) T " + std::to_string(T), f32({3, 1000}, 3, 4.0), f32({3, 1000}, 4, 4.0), T, 1.5f);
  }
  check("(2, 3, 129)", f32({2, 3, 129}, 5, 2.0), f32({2, 3, 129}, 6, 2.0), 4.0f, 1.0f);
}

TEST_P(BackendLossOpsTest, SoftTargetLossOfTheTeacherItselfIsZero) {
  const Tensor t = f32({4, 300}, 7, 5.0);
  const Result got = run(*backend_, t, t, 2.0f, 1.0f);
  for (const float l : got.losses) EXPECT_NEAR(l, 0.0f, 1e-6f);
  for (const float g : got.grad) ASSERT_NEAR(g, 0.0f, 1e-7f);
}

TEST_P(BackendLossOpsTest, SoftTargetLossRefusesBadOperands) {
  Allocator& a = backend_->allocator();
  const Tensor s = Tensor::empty(a, {4, 10}, DTYPE_F32, MEM_WORKSPACE), t = Tensor::empty(a, {4, 10}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor grad = Tensor::empty(a, {4, 10}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor short_t = Tensor::empty(a, {4, 9}, DTYPE_F32, MEM_WORKSPACE), losses = Tensor::empty(a, {4}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor bad_losses = Tensor::empty(a, {3}, DTYPE_F32, MEM_WORKSPACE), f64 = Tensor::empty(a, {4, 10}, DTYPE_F64, MEM_WORKSPACE);
  const auto throws = [&](const Tensor& s_, const Tensor& t_, float T, const Tensor& l_, const Tensor& g_, const char* what) {
    try {
      backend_->soft_target_loss(s_, t_, T, 1.0f, l_, g_);
      ADD_FAILURE() << what << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("soft_target_loss"), std::string::npos) << what << ": " << e.what();
    }
  };
  throws(s, short_t, 1.0f, losses, grad, "teacher of another size");
  throws(s, t, 1.0f, bad_losses, grad, "losses not one per row");
  throws(s, t, 0.0f, losses, grad, "temperature 0");
  throws(f64, t, 1.0f, losses, grad, "f64 logits");
}

// Beside the loss: shapes test_backend_optim_ops.cpp's cases do not reach on the CUDA kernels
// (cuda_optim.cu), compared bitwise with the CPU as that file does. Its sums "in double, in order"
// span one shared tile (1024 terms) there; here Adam-mini's blocks and Newton-Schulz's matrix span
// several. Its operands are whole allocations (16-byte aligned: the float4 path); here they are
// views one float in (the scalar path). Operands: host tensors, copied in and out.
TEST_P(BackendLossOpsTest, OptimizerOpsOverManyTilesAndUnalignedViews) {
  using Tensors = std::vector<Tensor>;
  const auto run_on = [&](Backend& backend, const Tensors& in, int64_t offset,
                          const std::function<void(Backend&, const Tensors&)>& op) {
    Tensors dev, views, out;
    for (const Tensor& t : in) {
      dev.push_back(Tensor::empty(backend.allocator(), {t.numel() + offset}, DTYPE_F32, MEM_WORKSPACE));
      views.push_back(dev.back().view(offset, t.shape()));
      backend.write(views.back(), t.raw_data());
    }
    op(backend, views);
    for (const Tensor& v : views) {
      out.push_back(Tensor::empty(host_, v.shape(), DTYPE_F32, MEM_WORKSPACE));
      backend.read(v, out.back().raw_data());
    }
    return out;
  };
  const auto same = [&](const std::string& what, const Tensors& in, int64_t offset,
                        const std::function<void(Backend&, const Tensors&)>& op) {
    const Tensors cpu = run_on(*cpu_, in, offset, op), got = run_on(*backend_, in, offset, op);
    for (size_t k = 0; k < in.size(); ++k) {  // the same bits, or NaN on both
      int64_t differ = 0;
      for (int64_t i = 0; i < in[k].numel(); ++i) {
        const float a = cpu[k].data<float>()[i], b = got[k].data<float>()[i];
        differ += std::isnan(a) && std::isnan(b) ? 0 : std::memcmp(&a, &b, sizeof(float)) != 0;
      }
      EXPECT_EQ(differ, 0) << what << " (view offset " << offset << "): operand " << k << " differs from the CPU's";
    }
  };
  OptimHyper h;
  h.lr = 0.01, h.weight_decay = 0.1f, h.grad_scale = 0.8f, h.step = 3, h.beta1 = 0.9, h.beta2 = 0.99;
  const int64_t blocks = 3, bn = 2500;  // 2.4 tiles per block
  for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
    same("adam_mini_step", {f32({blocks * bn}, 10, 1.0), f32({blocks * bn}, 11, 1.0), f32({blocks * bn}, 12, 0.1), f32({blocks}, 13, 0.01)},
         offset, [&](Backend& b, const Tensors& t) { b.adam_mini_step(t[0], t[1], t[2], t[3], h); });
    same("newton_schulz_normalize", {f32({70, 50}, 14, 1.0), f32({70 * 50}, 15, 1.0)}, offset,
         [](Backend& b, const Tensors& t) { b.newton_schulz_normalize(t[0], t[1]); });
    same("adam_step", {f32({1001}, 16, 1.0), f32({1001}, 17, 1.0), f32({1001}, 18, 0.1), f32({1001}, 19, 0.01), f32({1001}, 20, 0.01)},
         offset, [&](Backend& b, const Tensors& t) { b.adam_step(t[0], t[1], t[2], t[3], t[4], h); });
    same("scale_transpose", {f32({37, 70}, 21, 1.0), f32({37 * 70}, 22, 1.0)}, offset,
         [](Backend& b, const Tensors& t) { b.scale_transpose(t[0], t[1], 0.5f, true); });
  }
  // A NaN among the terms: the tree's bound cannot decide, so the ordered sum runs (and gives NaN
  // for that block or matrix only).
  Tensor g = f32({blocks * bn}, 23, 1.0), u = f32({70, 50}, 24, 1.0);
  g.data<float>()[bn + 7] = std::numeric_limits<float>::quiet_NaN();
  u.data<float>()[100] = std::numeric_limits<float>::quiet_NaN();
  same("adam_mini_step, a NaN in block 1", {f32({blocks * bn}, 25, 1.0), g, f32({blocks * bn}, 26, 0.1), f32({blocks}, 27, 0.01)}, 0,
       [&](Backend& b, const Tensors& t) { b.adam_mini_step(t[0], t[1], t[2], t[3], h); });
  same("newton_schulz_normalize, a NaN", {u, f32({70 * 50}, 28, 1.0)}, 0,
       [](Backend& b, const Tensors& t) { b.newton_schulz_normalize(t[0], t[1]); });
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendLossOpsTest, ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace loom
