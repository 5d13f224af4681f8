// GEMMs with rows that are not 16-byte multiples, run in staged panels by the CUDA backend
// (backend/gemm_panels.h), on the simulator against the CPU backend: the three GEMMs of a head
// with an odd vocabulary (GPT-2's 50,257, here 1,001), f32 and bf16 inputs, beta 0 over NaNs (a
// panel left unwritten or not copied back fails), beta 1 with a bias, and the weight gradient's
// panels along the reduction (a panel that does not accumulate fails). The panel limits come
// from LOOM_CUDA_GEMM_PANEL_BYTES / _MIN_FLOPS, set small so that 200 rows make four panels, the
// last a partial one; the same GEMMs with the defaults (too small to stage) give the same values.
// And the MLP's GEMMs with their GELU in cuBLASLt's epilogue (Backend::gemm_gelu / gemm_dgelu).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/backend/cuda/cuda_backend.h"
#include "test_util.h"

namespace loom {
namespace {

constexpr int64_t kRows = 200, kWidth = 96, kVocab = 1001;

struct Case {
  std::string name;
  GemmSpec spec;
  Shape a, b, c;
  bool bias;
};

std::vector<Case> head_cases() {
  return {
      {"logits = x W^T", GemmSpec{false, true, 1.0f, 0.0f, 1}, {kRows, kWidth}, {kVocab, kWidth}, {kRows, kVocab}, false},
      {"logits = 0.5 x W^T + logits + b", GemmSpec{false, true, 0.5f, 1.0f, 1}, {kRows, kWidth}, {kVocab, kWidth},
       {kRows, kVocab}, true},
      {"dx = dlogits W", GemmSpec{false, false, 1.0f, 0.0f, 1}, {kRows, kVocab}, {kVocab, kWidth}, {kRows, kWidth}, false},
      {"dW = dlogits^T x", GemmSpec{true, false, 1.0f, 0.0f, 1}, {kRows, kVocab}, {kRows, kWidth}, {kVocab, kWidth},
       false},
      {"dW += dlogits^T x", GemmSpec{true, false, 1.0f, 1.0f, 1}, {kRows, kVocab}, {kRows, kWidth}, {kVocab, kWidth},
       false},
  };
}

// A host f32 tensor on `backend` in `dtype` (rounded by the CPU backend's cast first).
Tensor upload(Backend& backend, const Tensor& h, DType dtype) {
  CpuAllocator host;
  Tensor cast = h;
  if (dtype != h.dtype()) {
    cast = Tensor::empty(host, h.shape(), dtype, MEM_WORKSPACE);
    make_backend("cpu")->cast(h, cast);
  }
  Tensor d = Tensor::empty(backend.allocator(), h.shape(), dtype, MEM_WORKSPACE);
  backend.write(d, cast.raw_data());
  return d;
}

// The case on `backend` from host inputs (A and B cast to `in`), C read back.
std::vector<double> run(Backend& backend, const Case& c, DType in) {
  CpuAllocator host;
  const Tensor a = upload(backend, test::random_tensor(host, c.a, DTYPE_F32, 1), in);
  const Tensor b = upload(backend, test::random_tensor(host, c.b, DTYPE_F32, 2), in);
  Tensor c0 = test::random_tensor(host, c.c, DTYPE_F32, 3);
  if (c.spec.beta == 0.0f) {
    for (int64_t i = 0; i < c0.numel(); ++i) c0.data<float>()[i] = std::numeric_limits<float>::quiet_NaN();
  }
  const Tensor out = upload(backend, c0, DTYPE_F32);
  const Tensor bias = upload(backend, test::random_tensor(host, {c.c[1]}, DTYPE_F32, 4), DTYPE_F32);
  backend.gemm(a, b, out, c.spec, c.bias ? &bias : nullptr);
  return test::values(backend, out);
}

std::unique_ptr<Backend> cuda_with_panels(const char* bytes, const char* min_flops) {
  setenv("LOOM_CUDA_GEMM_PANEL_BYTES", bytes, 1);
  setenv("LOOM_CUDA_GEMM_PANEL_MIN_FLOPS", min_flops, 1);
  std::unique_ptr<Backend> backend = make_backend("cuda");
  unsetenv("LOOM_CUDA_GEMM_PANEL_BYTES");
  unsetenv("LOOM_CUDA_GEMM_PANEL_MIN_FLOPS");
  return backend;
}

TEST(CudaSimGemmPanels, HeadGemmsWithOddRowsInPanelsMatchTheCpu) {
  std::unique_ptr<Backend> cpu = make_backend("cpu");
  std::unique_ptr<Backend> panels = cuda_with_panels("1", "0");  // 64-row panels
  std::unique_ptr<Backend> whole = make_backend("cuda");         // defaults: these GEMMs are too small
  int64_t staged = 0;
  for (DType in : {DTYPE_F32, DTYPE_BF16}) {
    for (const Case& c : head_cases()) {
      SCOPED_TRACE(c.name + " " + std::string(dtype_name(in)));
      const std::vector<double> ref = run(*cpu, c, in);
      const std::vector<double> got = run(*panels, c, in);
      for (double x : got) ASSERT_TRUE(std::isfinite(x));
      EXPECT_LT(test::max_rel_error(got, ref), 1e-5);  // f32 accumulation in another order
      EXPECT_LT(test::max_rel_error(run(*whole, c, in), ref), 1e-5);
      EXPECT_EQ(cuda_panel_gemms(*panels), ++staged) << "the GEMM was not staged";
    }
  }
  EXPECT_EQ(cuda_panel_gemms(*whole), 0);
}

TEST(CudaSimGemmPanels, AMalformedLimitIsAOneLineError) {
  setenv("LOOM_CUDA_GEMM_PANEL_BYTES", "128MiB", 1);
  try {
    (void)make_backend("cuda");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("environment variable LOOM_CUDA_GEMM_PANEL_BYTES='128MiB': expected a whole number from 0 to "),
              std::string::npos)
        << e.what();
  }
  unsetenv("LOOM_CUDA_GEMM_PANEL_BYTES");
}

// Backend::gemm_gelu / gemm_dgelu on CUDA take cuBLASLt's GELU epilogues (GELU_AUX_BIAS, DGELU)
// for bf16 operands whose rows are multiples of 8 elements, and run the GEMM then the GELU kernel
// otherwise (odd columns: aux's leading dimension; f32 operands). Both ways within a bf16 step of
// the largest element (2^-7 of it) of the CPU, which runs the two ops (test_backend_ops.cpp compares
// values on every backend; this test shows which way each call went).
TEST(CudaSimGemmPanels, TheMlpGeluRunsInTheGemmEpilogueWhereItCan) {
  std::unique_ptr<Backend> cpu = make_backend("cpu");
  std::unique_ptr<Backend> cuda = make_backend("cuda");
  CpuAllocator host;
  struct Shape3 {
    int64_t m, n, k;
    DType in;
    bool fused;
  };
  int64_t fused = 0;
  for (const Shape3& c : {Shape3{48, 64, 32, DTYPE_BF16, true}, Shape3{48, 60, 32, DTYPE_BF16, false},
                          Shape3{48, 64, 32, DTYPE_F32, false}}) {
    SCOPED_TRACE(str_cat(c.m, " x ", c.n, " x ", c.k, " ", dtype_name(c.in)));
    std::vector<std::vector<double>> outs[2];
    for (int which = 0; which < 2; ++which) {
      Backend& be = which == 0 ? *cpu : *cuda;
      const Tensor a = upload(be, test::random_tensor(host, {c.m, c.k}, DTYPE_F32, 1, 0.6), c.in);
      const Tensor w = upload(be, test::random_tensor(host, {c.n, c.k}, DTYPE_F32, 2, 0.6), c.in);
      const Tensor bias = upload(be, test::random_tensor(host, {c.n}, DTYPE_F32, 3), DTYPE_F32);
      const DType out = c.in == DTYPE_BF16 ? DTYPE_BF16 : DTYPE_F32;
      const Tensor pre = Tensor::empty(be.allocator(), {c.m, c.n}, out, MEM_WORKSPACE);
      const Tensor act = Tensor::empty(be.allocator(), {c.m, c.n}, out, MEM_WORKSPACE);
      const Tensor dx = Tensor::empty(be.allocator(), {c.m, c.n}, out, MEM_WORKSPACE);
      const Tensor scratch = Tensor::empty(be.allocator(), {c.m, c.n}, DTYPE_F32, MEM_WORKSPACE);
      be.gemm_gelu(a, w, pre, act, GemmSpec{false, true, 1.0f, 0.0f, 1}, &bias);
      be.gemm_dgelu(a, w, pre, scratch, dx, GemmSpec{false, true, 1.0f, 0.0f, 1});
      for (const Tensor* t : {&pre, &act, &dx}) {  // widened from bf16 by the CPU's cast
        Tensor h = Tensor::empty(host, t->shape(), t->dtype(), MEM_WORKSPACE), f = h;
        be.read(*t, h.raw_data());
        if (h.dtype() == DTYPE_BF16) f = Tensor::empty(host, t->shape(), DTYPE_F32, MEM_WORKSPACE), cpu->cast(h, f);
        outs[which].push_back(test::values(f));
      }
    }
    for (size_t i = 0; i < 3; ++i) EXPECT_LE(test::max_rel_error(outs[1][i], outs[0][i]), 1.0 / 128) << "output " << i;
    if (c.fused) fused += 2;
    EXPECT_EQ(cuda_gelu_epilogue_gemms(*cuda), fused) << (c.fused ? "not fused" : "fused where it should not be");
  }
}

}  // namespace
}  // namespace loom
