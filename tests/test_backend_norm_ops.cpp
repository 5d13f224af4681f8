// The per-head RMSNorm ops of the Backend interface (backend.h: head_rmsnorm_forward,
// head_rmsnorm_backward; Qwen3's q_norm / k_norm), in the manner of test_backend_parallel_ops.cpp:
// each case builds inputs in host memory, runs forward then backward on the backend under test
// (copies written with Backend::write, read back with Backend::read) and on the CPU backend, and
// compares every output (x normalized in place, in, rstd, d(in) in place of d(out), dweight),
// then checks the CPU's results against a naive double reference written here from the contract.
// The columns of x and dx outside the normalized heads must stay as they were, and a second
// backward from the same inputs must give the same bytes (dweight is a fixed-order sum).
// Tolerances: max |x - ref| / max |ref| of 1e-5 for f32 and 1e-12 for f64, as the other op tests.
// Backends: "strict" (the CPU kernels on memory host code may not read, tests/strict_backend.h;
// it runs although it does not state head_norm) and "cuda", skipped where the build has no CUDA
// backend, no GPU is visible or the backend does not state capabilities().head_norm.
// At the end, in the cross-backend op suite (backend_ops_fixture.h), the paths of the CUDA
// model-parallel kernels that test_backend_parallel_ops.cpp's shapes do not reach: ring
// attention with head_dim above a warp's 32 lanes, and the float4 paths of the vocab embedding
// and add_positions (C a multiple of 4); against the CPU backend.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend_ops_fixture.h"
#include "loom/backend/backend.h"
#include "loom/core/error.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

double tol_of(DType dtype) { return dtype == DTYPE_F64 ? 1e-12 : 1e-5; }

// One problem: x (B, T, W) with W = heads hd; heads [first, first + n) normalized.
struct HeadCase {
  int64_t B, T, heads, first, n, hd;
};

// The host inputs of a case and the outputs one backend produced from them.
using Values = std::map<std::string, std::vector<double>>;

class BackendNormOpsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string skip;
    backend_ = test::op_test_backend(GetParam(), &BackendCapabilities::head_norm, &skip);
    if (!backend_) GTEST_SKIP() << skip;
  }

  // A copy of host tensor h in backend's memory.
  static Tensor upload(Backend& backend, const Tensor& h) {
    Tensor t = Tensor::empty(backend.allocator(), h.shape(), h.dtype(), MEM_WORKSPACE);
    backend.write(t, h.raw_data());
    return t;
  }

  Tensor nans(const Shape& shape, DType dtype) {
    Tensor t = Tensor::empty(host_, shape, dtype, MEM_WORKSPACE);
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (dtype == DTYPE_F64) t.data<double>()[i] = std::numeric_limits<double>::quiet_NaN();
      else t.data<float>()[i] = std::numeric_limits<float>::quiet_NaN();
    }
    return t;
  }

  // Forward then backward on `backend` from the host inputs; the outputs by name. `deterministic`:
  // the backward runs a second time from the same inputs and must give the same bytes.
  Values run(Backend& backend, const HeadCase& c, const std::map<std::string, Tensor>& in, float eps,
             bool deterministic = false) {
    const Tensor x = upload(backend, in.at("x"));
    const Tensor w = upload(backend, in.at("weight"));
    const Tensor saved = upload(backend, in.at("in"));
    const Tensor rstd = upload(backend, in.at("rstd"));
    backend.head_rmsnorm_forward(x, w, c.first, c.n, c.hd, eps, saved, rstd);
    Values out;
    out["out"] = test::values(backend, x);
    out["in"] = test::values(backend, saved);
    out["rstd"] = test::values(backend, rstd);
    std::vector<uint8_t> first_dx, first_dw;
    for (int pass = 0; pass < (deterministic ? 2 : 1); ++pass) {
      const Tensor dx = upload(backend, in.at("dx"));
      const Tensor dw = upload(backend, in.at("dweight"));
      backend.head_rmsnorm_backward(dx, saved, w, rstd, c.first, c.n, c.hd, dw);
      std::vector<uint8_t> dx_bytes(dx.nbytes()), dw_bytes(dw.nbytes());
      backend.read(dx, dx_bytes.data());
      backend.read(dw, dw_bytes.data());
      if (pass == 0) {
        out["dx"] = test::values(backend, dx);
        out["dweight"] = test::values(backend, dw);
        first_dx = std::move(dx_bytes);
        first_dw = std::move(dw_bytes);
      } else {
        EXPECT_TRUE(first_dx == dx_bytes) << "dx differs between two runs from the same inputs";
        EXPECT_TRUE(first_dw == dw_bytes) << "dweight differs between two runs from the same inputs";
      }
    }
    return out;
  }

  CpuAllocator host_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
};

