// Every op of the Backend interface on every backend, against the CPU backend (the idea of ggml's
// test-backend-ops). Each case builds random inputs in host memory, runs the op on the CPU backend
// with host tensors, copies the same inputs into the backend under test (Backend::write), runs it
// there, reads the outputs back (Backend::read) and compares them. Backends:
//   "strict" the CPU kernels on memory host code may not read (tests/strict_backend.h): checks
//            that the ops reach their operands only through the backend, and this test itself;
//   "cuda"   skipped where the build has no CUDA backend or no GPU is visible, unless
//            LOOM_REQUIRE_CUDA=1 (the GPU script sets it), which turns the skip into a failure.
// Shapes: odd ones (T = 17, C = 37, V = 101, ...) plus one larger shape per op class that spans
// many thread blocks (rows 4096 x C 768 for norms, V 50257 for cross-entropy, T 256 x hd 64 for
// attention, n = 2^20 for reductions and AdamW).
//
// Tolerances: max |x - ref| / max |ref| over an output (the error relative to the output's scale,
// as test_util.h's max_rel_error), where a NaN or an infinity the reference does not have fails:
//   f64, every op; the double results of sum / sum_squares (relative to sum |x|, sum x^2) ... 1e-12
//   f32 elementwise, embedding, norms, RoPE, activations, AdamW ............................. 1e-5
//   f32 GEMM, attention (both kernels) and cross-entropy: another summation order on a GPU .. 1e-5
//   bf16 x bf16 -> f32 GEMM: the same bf16 inputs, products exact in fp32, fp32 accumulation .. 1e-5
//   fill, copy and every cast (f32 -> bf16 round to nearest even, bf16 -> f32, f32 <-> f64) .. bitwise
// Outputs an op must overwrite (out, dx, probs, lse, losses, C when beta = 0) start as NaN, so an
// element a kernel skips cannot pass; gradients that accumulate (dweight, dbias, dtable) start as
// noise. Ops that accumulate (sum, sum_squares, bias_backward, embedding_backward, the norms'
// backwards, both attention backwards) must also be deterministic: a second run from the same
// inputs gives the same bytes. A bad token id (embedding) or target (cross-entropy) must throw a
// loom::Error naming the op on both backends. Each test records its worst error per output and
// dtype with RecordProperty ("max_rel_error_dqkv_f32", --gtest_output=json) and, off the strict
#pragma once
// backend, prints it ("[ errors   ] ..." lines).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iomanip>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/error.h"
#include "strict_backend.h"
#include "test_util.h"


