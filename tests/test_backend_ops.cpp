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

namespace loom {
namespace {

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

Tol elementwise_tol(DType dtype) { return {dtype == DTYPE_F64 ? kF64Tol : kF32ElementwiseTol}; }
Tol reduction_tol(DType dtype) { return {dtype == DTYPE_F64 ? kF64Tol : kF32ReductionTol}; }

constexpr double kInf = std::numeric_limits<double>::infinity();
const std::vector<DType> kFloatTypes = {DTYPE_F32, DTYPE_F64};

std::string dt(DType dtype) { return std::string(dtype_name(dtype)); }

// "1.23e-07": an error figure for RecordProperty.
std::string scientific(double x) {
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

std::vector<uint8_t> bytes_of(Backend& backend, const Tensor& t) {
  std::vector<uint8_t> bytes(t.nbytes());
  backend.read(t, bytes.data());
  return bytes;
}

// test::max_rel_error, max |x - ref| / max |ref|, that also says where: the element with the
// largest error. A non-finite x where the reference is finite is an infinite error (std::max would
// drop a NaN); the reference itself must be finite.
struct Mismatch {
  double error = 0.0;
  size_t index = 0;
  double got = 0.0, want = 0.0;
};
Mismatch rel_error(const std::vector<double>& x, const std::vector<double>& ref) {
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
    const Mismatch m = rel_error(test::values(*backend_, x), test::values(r));
    EXPECT_LE(m.error, o.tol.rel) << what << ": " << o.name << " max rel error, at element " << m.index << ": "
                                  << std::setprecision(9) << m.got << ", the CPU's " << m.want;
    return m.error;
  }

  void gemm_cases(DType in, DType out, Tol tol);  // below, with the GEMM tests

  CpuAllocator host_;
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  std::unique_ptr<Backend> backend_;
  std::map<std::string, double> worst_;  // per output name, over the test's cases
};

// ---------------------------------------------------------------- GEMM

// Every transpose, batched with bias and alpha/beta, and plain (alpha 1, beta 0: C starts as NaN
// and must be overwritten, not scaled); then one transformer-sized product, a linear layer's
// forward x (512, 768) @ W^T + b (f64: 128 rows, the CPU's f64 GEMM is a plain loop).
std::vector<GemmCase> gemm_shapes(DType in) {
  std::vector<GemmCase> cases;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      cases.push_back({GemmSpec{ta, tb, 0.5f, 0.25f, 3}, 7, 5, 37, true});
      cases.push_back({GemmSpec{ta, tb, 1.0f, 0.0f, 1}, 19, 23, 37, false});
    }
  }
  cases.push_back({GemmSpec{false, true, 1.0f, 0.0f, 1}, in == DTYPE_F64 ? 128 : 512, 768, 768, true});
  cases.push_back({GemmSpec{true, false, 1.0f, 1.0f, 2}, 96, 160, 1000, false});  // weight gradient, accumulated
  return cases;
}

std::string gemm_name(DType in, const GemmCase& g) {
  return str_cat("gemm ", dtype_name(in), " trans_a ", g.spec.trans_a, " trans_b ", g.spec.trans_b, " batch ",
                 g.spec.batch, " (", g.m, ", ", g.n, ", ", g.k, ") alpha ", g.spec.alpha, " beta ", g.spec.beta,
                 g.bias ? " bias" : "");
}

// A and B of dtype `in`, C and the bias of dtype `out`.
void BackendOpsTest::gemm_cases(DType in, DType out, Tol tol) {
  for (const GemmCase& g : gemm_shapes(in)) {
    const int64_t b = g.spec.batch;
    Operands x;
    x.tensors["a"] = rnd(g.spec.trans_a ? Shape{b, g.k, g.m} : Shape{b, g.m, g.k}, in, 1);
    x.tensors["b"] = rnd(g.spec.trans_b ? Shape{b, g.n, g.k} : Shape{b, g.k, g.n}, in, 2);
    x.tensors["c"] = g.spec.beta == 0.0f ? nans({b, g.m, g.n}, out) : rnd({b, g.m, g.n}, out, 3);
    if (g.bias) x.tensors["bias"] = rnd({g.n}, out, 4);
    check(gemm_name(in, g), x,
          [g](Backend& be, Operands& o) { be.gemm(o["a"], o["b"], o["c"], g.spec, g.bias ? &o["bias"] : nullptr); },
          {{"c", tol}});
  }
}