// The naive double reference of the contract (backend.h): out, in, rstd, dx, dweight.
Values naive(const HeadCase& c, const std::map<std::string, Tensor>& in, double eps) {
  const std::vector<double> x = test::values(in.at("x")), w = test::values(in.at("weight")),
                            g = test::values(in.at("dx"));
  Values r;
  r["out"] = x;
  r["dx"] = g;
  r["dweight"] = test::values(in.at("dweight"));
  r["in"].assign(static_cast<size_t>(c.B * c.T * c.n * c.hd), 0.0);
  r["rstd"].assign(static_cast<size_t>(c.B * c.T * c.n), 0.0);
  const int64_t W = c.heads * c.hd;
  for (int64_t tok = 0; tok < c.B * c.T; ++tok) {
    for (int64_t j = 0; j < c.n; ++j) {
      const int64_t row = tok * c.n + j, off = tok * W + (c.first + j) * c.hd;
      double ss = 0.0;
      for (int64_t e = 0; e < c.hd; ++e) ss += x[off + e] * x[off + e];
      const double s = 1.0 / std::sqrt(ss / static_cast<double>(c.hd) + eps);
      r["rstd"][row] = s;
      double sum_gx = 0.0;
      for (int64_t e = 0; e < c.hd; ++e) {
        r["in"][row * c.hd + e] = x[off + e];
        r["out"][off + e] = x[off + e] * s * w[e];
        r["dweight"][e] += g[off + e] * x[off + e] * s;
        sum_gx += g[off + e] * w[e] * x[off + e] * s;
      }
      const double mean_gx = sum_gx / static_cast<double>(c.hd);
      for (int64_t e = 0; e < c.hd; ++e) r["dx"][off + e] = s * (g[off + e] * w[e] - x[off + e] * s * mean_gx);
    }
  }
  return r;
}