// The fixture and helpers of the cross-backend op tests (test_backend_ops.cpp: GEMM, elementwise,
// casts, reductions, embedding; test_backend_ops_nn.cpp: norms, activations, RoPE, attention,
// cross-entropy, AdamW, bad ids; test_backend_parallel_ops.cpp: the model-parallel ops). One
// named namespace, so every file adds tests to one suite.
namespace loom::backend_ops_test {

using test::error_of;
using test::random_tensor;
using test::random_tokens;

// ---------------------------------------------------------------- tolerances

struct Tol {
  double rel = 0.0;      // max |x - ref| / max |ref|
  bool bitwise = false;  // the same bytes
};
constexpr double kF64Tol = 1e-12;
constexpr double kF32ElementwiseTol = 1e-5;  // elementwise, embedding, norms, RoPE, activations, AdamW
constexpr double kF32ReductionTol = 1e-5;    // GEMM, attention, cross-entropy (relative to the output's scale)
constexpr double kBf16GemmTol = 1e-5;        // bf16 inputs, fp32 accumulation
constexpr Tol kBitwise{0.0, true};

inline Tol elementwise_tol(DType dtype) { return {dtype == DTYPE_F64 ? kF64Tol : kF32ElementwiseTol}; }
inline Tol reduction_tol(DType dtype) { return {dtype == DTYPE_F64 ? kF64Tol : kF32ReductionTol}; }

constexpr double kInf = std::numeric_limits<double>::infinity();
inline const std::vector<DType> kFloatTypes = {DTYPE_F32, DTYPE_F64};

inline std::string dt(DType dtype) { return std::string(dtype_name(dtype)); }

// "1.23e-07": an error figure for RecordProperty.
inline std::string scientific(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2e", x);
  return buf;
}

// ---------------------------------------------------------------- operands and the comparison

// The operands of one op call, by name: tensors (inputs, outputs or both) and the host values an
// op returns (sum, sum_squares).
struct Operands {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, double> scalars;
  const Tensor& operator[](const std::string& name) const {
    const auto it = tensors.find(name);
    LOOM_CHECK(it != tensors.end(), "no operand named ", name);
    return it->second;
  }
};

// Runs one op (or a forward and its backward) on a backend, with that backend's copies of the operands.
using Op = std::function<void(Backend&, Operands&)>;

// An operand to compare after the op. scale: for a scalar, what its error is relative to (0: |ref|).
struct Output {
  std::string name;
  Tol tol;
  double scale = 0.0;
};

inline std::vector<uint8_t> bytes_of(Backend& backend, const Tensor& t) {
  std::vector<uint8_t> bytes(t.nbytes());
  backend.read(t, bytes.data());
  return bytes;
}

// A tensor's bytes (bytes_of) as doubles: f32, f64, or bf16 widened exactly.
inline std::vector<double> values_of(const std::vector<uint8_t>& bytes, DType dtype) {
  const size_t width = dtype_size(dtype), n = bytes.size() / width;
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* p = bytes.data() + i * width;
    if (dtype == DTYPE_F64) {
      double x;
      std::memcpy(&x, p, sizeof(x));
      v[i] = x;
    } else if (dtype == DTYPE_F32) {
      float x;
      std::memcpy(&x, p, sizeof(x));
      v[i] = x;
    } else if (dtype == DTYPE_BF16) {
      bf16 x;
      std::memcpy(&x.bits, p, sizeof(x.bits));
      v[i] = bf16_to_f32(x);
    } else {
      ADD_FAILURE() << "values_of: " << dtype_name(dtype) << " is not a float type";
    }
  }
  return v;
}

// test::max_rel_error, max |x - ref| / max |ref|, that also says where: the element with the
// largest error. A non-finite x where the reference is finite is an infinite error (std::max would
// drop a NaN); the reference itself must be finite.
struct Mismatch {
  double error = 0.0;
  size_t index = 0;
  double got = 0.0, want = 0.0;
};
inline Mismatch rel_error(const std::vector<double>& x, const std::vector<double>& ref) {
  if (x.size() != ref.size()) return {kInf};
  double scale = 1e-30;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(ref[i])) {
      ADD_FAILURE() << "the CPU reference holds " << ref[i] << " at element " << i;
      return {kInf, i, x[i], ref[i]};
    }
    scale = std::max(scale, std::abs(ref[i]));
  }
  Mismatch worst;
  for (size_t i = 0; i < x.size(); ++i) {
    const double err = std::isfinite(x[i]) ? std::abs(x[i] - ref[i]) / scale : kInf;
    if (err > worst.error) worst = {err, i, x[i], ref[i]};
  }
  return worst;
}

// One GEMM problem: C (batch, m, n) = alpha op(A) op(B) + beta C (+ bias).
struct GemmCase {
  GemmSpec spec;
  int64_t m, n, k;
  bool bias;
};

class BackendOpsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string& name = GetParam();
    if (name == "strict") {
      backend_ = std::make_unique<test::StrictBackend>();
      return;
    }
    std::string reason;
    if (!cuda_backend_built()) {
      reason = "this build has no CUDA backend (the toolkit was not found at configure time)";
    } else {
      try {
        backend_ = make_backend(name);
      } catch (const Error& e) {
        reason = e.what();
      }
    }
    if (backend_) return;
    const char* require = std::getenv("LOOM_REQUIRE_CUDA");
    if (require != nullptr && std::string(require) == "1") FAIL() << "LOOM_REQUIRE_CUDA=1 but: " << reason;
    GTEST_SKIP() << reason;
  }

  void TearDown() override {
    if (worst_.empty()) return;
    double overall = 0.0;
    std::string line;
    for (const auto& [name, err] : worst_) {
      RecordProperty("max_rel_error_" + name, scientific(err));
      overall = std::max(overall, err);
      line += " " + name + " " + scientific(err);
    }
    RecordProperty("max_rel_error", scientific(overall));
    if (GetParam() != "strict") {
      const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
      std::printf("[ errors   ] %s: worst %s (%s)\n", info->name(), scientific(overall).c_str(), line.c_str() + 1);
    }
  }

  // ---- inputs, built in host memory

  // Uniform in [offset - scale, offset + scale), deterministic in seed. bf16: the rounded f32 values.
  Tensor rnd(Shape shape, DType dtype, uint64_t seed, double scale = 1.0, double offset = 0.0) {
    const DType base = dtype == DTYPE_F64 ? DTYPE_F64 : DTYPE_F32;
    Tensor t = random_tensor(host_, shape, base, seed, scale);
    if (offset != 0.0) {
      for (int64_t i = 0; i < t.numel(); ++i) {
        if (base == DTYPE_F64) t.data<double>()[i] += offset;
        else t.data<float>()[i] += static_cast<float>(offset);
      }
    }
    if (dtype != DTYPE_BF16) return t;
    Tensor b = empty(std::move(shape), DTYPE_BF16);
    for (int64_t i = 0; i < t.numel(); ++i) b.data<bf16>()[i] = f32_to_bf16(t.data<float>()[i]);
    return b;
  }
  // A norm's operands over (N, C): x with a mean offset (2 + U(-3, 3), which a one-pass variance
  // would get wrong), weight, bias, dout, and the forward's out, mean and rstd as NaN.
  Operands norm_operands(int64_t N, int64_t C, DType dtype) {
    Operands x;
    x.tensors["x"] = rnd({N, C}, dtype, 1, 3.0, 2.0);
    x.tensors["weight"] = rnd({C}, dtype, 2);
    x.tensors["bias"] = rnd({C}, dtype, 3);
    x.tensors["dout"] = rnd({N, C}, dtype, 4);
    x.tensors["out"] = nans({N, C}, dtype);
    x.tensors["mean"] = nans({N}, dtype);
    x.tensors["rstd"] = nans({N}, dtype);
    return x;
  }
  // An output the op must overwrite: NaN everywhere.
  Tensor nans(Shape shape, DType dtype) {
    Tensor t = empty(std::move(shape), dtype);
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (dtype == DTYPE_F64) t.data<double>()[i] = std::numeric_limits<double>::quiet_NaN();
      else if (dtype == DTYPE_F32) t.data<float>()[i] = std::numeric_limits<float>::quiet_NaN();
      else t.data<bf16>()[i] = bf16{0x7fc1};
    }
    return t;
  }
  Tensor ids(Shape shape, int32_t vocab, uint64_t seed) { return random_tokens(host_, std::move(shape), vocab, seed); }
  Tensor empty(Shape shape, DType dtype) { return Tensor::empty(host_, std::move(shape), dtype, MEM_WORKSPACE); }

  // ---- the comparison

  // Runs `op` on the CPU backend with host copies of `inputs` and on the backend under test with
  // its copies, then compares `outputs`; `deterministic`: a second run on the backend under test
  // must give the same bytes. Returns the worst error (bitwise outputs count 0 or infinity).
  double check(const std::string& what, const Operands& inputs, const Op& op, const std::vector<Output>& outputs,
               bool deterministic = false) {
    Operands ref = copy_to_host(inputs);
    op(*cpu_, ref);
    Operands got = copy_to_backend(inputs);
    op(*backend_, got);
    double worst = 0.0;
    for (const Output& o : outputs) {
      const double err = compare(what, o, ref, got);
      worst = std::max(worst, err);
      const bool scalar = ref.scalars.count(o.name) > 0;
      double& w = worst_[scalar ? o.name : o.name + "_" + dt(ref[o.name].dtype())];  // "dqkv_f32"
      w = std::max(w, err);
    }
    if (deterministic) {
      Operands again = copy_to_backend(inputs);
      op(*backend_, again);
      for (const Output& o : outputs) {
        if (got.scalars.count(o.name)) {
          const double first = got.scalars.at(o.name), second = again.scalars.at(o.name);
          EXPECT_EQ(std::bit_cast<uint64_t>(first), std::bit_cast<uint64_t>(second))
              << what << ": " << o.name << " differs between two runs from the same inputs: "
              << std::setprecision(17) << first << " then " << second;
        } else {
          EXPECT_TRUE(bytes_of(*backend_, got[o.name]) == bytes_of(*backend_, again[o.name]))
              << what << ": " << o.name << " differs between two runs from the same inputs";
        }
      }
    }
    return worst;
  }

  Operands copy_to_host(const Operands& in) {
    Operands out;
    for (const auto& [name, t] : in.tensors) {
      Tensor c = empty(t.shape(), t.dtype());
      std::memcpy(c.raw_data(), t.raw_data(), t.nbytes());
      out.tensors.emplace(name, c);
    }
    return out;
  }
  Operands copy_to_backend(const Operands& in) {
    Operands out;
    for (const auto& [name, t] : in.tensors) {
      Tensor c = Tensor::empty(backend_->allocator(), t.shape(), t.dtype(), MEM_WORKSPACE);
      backend_->write(c, t.raw_data());
      out.tensors.emplace(name, c);
    }
    return out;
  }

  double compare(const std::string& what, const Output& o, const Operands& ref, const Operands& got) {
    if (ref.scalars.count(o.name)) {
      const double r = ref.scalars.at(o.name), x = got.scalars.at(o.name);
      double err = 0.0;
      if (o.tol.bitwise) err = std::bit_cast<uint64_t>(r) == std::bit_cast<uint64_t>(x) ? 0.0 : kInf;
      else err = std::isfinite(x) ? std::abs(x - r) / (o.scale > 0 ? o.scale : std::max(std::abs(r), 1e-300)) : kInf;
      EXPECT_LE(err, o.tol.rel) << what << ": " << o.name << " = " << x << ", the CPU's " << r;
      return err;
    }
    const Tensor& r = ref[o.name];
    const Tensor& x = got[o.name];
    if (o.tol.bitwise) {
      const std::vector<uint8_t> xb = bytes_of(*backend_, x);
      const uint8_t* rb = static_cast<const uint8_t*>(r.raw_data());
      const size_t width = dtype_size(r.dtype());
      for (size_t i = 0; i < xb.size(); i += width) {
        if (std::memcmp(xb.data() + i, rb + i, width) != 0) {
          uint64_t xv = 0, rv = 0;
          std::memcpy(&xv, xb.data() + i, width);
          std::memcpy(&rv, rb + i, width);
          ADD_FAILURE() << what << ": " << o.name << " element " << i / width << " has bits 0x" << std::hex << xv
                        << ", the CPU's 0x" << rv;
          return kInf;
        }
      }
      return 0.0;
    }
    const Mismatch m = rel_error(values_of(bytes_of(*backend_, x), x.dtype()), values_of(bytes_of(*cpu_, r), r.dtype()));
    EXPECT_LE(m.error, o.tol.rel) << what << ": " << o.name << " max rel error, at element " << m.index << ": "
                                  << std::setprecision(9) << m.got << ", the CPU's " << m.want;
    return m.error;
  }

  void gemm_cases(DType in, DType out, Tol tol);  // below, with the GEMM tests
  Operands gemm_ab(DType in, const GemmCase& g);   // a case's random A and B, in dtype `in`

  CpuAllocator host_;
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  std::unique_ptr<Backend> backend_;
  std::map<std::string, double> worst_;  // per output name, over the test's cases
};

// Flat lengths of the elementwise and reduction cases: odd, and one that spans many blocks.
inline const std::vector<int64_t> kFlatSizes = {1001, (int64_t{1} << 20) + 3};

}  // namespace loom::backend_ops_test