TEST_P(BackendOpsTest, GemmF32AllTransposesBatchedBiasAlphaBeta) { gemm_cases(DTYPE_F32, DTYPE_F32, {kF32ReductionTol}); }
TEST_P(BackendOpsTest, GemmBf16InputsAccumulateInF32) { gemm_cases(DTYPE_BF16, DTYPE_F32, {kBf16GemmTol}); }
TEST_P(BackendOpsTest, GemmF64) { gemm_cases(DTYPE_F64, DTYPE_F64, {kF64Tol}); }

// ---------------------------------------------------------------- elementwise, casts, reductions

const std::vector<int64_t> kFlatSizes = {1001, (int64_t{1} << 20) + 3};

TEST_P(BackendOpsTest, FillCopyAddAddInplaceScaleInplace) {
  for (DType dtype : kFloatTypes) {
    for (int64_t n : kFlatSizes) {
      Operands x;
      x.tensors["a"] = rnd({n}, dtype, 1, 3.0);
      x.tensors["b"] = rnd({n}, dtype, 2, 3.0);
      x.tensors["filled"] = nans({n}, dtype);
      x.tensors["copied"] = nans({n}, dtype);
      x.tensors["sum"] = nans({n}, dtype);
      x.tensors["acc"] = rnd({n}, dtype, 3);
      x.tensors["scaled"] = rnd({n}, dtype, 4);
      check(str_cat("elementwise ", dt(dtype), " n ", n), x,
            [](Backend& be, Operands& o) {
              be.fill(o["filled"], 0.3);
              be.copy(o["a"], o["copied"]);
              be.add(o["a"], o["b"], o["sum"]);
              be.add_inplace(o["acc"], o["b"]);
              be.scale_inplace(o["scaled"], 0.37);
            },
            {{"filled", kBitwise},
             {"copied", kBitwise},
             {"sum", elementwise_tol(dtype)},
             {"acc", elementwise_tol(dtype)},
             {"scaled", elementwise_tol(dtype)}});
    }
  }
}

// f32 -> bf16: rounding ties (to even, both ways), the largest finite values (rounding up to
// infinity), infinities, signed zeros, subnormals, NaNs with payloads (kept, quiet bit set),
// then every 2^16-th bit pattern and 2^20 random ones. bf16 -> f32: all 65536 patterns.
TEST_P(BackendOpsTest, CastF32ToBf16AndBackBitwise) {
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u,
                                0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x7f7f7fffu, 0x7f800000u, 0xff800000u,
                                0x00000001u, 0x80000001u, 0x007fffffu, 0x00008000u, 0x00018000u, 0x7fc00000u,
                                0xffc00000u, 0x7f800001u, 0x7fa5a5a5u, 0xff812345u, 0x7fffffffu};
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) bits.push_back(hi << 16 | (hi * 0x9e37u & 0xffffu));
  uint64_t state = 0x243f6a8885a308d3ull;  // splitmix64
  for (int i = 0; i < (1 << 20); ++i) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    bits.push_back(static_cast<uint32_t>(z ^ (z >> 31)));
  }
  const int64_t n = static_cast<int64_t>(bits.size());
  Operands x;
  x.tensors["f32"] = empty({n}, DTYPE_F32);
  std::memcpy(x["f32"].raw_data(), bits.data(), bits.size() * 4);
  x.tensors["to_bf16"] = nans({n}, DTYPE_BF16);
  x.tensors["all_bf16"] = empty({65536}, DTYPE_BF16);
  for (int64_t i = 0; i < 65536; ++i) x["all_bf16"].data<bf16>()[i] = bf16{static_cast<uint16_t>(i)};
  x.tensors["to_f32"] = nans({65536}, DTYPE_F32);
  check("cast f32 <-> bf16", x,
        [](Backend& be, Operands& o) {
          be.cast(o["f32"], o["to_bf16"]);
          be.cast(o["all_bf16"], o["to_f32"]);
        },
        {{"to_bf16", kBitwise}, {"to_f32", kBitwise}});
}