// q/k norm shapes: a few heads in the middle of a wider row (hd 16), heads of a width that is not
// a multiple of the warp (hd 40, all heads), and one spanning several dweight chunks (640 rows).
TEST_P(BackendNormOpsTest, HeadRmsNormForwardBackwardMatchCpuAndReference) {
  const std::vector<HeadCase> cases = {{2, 5, 7, 2, 3, 16}, {1, 3, 4, 0, 4, 40}, {2, 80, 5, 1, 4, 64}};
  const float eps = 1e-6f;
  for (DType dtype : {DTYPE_F32, DTYPE_F64}) {
    for (const HeadCase& c : cases) {
      const std::string what = str_cat("head_rmsnorm ", dtype_name(dtype), " (", c.B, ", ", c.T, ", ", c.heads, " x ",
                                        c.hd, ") heads [", c.first, ", ", c.first + c.n, ")");
      std::map<std::string, Tensor> in;
      in["x"] = test::random_tensor(host_, {c.B, c.T, c.heads * c.hd}, dtype, 31, 2.0);
      in["weight"] = test::random_tensor(host_, {c.hd}, dtype, 32);
      in["dx"] = test::random_tensor(host_, {c.B, c.T, c.heads * c.hd}, dtype, 33);
      in["dweight"] = test::random_tensor(host_, {c.hd}, dtype, 34);
      in["in"] = nans({c.B, c.T, c.n * c.hd}, dtype);
      in["rstd"] = nans({c.B, c.T, c.n}, dtype);

      const Values got = run(*backend_, c, in, eps, true);
      const Values cpu = run(*cpu_, c, in, eps);
      const Values ref = naive(c, in, static_cast<double>(eps));
      const double t = tol_of(dtype);
      for (const char* name : {"out", "in", "rstd", "dx", "dweight"}) {
        EXPECT_LE(test::max_rel_error(got.at(name), cpu.at(name)), t) << what << ": " << name << " vs the CPU";
        EXPECT_LE(test::max_rel_error(cpu.at(name), ref.at(name)), t) << what << ": " << name << " (CPU) vs naive";
      }
      // The columns outside the heads are untouched, bitwise.
      const std::vector<double> x = test::values(in.at("x")), g = test::values(in.at("dx"));
      const int64_t W = c.heads * c.hd;
      for (int64_t i = 0; i < c.B * c.T * W; ++i) {
        const int64_t head = (i % W) / c.hd;
        if (head >= c.first && head < c.first + c.n) continue;
        ASSERT_EQ(got.at("out")[i], x[i]) << what << ": x changed outside the heads at " << i;
        ASSERT_EQ(got.at("dx")[i], g[i]) << what << ": dx changed outside the heads at " << i;
      }
    }
  }
}