// f32 <-> f64 are exact (f32 -> f64) and round to nearest even (f64 -> f32): bitwise, over wide
// magnitudes, values that overflow f32 and values that land on f32 subnormals. NaN payloads are
// not part of the contract (a GPU's conversion canonicalizes them), so there are no NaNs.
TEST_P(BackendOpsTest, CastF32F64Bitwise) {
  const int64_t n = (int64_t{1} << 16) + 5;
  Operands x;
  Tensor f32 = rnd({n}, DTYPE_F32, 1), f64 = rnd({n}, DTYPE_F64, 2);
  for (int64_t i = 0; i < n; ++i) {
    const double e = static_cast<double>(i % 601) - 300.0;  // 2^-300 .. 2^300
    f64.data<double>()[i] *= std::exp2(e);
    f32.data<float>()[i] *= static_cast<float>(std::exp2(static_cast<double>(i % 250) - 125.0));
  }
  f32.data<float>()[0] = std::numeric_limits<float>::infinity();
  f32.data<float>()[1] = -0.0f;
  f32.data<float>()[2] = std::numeric_limits<float>::denorm_min();
  f64.data<double>()[0] = 1.0 + std::exp2(-24);          // a tie: rounds to 1
  f64.data<double>()[1] = 1.0 + 3 * std::exp2(-24);      // a tie: rounds up to even
  f64.data<double>()[2] = 3.5e38;                         // beyond f32's max: infinity
  f64.data<double>()[3] = -std::numeric_limits<double>::infinity();
  f64.data<double>()[4] = 3e-42;                          // an f32 subnormal
  x.tensors["f32"] = f32;
  x.tensors["f64"] = f64;
  x.tensors["to_f64"] = nans({n}, DTYPE_F64);
  x.tensors["to_f32"] = nans({n}, DTYPE_F32);
  check("cast f32 <-> f64", x,
        [](Backend& be, Operands& o) {
          be.cast(o["f32"], o["to_f64"]);
          be.cast(o["f64"], o["to_f32"]);
        },
        {{"to_f64", kBitwise}, {"to_f32", kBitwise}});
}

TEST_P(BackendOpsTest, SumAndSumSquaresInDouble) {
  for (DType dtype : kFloatTypes) {
    for (int64_t n : {int64_t{1001}, int64_t{1} << 20, (int64_t{1} << 20) + 3}) {
      Operands x;
      x.tensors["x"] = rnd({n}, dtype, 1, 2.0, 0.25);
      double abs_sum = 0.0, sq_sum = 0.0;
      for (double v : test::values(x["x"])) abs_sum += std::abs(v), sq_sum += v * v;
      check(str_cat("sum ", dt(dtype), " n ", n), x,
            [](Backend& be, Operands& o) {
              o.scalars["sum"] = be.sum(o["x"]);
              o.scalars["sum_squares"] = be.sum_squares(o["x"]);
            },
            {{"sum", {kF64Tol}, abs_sum}, {"sum_squares", {kF64Tol}, sq_sum}}, true);
    }
  }
}

TEST_P(BackendOpsTest, BiasBackwardAccumulatesColumnSums) {
  for (DType dtype : kFloatTypes) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{2 * 17, 67}, {4096, 768}, {3, 2053}}) {
      Operands x;
      x.tensors["dout"] = rnd({rows, cols}, dtype, 1);
      x.tensors["dbias"] = rnd({cols}, dtype, 2);
      check(str_cat("bias_backward ", dt(dtype), " (", rows, ", ", cols, ")"), x,
            [](Backend& be, Operands& o) { be.bias_backward(o["dout"], o["dbias"]); },
            {{"dbias", reduction_tol(dtype)}}, true);
    }
  }
}

// ---------------------------------------------------------------- embedding

// Few ids (V = 11 for 34 tokens) and a hot id (every third token is 7) make the backward add many
// rows into one: the accumulation is what differs between kernels.
TEST_P(BackendOpsTest, EmbeddingForwardBackwardWithAndWithoutPositions) {
  struct Case {
    int64_t B, T, C, V, Tmax;
  };
  for (DType dtype : kFloatTypes) {
    for (const Case& c : {Case{2, 17, 37, 11, 20}, Case{8, 512, 768, 1000, 1024}}) {
      for (bool with_positions : {false, true}) {
        Operands x;
        Tensor tokens = ids({c.B, c.T}, static_cast<int32_t>(c.V), 1);
        for (int64_t i = 0; i < tokens.numel(); i += 3) tokens.data<int32_t>()[i] = 7;
        x.tensors["tokens"] = tokens;
        x.tensors["table"] = rnd({c.V, c.C}, dtype, 2);
        x.tensors["out"] = nans({c.B, c.T, c.C}, dtype);
        x.tensors["dout"] = rnd({c.B, c.T, c.C}, dtype, 3);
        x.tensors["dtable"] = rnd({c.V, c.C}, dtype, 4);
        std::vector<Output> outputs = {{"out", elementwise_tol(dtype)}, {"dtable", elementwise_tol(dtype)}};
        if (with_positions) {
          x.tensors["positions"] = rnd({c.Tmax, c.C}, dtype, 5);
          x.tensors["dpositions"] = rnd({c.Tmax, c.C}, dtype, 6);
          outputs.push_back({"dpositions", elementwise_tol(dtype)});
        }
        check(str_cat("embedding ", dt(dtype), " B ", c.B, " T ", c.T, " C ", c.C, " V ", c.V,
                      with_positions ? " with positions" : ""),
              x,
              [with_positions](Backend& be, Operands& o) {
                be.embedding_forward(o["tokens"], o["table"], with_positions ? &o["positions"] : nullptr, o["out"]);
                be.embedding_backward(o["tokens"], o["dout"], o["dtable"], with_positions ? &o["dpositions"] : nullptr);
              },
              outputs, true);
      }
    }
  }
}

// ---------------------------------------------------------------- norms

// Rows x C: odd, wider than one thread block's sweep, and GPT-2 small's 4096 x 768. x has a mean
// offset (2 + U(-3, 3)), which a one-pass variance would get wrong.
const std::vector<std::pair<int64_t, int64_t>> kNormShapes = {{2 * 17, 37}, {33, 2053}, {4096, 768}};

TEST_P(BackendOpsTest, LayerNormForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (auto [N, C] : kNormShapes) {
      Operands x;
      x.tensors["x"] = rnd({N, C}, dtype, 1, 3.0, 2.0);
      x.tensors["weight"] = rnd({C}, dtype, 2);
      x.tensors["bias"] = rnd({C}, dtype, 3);
      x.tensors["dout"] = rnd({N, C}, dtype, 4);
      x.tensors["out"] = nans({N, C}, dtype);
      x.tensors["mean"] = nans({N}, dtype);
      x.tensors["rstd"] = nans({N}, dtype);
      x.tensors["dx"] = nans({N, C}, dtype);
      x.tensors["dweight"] = rnd({C}, dtype, 5);
      x.tensors["dbias"] = rnd({C}, dtype, 6);
      const Tol tol = elementwise_tol(dtype);
      check(str_cat("layernorm ", dt(dtype), " (", N, ", ", C, ")"), x,
            [](Backend& be, Operands& o) {
              be.layernorm_forward(o["x"], o["weight"], o["bias"], o["out"], o["mean"], o["rstd"], 1e-5f);
              be.layernorm_backward(o["dout"], o["x"], o["weight"], o["mean"], o["rstd"], o["dx"], o["dweight"],
                                    o["dbias"]);
            },
            {{"out", tol}, {"mean", tol}, {"rstd", tol}, {"dx", tol}, {"dweight", tol}, {"dbias", tol}}, true);
    }
  }
}

TEST_P(BackendOpsTest, RmsNormForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (auto [N, C] : kNormShapes) {
      Operands x;
      x.tensors["x"] = rnd({N, C}, dtype, 1, 3.0, 2.0);
      x.tensors["weight"] = rnd({C}, dtype, 2);
      x.tensors["dout"] = rnd({N, C}, dtype, 4);
      x.tensors["out"] = nans({N, C}, dtype);
      x.tensors["rstd"] = nans({N}, dtype);
      x.tensors["dx"] = nans({N, C}, dtype);
      x.tensors["dweight"] = rnd({C}, dtype, 5);
      const Tol tol = elementwise_tol(dtype);
      check(str_cat("rmsnorm ", dt(dtype), " (", N, ", ", C, ")"), x,
            [](Backend& be, Operands& o) {
              be.rmsnorm_forward(o["x"], o["weight"], o["out"], o["rstd"], 1e-5f);
              be.rmsnorm_backward(o["dout"], o["x"], o["weight"], o["rstd"], o["dx"], o["dweight"]);
            },
            {{"out", tol}, {"rstd", tol}, {"dx", tol}, {"dweight", tol}}, true);
    }
  }
}

// ---------------------------------------------------------------- activations