// Operands that do not fit are refused with one line naming the op.
TEST_P(BackendNormOpsTest, HeadRmsNormRefusesOperandsThatDoNotFit) {
  Backend& be = *backend_;
  const Tensor x = Tensor::empty(be.allocator(), {2, 3, 64}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor w = Tensor::empty(be.allocator(), {16}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor in = Tensor::empty(be.allocator(), {2, 3, 48}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor rstd = Tensor::empty(be.allocator(), {2, 3, 3}, DTYPE_F32, MEM_WORKSPACE);
  const std::string past = test::error_of([&] { be.head_rmsnorm_forward(x, w, 2, 3, 16, 1e-6f, in, rstd); });
  EXPECT_NE(past.find("head_rmsnorm_forward"), std::string::npos) << past;
  const Tensor dw = Tensor::empty(be.allocator(), {8}, DTYPE_F32, MEM_WORKSPACE);
  const std::string bad_dw = test::error_of([&] { be.head_rmsnorm_backward(x, in, w, rstd, 0, 3, 16, dw); });
  EXPECT_NE(bad_dw.find("head_rmsnorm_backward"), std::string::npos) << bad_dw;
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendNormOpsTest, ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace loom

namespace loom::backend_ops_test {

TEST_P(BackendOpsTest, ModelParallelWideRowsMatchTheCpu) {
  if (GetParam() != "strict" && !backend_->capabilities().model_parallel) {
    GTEST_SKIP() << backend_->name() << " lacks model parallelism (its defaults throw)";
  }
  // Ring attention: head_dim 48 (lanes 16 .. 31 idle in the second pass of a row) and 64, GQA
  // group 2, on rank 1 of 2 and rank 0 of 2.
  struct RingCase {
    int64_t B, Tl, H, KV, hd;
    int r, N;
  };
  for (DType dtype : kFloatTypes) {
    for (const RingCase& c : {RingCase{1, 6, 4, 2, 48, 1, 2}, RingCase{2, 4, 2, 1, 64, 0, 2}}) {
      Operands x;
      x.tensors["q"] = rnd({c.B, c.Tl, c.H * c.hd}, dtype, 41);
      x.tensors["dout"] = rnd({c.B, c.Tl, c.H * c.hd}, dtype, 42);
      x.tensors["dq"] = rnd({c.B, c.Tl, c.H * c.hd}, dtype, 43);
      for (int o = 0; o < c.N; ++o) {
        const char* names[] = {"k", "v", "dk", "dv"};
        for (uint64_t n = 0; n < 4; ++n) {
          x.tensors[str_cat(names[n], o)] = rnd({c.B, c.Tl, c.KV * c.hd}, dtype, 50 + 4 * static_cast<uint64_t>(o) + n);
        }
      }
      x.tensors["out"] = nans({c.B, c.Tl, c.H * c.hd}, dtype);
      for (const char* name : {"lse", "l", "D"}) x.tensors[name] = nans({c.B, c.H, c.Tl}, dtype);
      x.tensors["scratch"] = nans({omp_get_max_threads() * c.Tl}, dtype);
      const Op op = [&](Backend& be, Operands& o) {
        be.fill(o["out"], 0.0);
        be.fill(o["lse"], -kInf);
        be.fill(o["l"], 0.0);
        for (int s = 0; s < c.N; ++s) {
          const int owner = (c.r - s + c.N) % c.N;
          be.ring_attention_merge(o["q"], o[str_cat("k", owner)], o[str_cat("v", owner)], o["out"], o["lse"], o["l"],
                                  o["scratch"], RingBlock{c.H, c.KV, c.r, c.N, owner});
        }
        be.ring_attention_finish(o["out"], o["lse"], o["l"], c.H);
        be.attention_row_dot(o["dout"], o["out"], o["D"], c.H);
        for (int owner = 0; owner < c.N; ++owner) {
          be.ring_attention_block_backward(o["q"], o["dout"], o["lse"], o["D"], o[str_cat("k", owner)],
                                           o[str_cat("v", owner)], o["dq"], o[str_cat("dk", owner)],
                                           o[str_cat("dv", owner)], RingBlock{c.H, c.KV, c.r, c.N, owner});
        }
      };
      const Tol tol = reduction_tol(dtype);
      std::vector<Output> outputs = {{"out", tol}, {"lse", tol}, {"D", tol}, {"dq", tol}};
      for (int o = 0; o < c.N; ++o) {
        outputs.push_back({str_cat("dk", o), tol});
        outputs.push_back({str_cat("dv", o), tol});
      }
      check(str_cat("ring attention ", dt(dtype), " head_dim ", c.hd, " rank ", c.r, " of ", c.N), x, op, outputs,
            true);
    }
  }
  // The vocab embedding and positions with C = 64 (float4 rows).
  const int64_t B = 2, T = 5, C = 64, V = 40, Vs = 24, begin = 20, valid = 20, Tmax = 9, first = 3;
  Operands x;
  x.tensors["tokens"] = ids({B, T}, V, 61);
  x.tensors["weight"] = rnd({Vs, C}, DTYPE_F32, 62);
  x.tensors["positions"] = rnd({Tmax, C}, DTYPE_F32, 63);
  x.tensors["dout"] = rnd({B, T, C}, DTYPE_F32, 64);
  x.tensors["out"] = nans({B, T, C}, DTYPE_F32);
  x.tensors["dweight"] = rnd({Vs, C}, DTYPE_F32, 65);
  x.tensors["dpositions"] = rnd({Tmax, C}, DTYPE_F32, 66);
  const Op op = [&](Backend& be, Operands& o) {
    be.vocab_embedding_forward(o["tokens"], o["weight"], begin, valid, o["out"]);
    be.add_positions(o["out"], o["positions"], first);
    be.vocab_embedding_backward(o["tokens"], o["dout"], o["dweight"], begin, valid);
    be.positions_backward(o["dout"], o["dpositions"], first);
  };
  const Tol tol = elementwise_tol(DTYPE_F32);
  check("vocab embedding (B 2, T 5, C 64, rows [20, 40))", x, op, {{"out", tol}, {"dweight", tol}, {"dpositions", tol}},
        true);
}

}  // namespace loom::backend_ops_test