TEST_P(BackendOpsTest, GeluForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (int64_t n : kFlatSizes) {
      Operands x;
      x.tensors["x"] = rnd({n}, dtype, 1, 8.0);  // both tails and the curved middle
      x.tensors["dout"] = rnd({n}, dtype, 2);
      x.tensors["out"] = nans({n}, dtype);
      x.tensors["dx"] = nans({n}, dtype);
      check(str_cat("gelu ", dt(dtype), " n ", n), x,
            [](Backend& be, Operands& o) {
              be.gelu_forward(o["x"], o["out"]);
              be.gelu_backward(o["x"], o["dout"], o["dx"]);
            },
            {{"out", elementwise_tol(dtype)}, {"dx", elementwise_tol(dtype)}});
    }
  }
}

TEST_P(BackendOpsTest, SwiGluForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (auto [N, F] : {std::pair<int64_t, int64_t>{17, 37}, {2048, 1024}}) {
      Operands x;
      x.tensors["x"] = rnd({N, 2 * F}, dtype, 1, 6.0);
      x.tensors["dout"] = rnd({N, F}, dtype, 2);
      x.tensors["out"] = nans({N, F}, dtype);
      x.tensors["dx"] = nans({N, 2 * F}, dtype);
      check(str_cat("swiglu ", dt(dtype), " (", N, ", ", F, ")"), x,
            [](Backend& be, Operands& o) {
              be.swiglu_forward(o["x"], o["out"]);
              be.swiglu_backward(o["x"], o["dout"], o["dx"]);
            },
            {{"out", elementwise_tol(dtype)}, {"dx", elementwise_tol(dtype)}});
    }
  }
}

// ---------------------------------------------------------------- RoPE

// q and k heads rotated, v heads untouched (the layout attention reads); pos_offset as in
// decoding with a KV cache.
TEST_P(BackendOpsTest, RopeForwardBackwardWithPosOffset) {
  struct Case {
    int64_t B, T, H, KV, hd, pos_offset;
    float theta;
  };
  for (DType dtype : kFloatTypes) {
    for (const Case& c : {Case{2, 17, 3, 1, 8, 5, 10000.0f}, Case{4, 256, 4, 4, 64, 1000, 500000.0f}}) {
      const int64_t W = (c.H + 2 * c.KV) * c.hd, rotated = c.H + c.KV;
      Operands x;
      x.tensors["x"] = rnd({c.B, c.T, W}, dtype, 1);
      x.tensors["dx"] = rnd({c.B, c.T, W}, dtype, 2);
      check(str_cat("rope ", dt(dtype), " B ", c.B, " T ", c.T, " hd ", c.hd, " heads ", rotated, " of ",
                    c.H + 2 * c.KV, " pos_offset ", c.pos_offset),
            x,
            [c, rotated](Backend& be, Operands& o) {
              be.rope_forward(o["x"], c.hd, rotated, c.theta, c.pos_offset);
              be.rope_backward(o["dx"], c.hd, rotated, c.theta, c.pos_offset);
            },
            {{"x", elementwise_tol(dtype)}, {"dx", elementwise_tol(dtype)}});
    }
  }
}

// ---------------------------------------------------------------- attention

struct AttentionCase {
  int64_t B, T, H, KV, hd, window;
  int64_t width() const { return (H + 2 * KV) * hd; }
  std::string name() const {
    return str_cat("B ", B, " T ", T, " H ", H, " KV ", KV, " hd ", hd, " window ", window);
  }
};

// T = 17 with MHA, GQA and MQA x windows 0 (full), 3 and T (full, the boundary); then T = 256,
// hd = 64 (GPT-2's head) MHA full and GQA with a window.
std::vector<AttentionCase> attention_cases() {
  std::vector<AttentionCase> cases;
  for (auto [H, KV] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}, {3, 1}}) {
    for (int64_t window : {0, 3, 17}) cases.push_back({2, 17, H, KV, 8, window});
  }
  cases.push_back({2, 256, 4, 4, 64, 0});
  cases.push_back({2, 256, 4, 2, 64, 100});
  return cases;
}

// Forward, then the backward from the forward's results; probs and dqkv start as NaN.
TEST_P(BackendOpsTest, AttentionForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (const AttentionCase& c : attention_cases()) {
      Operands x;
      x.tensors["qkv"] = rnd({c.B, c.T, c.width()}, dtype, 1, 2.0);  // scaled: a peaked softmax
      x.tensors["dout"] = rnd({c.B, c.T, c.H * c.hd}, dtype, 2);
      x.tensors["out"] = nans({c.B, c.T, c.H * c.hd}, dtype);
      x.tensors["probs"] = nans({c.B, c.H, c.T, c.T}, dtype);
      x.tensors["dqkv"] = nans({c.B, c.T, c.width()}, dtype);
      const Tol tol = reduction_tol(dtype);
      check(str_cat("attention ", dt(dtype), " ", c.name()), x,
            [c](Backend& be, Operands& o) {
              be.attention_forward(o["qkv"], o["out"], o["probs"], c.H, c.KV, c.window);
              be.attention_backward(o["dout"], o["qkv"], o["out"], o["probs"], o["dqkv"], c.H, c.KV, c.window);
            },
            {{"out", tol}, {"probs", tol}, {"dqkv", tol}}, true);
    }
  }
}

TEST_P(BackendOpsTest, FlashAttentionForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (const AttentionCase& c : attention_cases()) {
      Operands x;
      x.tensors["qkv"] = rnd({c.B, c.T, c.width()}, dtype, 1, 2.0);
      x.tensors["dout"] = rnd({c.B, c.T, c.H * c.hd}, dtype, 2);
      x.tensors["out"] = nans({c.B, c.T, c.H * c.hd}, dtype);
      x.tensors["lse"] = nans({c.B, c.H, c.T}, dtype);
      x.tensors["dqkv"] = nans({c.B, c.T, c.width()}, dtype);
      const Tol tol = reduction_tol(dtype);
      check(str_cat("flash attention ", dt(dtype), " ", c.name()), x,
            [c](Backend& be, Operands& o) {
              be.flash_attention_forward(o["qkv"], o["out"], o["lse"], c.H, c.KV, c.window);
              be.flash_attention_backward(o["dout"], o["qkv"], o["out"], o["lse"], o["dqkv"], c.H, c.KV, c.window);
            },
            {{"out", tol}, {"lse", tol}, {"dqkv", tol}}, true);
    }
  }
}

// ---------------------------------------------------------------- cross-entropy

// Forward; backward into a separate dlogits; backward in place (dlogits aliasing logits). One
// logit of 100 in the small case: exp without the max subtracted overflows f32.
TEST_P(BackendOpsTest, CrossEntropyForwardBackwardAndInPlace) {
  for (DType dtype : kFloatTypes) {
    for (auto [N, V] : {std::pair<int64_t, int64_t>{17, 101}, {64, 50257}}) {
      Operands x;
      Tensor logits = rnd({N, V}, dtype, 1, 5.0);
      if (V == 101) {
        if (dtype == DTYPE_F64) logits.data<double>()[3 * V + 7] = 100.0;
        else logits.data<float>()[3 * V + 7] = 100.0f;
      }
      x.tensors["logits"] = logits;
      x.tensors["targets"] = ids({N}, static_cast<int32_t>(V), 2);
      x.tensors["losses"] = nans({N}, dtype);
      x.tensors["lse"] = nans({N}, dtype);
      x.tensors["dlogits"] = nans({N, V}, dtype);
      const Tol tol = reduction_tol(dtype);
      check(str_cat("cross_entropy ", dt(dtype), " N ", N, " V ", V), x,
            [](Backend& be, Operands& o) {
              be.cross_entropy_forward(o["logits"], o["targets"], o["losses"], o["lse"]);
              be.cross_entropy_backward(o["logits"], o["targets"], o["lse"], 0.37f, o["dlogits"]);
              be.cross_entropy_backward(o["logits"], o["targets"], o["lse"], 0.37f, o["logits"]);  // in place
            },
            {{"losses", tol}, {"lse", tol}, {"dlogits", tol}, {"logits", tol}});
    }
  }
}

// ---------------------------------------------------------------- AdamW

// Three steps (bias correction 1..3) from m = v = 0 with weight decay and grad_scale, a new
// gradient each step; lr 0.05 so the updates are visible at the parameters' scale.
TEST_P(BackendOpsTest, AdamWThreeSteps) {
  for (DType dtype : kFloatTypes) {
    for (int64_t n : {int64_t{101}, int64_t{1} << 20}) {
      Operands x;
      x.tensors["param"] = rnd({n}, dtype, 1);
      x.tensors["m"] = Tensor::zeros(host_, {n}, dtype, MEM_WORKSPACE);
      x.tensors["v"] = Tensor::zeros(host_, {n}, dtype, MEM_WORKSPACE);
      for (int step = 1; step <= 3; ++step) x.tensors[str_cat("grad", step)] = rnd({n}, dtype, 10 + step, 2.0);
      const Tol tol = elementwise_tol(dtype);
      check(str_cat("adamw ", dt(dtype), " n ", n), x,
            [](Backend& be, Operands& o) {
              for (int64_t step = 1; step <= 3; ++step) {
                be.adamw_step(o["param"], o[str_cat("grad", step)], o["m"], o["v"],
                              AdamWHyper{0.05f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, step});
              }
            },
            {{"param", tol}, {"m", tol}, {"v", tol}});
    }
  }
}

// ---------------------------------------------------------------- errors

// A token id outside the vocab (too large, then negative) is a loom::Error naming the op, on the
// CPU and on the backend under test, in the forward and the backward; the backend stays usable.
TEST_P(BackendOpsTest, BadTokenIdThrowsNamingTheOp) {
  const int64_t B = 2, T = 5, C = 4, V = 5;
  for (int32_t bad : {7, -1}) {
    Operands x;
    Tensor tokens = ids({B, T}, V, 1);
    tokens.data<int32_t>()[3] = bad;
    x.tensors["tokens"] = tokens;
    x.tensors["table"] = rnd({V, C}, DTYPE_F32, 2);
    x.tensors["out"] = nans({B, T, C}, DTYPE_F32);
    for (Backend* be : {cpu_.get(), backend_.get()}) {
      const Operands o = be == cpu_.get() ? copy_to_host(x) : copy_to_backend(x);
      for (const char* op : {"embedding_forward", "embedding_backward"}) {
        const std::string message = error_of([&] {
          if (std::string(op) == "embedding_forward") be->embedding_forward(o["tokens"], o["table"], nullptr, o["out"]);
          else be->embedding_backward(o["tokens"], o["out"], o["table"], nullptr);
        });
        EXPECT_NE(message.find(op), std::string::npos) << be->name() << " token " << bad << ": \"" << message << "\"";
        EXPECT_NE(message.find("outside vocab"), std::string::npos) << be->name() << ": \"" << message << "\"";
      }
    }
  }
  Operands x;  // then a good call on the backend under test
  x.tensors["tokens"] = ids({B, T}, V, 1);
  x.tensors["table"] = rnd({V, C}, DTYPE_F32, 2);
  x.tensors["out"] = nans({B, T, C}, DTYPE_F32);
  check("embedding_forward after errors", x,
        [](Backend& be, Operands& o) { be.embedding_forward(o["tokens"], o["table"], nullptr, o["out"]); },
        {{"out", {kF32ElementwiseTol}}});
}

TEST_P(BackendOpsTest, BadTargetThrowsNamingTheOp) {
  const int64_t N = 6, V = 5;
  for (int32_t bad : {5, -1}) {
    Operands x;
    Tensor targets = ids({N}, V, 1);
    targets.data<int32_t>()[N - 1] = bad;
    x.tensors["targets"] = targets;
    x.tensors["logits"] = rnd({N, V}, DTYPE_F32, 2);
    x.tensors["losses"] = nans({N}, DTYPE_F32);
    x.tensors["lse"] = nans({N}, DTYPE_F32);
    for (Backend* be : {cpu_.get(), backend_.get()}) {
      const Operands o = be == cpu_.get() ? copy_to_host(x) : copy_to_backend(x);
      const std::string message =
          error_of([&] { be->cross_entropy_forward(o["logits"], o["targets"], o["losses"], o["lse"]); });
      EXPECT_NE(message.find("cross_entropy_forward"), std::string::npos)
          << be->name() << " target " << bad << ": \"" << message << "\"";
      EXPECT_NE(message.find("outside vocab"), std::string::npos) << be->name() << ": \"" << message << "\"";
    }
  }
  Operands x;
  x.tensors["targets"] = ids({N}, V, 1);
  x.tensors["logits"] = rnd({N, V}, DTYPE_F32, 2);
  x.tensors["losses"] = nans({N}, DTYPE_F32);
  x.tensors["lse"] = nans({N}, DTYPE_F32);
  check("cross_entropy_forward after errors", x,
        [](Backend& be, Operands& o) { be.cross_entropy_forward(o["logits"], o["targets"], o["losses"], o["lse"]); },
        {{"losses", {kF32ReductionTol}}, {"lse", {kF32ReductionTol}}});
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendOpsTest, ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& param) { return param.param; });

}  // namespace
}  // namespace loom
