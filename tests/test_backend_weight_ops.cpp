// The weight ops of the Backend interface against the CPU backend and host references:
// - DoRA (row_norms, dora_weight with and without a base and in place, dora_backward): bitwise
//   equal to the CPU backend (each row's sum is in double, in order, on both), including rows
//   whose norm is 0 (gain 0, no magnitude gradient);
// - nf4_dequantize (f32 and bf16; whole tensors, ranges starting at even, odd and unaligned
//   elements): bitwise equal to the CPU backend;
// - int_dequantize: bitwise equal to the host's dequantization times the input scale, at every
//   width and group;
// - int_linear: against y = beta y + x diag(s) W^T + b in f64 from the dequantized weight
//   (W8A8: from the int8-rounded inputs, as the op states), within 2e-5 (1 + |y|); 1 to 17 input
//   rows, rows and columns that are not multiples of the kernels' tiles. The CPU backend
//   quantizes the activations of weight-only formats too (int8 per row and group, with VNNI or
//   AVX2), so for it the bound of that rounding (s_x / 2 sum |w| per group) is added.
// - bf16_weight_linear: against y = beta y + x W^T + b in f64 from the exactly widened bf16
//   weight, within 2e-5 (1 + |y|); 1 to 40 input rows (the CPU's direct and tiled paths, the
//   CUDA kernel's chunks and its default), columns that are and are not multiples of 8, and the
//   portable default (Backend::bf16_weight_linear: cast, then gemm) on the CPU; a weight
//   rounded instead of widened fails the bound.
// Backends: "strict" (the CPU kernels on memory host code may not read, tests/strict_backend.h;
// it does not forward int_linear / int_dequantize, so its integer cases run the CPU backend) and
// "cuda", skipped unless the build has a CUDA backend that states the capability under test.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/backend/cpu/cpu_quant_ops.h"
#include "loom/core/dtype.h"
#include "loom/core/philox.h"
#include "loom/precision/int_quant.h"
#include "loom/precision/nf4.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

std::vector<float> normal(int64_t n, uint64_t seed, float stddev) {
  std::vector<float> w(static_cast<size_t>(n));
  philox_fill_normal(w.data(), n, seed, 0, 0, 0.0f, stddev);
  return w;
}

Tensor upload(Backend& b, const Shape& shape, const std::vector<float>& v) {
  Tensor t = Tensor::empty(b.allocator(), shape, DTYPE_F32, MEM_WORKSPACE);
  b.write(t, v.data());
  return t;
}

std::vector<float> download(Backend& b, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  b.read(t, v.data());
  return v;
}

void expect_bitwise(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i])) << what << " element " << i << ": " << got[i] << " vs " << want[i];
  }
}

// ---------------------------------------------------------------- DoRA

class BackendDoraOpsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string skip;
    backend_ = test::op_test_backend(GetParam(), &BackendCapabilities::dora, &skip);
    if (!backend_) GTEST_SKIP() << skip;
  }

  struct Shape2 {
    int64_t rows, cols;
  };
  // Shapes: the kernels' tiles (8 rows x 128 columns) cut at both edges, one column, several
  // blocks of 32 rows, three tiles along a row.
  static constexpr Shape2 kShapes[] = {{37, 131}, {64, 32}, {5, 1}, {160, 45}, {9, 300}};

  // x with row 2 all zeros (its norm 0).
  static std::vector<float> matrix(const Shape2& s, uint64_t seed) {
    std::vector<float> x = normal(s.rows * s.cols, seed, 0.5f);
    for (int64_t i = 0; i < s.cols; ++i) x[static_cast<size_t>(2 * s.cols + i)] = 0.0f;
    return x;
  }

  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  std::unique_ptr<Backend> backend_;
};

TEST_P(BackendDoraOpsTest, RowNormsAndDoraWeightMatchTheCpuBitwise) {
  for (const Shape2& s : kShapes) {
    const std::string what = std::to_string(s.rows) + "x" + std::to_string(s.cols);
    const std::vector<float> merged = matrix(s, 1), base = normal(s.rows * s.cols, 2, 0.5f), mag = normal(s.rows, 3, 1.0f);
    std::vector<std::vector<float>> results[2];
    Backend* backends[2] = {cpu_.get(), backend_.get()};
    for (int k = 0; k < 2; ++k) {
      Backend& b = *backends[k];
      const Tensor m = upload(b, {s.rows, s.cols}, merged), bt = upload(b, {s.rows, s.cols}, base);
      const Tensor magnitude = upload(b, {s.rows}, mag), norms = upload(b, {s.rows}, std::vector<float>(static_cast<size_t>(s.rows), NAN));
      b.row_norms(m, norms);
      results[k].push_back(download(b, norms));
      const Tensor out = upload(b, {s.rows, s.cols}, std::vector<float>(static_cast<size_t>(s.rows * s.cols), NAN));
      b.dora_weight(m, bt, magnitude, norms, out);
      results[k].push_back(download(b, out));
      b.dora_weight(m, Tensor(), magnitude, norms, out);
      results[k].push_back(download(b, out));
      b.dora_weight(m, bt, magnitude, norms, m);  // in place
      results[k].push_back(download(b, m));
    }
    EXPECT_EQ(results[0][0][2], 0.0f);
    const char* names[] = {"row_norms", "dora_weight", "dora_weight without base", "dora_weight in place"};
    for (size_t i = 0; i < results[0].size(); ++i) expect_bitwise(results[1][i], results[0][i], what + " " + names[i]);
  }
}

TEST_P(BackendDoraOpsTest, DoraBackwardMatchesTheCpuBitwise) {
  for (const Shape2& s : kShapes) {
    const std::string what = std::to_string(s.rows) + "x" + std::to_string(s.cols);
    const std::vector<float> merged = matrix(s, 4), grad = normal(s.rows * s.cols, 5, 1.0f), mag = normal(s.rows, 6, 1.0f);
    const std::vector<float> dm0 = normal(s.rows, 7, 0.1f);
    std::vector<std::vector<float>> results[2];
    Backend* backends[2] = {cpu_.get(), backend_.get()};
    for (int k = 0; k < 2; ++k) {
      Backend& b = *backends[k];
      const Tensor m = upload(b, {s.rows, s.cols}, merged), g = upload(b, {s.rows, s.cols}, grad);
      const Tensor magnitude = upload(b, {s.rows}, mag), dm = upload(b, {s.rows}, dm0);
      const Tensor norms = Tensor::empty(b.allocator(), {s.rows}, DTYPE_F32, MEM_WORKSPACE);
      b.row_norms(m, norms);
      b.dora_backward(g, m, magnitude, norms, dm);
      results[k].push_back(download(b, g));
      results[k].push_back(download(b, dm));
    }
    EXPECT_EQ(results[0][1][2], dm0[2]);  // the zero-norm row's magnitude gradient is untouched
    expect_bitwise(results[1][0], results[0][0], what + " dora_backward grad");
    expect_bitwise(results[1][1], results[0][1], what + " dora_backward dmagnitude");
  }
}

TEST_P(BackendDoraOpsTest, BadOperandsNameTheOp) {
  Backend& b = *backend_;
  Allocator& a = b.allocator();
  const Tensor m = Tensor::empty(a, {4, 8}, DTYPE_F32, MEM_WORKSPACE), v = Tensor::empty(a, {4}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor v5 = Tensor::empty(a, {5}, DTYPE_F32, MEM_WORKSPACE), flat = Tensor::empty(a, {32}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor f64 = Tensor::empty(a, {4, 8}, DTYPE_F64, MEM_WORKSPACE), small = Tensor::empty(a, {4, 7}, DTYPE_F32, MEM_WORKSPACE);
  b.fill(m, 1.0), b.fill(v, 1.0);
  const std::pair<const char*, std::string> errors[] = {
      {"row_norms", test::error_of([&] { b.row_norms(m, v5); })},
      {"row_norms", test::error_of([&] { b.row_norms(flat, v); })},
      {"row_norms", test::error_of([&] { b.row_norms(f64, v); })},
      {"dora_weight", test::error_of([&] { b.dora_weight(m, Tensor(), v5, v, m); })},
      {"dora_weight", test::error_of([&] { b.dora_weight(m, small, v, v, m); })},
      {"dora_weight", test::error_of([&] { b.dora_weight(m, Tensor(), v, v, small); })},
      {"dora_backward", test::error_of([&] { b.dora_backward(small, m, v, v, v); })},
      {"dora_backward", test::error_of([&] { b.dora_backward(m, m, v, v, v5); })},
  };
  for (const auto& [op, e] : errors) EXPECT_NE(e.find(op), std::string::npos) << op << ": " << e;
}

INSTANTIATE_TEST_SUITE_P(Dora, BackendDoraOpsTest, ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// ---------------------------------------------------------------- NF4

class BackendNf4OpsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string skip;
    backend_ = test::op_test_backend(GetParam(), &BackendCapabilities::nf4, &skip);
    if (!backend_) GTEST_SKIP() << skip;
  }

  // Elements [first, first + count) through the op, as raw bytes of the output.
  static std::vector<uint8_t> run(Backend& b, const Nf4Tensor& t, int64_t first, int64_t count, DType dtype) {
    const Nf4Device d = nf4_to_backend(t, b, MEM_PARAMETERS);
    const Tensor out = Tensor::empty(b.allocator(), {count}, dtype, MEM_WORKSPACE);
    std::vector<uint8_t> bytes(out.nbytes(), 0xFF);
    b.write(out, bytes.data());
    b.nf4_dequantize(d.codes, d.absmax_codes, d.absmax_steps, d.spec, first, out);
    b.read(out, bytes.data());
    return bytes;
  }

  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  std::unique_ptr<Backend> backend_;
};

TEST_P(BackendNf4OpsTest, MatchesTheCpuBitwise) {
  const int64_t rows = 37, cols = 131, n = rows * cols;  // 76 blocks of 64
  const Nf4Tensor t = nf4_quantize(normal(n, 21, 0.05f), rows, cols);
  struct Range {
    int64_t first, count;
  };
  for (const Range r : {Range{0, n}, Range{cols, 3 * cols}, Range{64, 128}, Range{8, 17}, Range{3, 1}, Range{n - 5, 5}, Range{1, 2}}) {
    for (const DType dtype : {DTYPE_F32, DTYPE_BF16}) {
      const std::string what = "[" + std::to_string(r.first) + ", +" + std::to_string(r.count) + ") " + std::string(dtype_name(dtype));
      const std::vector<uint8_t> want = run(*cpu_, t, r.first, r.count, dtype), got = run(*backend_, t, r.first, r.count, dtype);
      ASSERT_EQ(got, want) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Nf4, BackendNf4OpsTest, ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// ---------------------------------------------------------------- integer weights

struct IntCase {
  int bits;
  int64_t group;
  bool act_int8, input_scale, bias;
  float beta;
};

// y = beta y0 + x diag(s) W^T + b in f64 from the host-dequantized weight; with `quantize_input`
// each input row's groups (of the weight's group size) rounded to int8 first as the ops state.
// bound[i]: the most that rounding can move y[i] (s_x / 2 times sum |w| per group).
std::vector<double> reference_linear(const std::vector<float>& x, int64_t N, const IntWeight& q, const std::vector<float>& s,
                                     const std::vector<float>& b, const std::vector<float>& y0, float beta,
                                     bool quantize_input, std::vector<double>& bound) {
  const int64_t K = q.spec.cols, O = q.spec.rows, G = q.spec.group;
  const std::vector<float> w = int_dequantize(q);
  std::vector<double> y(static_cast<size_t>(N * O));
  bound.assign(y.size(), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<float> xf(static_cast<size_t>(K));
    for (int64_t c = 0; c < K; ++c) {
      xf[static_cast<size_t>(c)] = x[static_cast<size_t>(n * K + c)] * (s.empty() ? 1.0f : s[static_cast<size_t>(c)]);
    }
    std::vector<double> in(xf.begin(), xf.end()), step(static_cast<size_t>(K / G));
    for (int64_t g = 0; g < K / G; ++g) {
      float amax = 0.0f;
      for (int64_t c = g * G; c < (g + 1) * G; ++c) amax = std::max(amax, std::fabs(xf[static_cast<size_t>(c)]));
      const float sx = amax > 0 ? amax / 127.0f : 1.0f;
      step[static_cast<size_t>(g)] = sx;
      if (!quantize_input) continue;
      for (int64_t c = g * G; c < (g + 1) * G; ++c) {
        in[static_cast<size_t>(c)] = static_cast<double>(sx) * std::clamp(std::nearbyint(xf[static_cast<size_t>(c)] / sx), -127.0f, 127.0f);
      }
    }
    for (int64_t o = 0; o < O; ++o) {
      double acc = 0.0;
      for (int64_t c = 0; c < K; ++c) {
        const double wc = w[static_cast<size_t>(o * K + c)];
        acc += in[static_cast<size_t>(c)] * wc;
        bound[static_cast<size_t>(n * O + o)] += 0.5 * step[static_cast<size_t>(c / G)] * std::fabs(wc);
      }
      if (!b.empty()) acc += b[static_cast<size_t>(o)];
      y[static_cast<size_t>(n * O + o)] = acc + static_cast<double>(beta) * y0[static_cast<size_t>(n * O + o)];
    }
  }
  return y;
}

class BackendIntWeightOpsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string skip;
    backend_ = test::op_test_backend(GetParam(), &BackendCapabilities::int_weights, &skip);
    if (!backend_) GTEST_SKIP() << skip;
    // The strict test backend does not forward the integer ops: its cases run the CPU backend.
    if (!backend_->capabilities().int_weights) backend_ = make_cpu_backend(), cpu_ = true;
  }

  std::unique_ptr<Backend> backend_;
  bool cpu_ = false;
};

TEST_P(BackendIntWeightOpsTest, LinearMatchesDequantizeThenF64AndDequantizeIsBitwise) {
  Backend& b = *backend_;
  // 37 output rows (not a multiple of 8), 288 columns (a full and a partial tile of 256), and
  // 384 (3 blocks of 128: the CPU's 4-bit block kernel with groups of 32, 128 and the whole row).
  const int64_t O = 37;
  const IntCase cases[] = {{8, 96, false, false, false, 0.0f}, {4, 96, false, true, true, 1.0f}, {4, 32, false, false, true, 0.0f},
                           {3, 96, false, true, false, 1.0f},  {3, 0, false, false, false, 0.0f}, {8, 0, true, false, true, 0.0f},
                           {8, 0, true, true, false, 1.0f},    {4, 128, false, true, false, 1.0f}, {4, 0, false, false, true, 0.0f}};
  int checked = 0, expected = 0;
  for (const int64_t K : {int64_t{288}, int64_t{384}}) {
    for (const IntCase& c : cases) {
      if (c.group > 0 && K % c.group != 0) continue;
      expected += 5;
      const std::string what = std::to_string(c.bits) + " bits, group " + std::to_string(c.group) + (c.act_int8 ? " W8A8" : "") +
                               ", " + std::to_string(K) + " columns";
      const IntWeightSpec spec = int_weight_spec(c.bits, c.group, O, K, c.act_int8, "op");
      IntWeight q = rtn_quantize(normal(O * K, 11 + static_cast<uint64_t>(c.bits), 0.05f), spec);
      std::vector<float> s;
      if (c.input_scale) {
        s = normal(K, 5, 0.3f);
        for (float& v : s) v = std::exp(v);
        q.input_scale = s;
      }
      const IntWeightDevice d = int_weight_to_backend(q, b, MEM_PARAMETERS);
      const std::vector<float> bias = c.bias ? normal(O, 7, 0.1f) : std::vector<float>{};
      Tensor bt;
      if (c.bias) bt = upload(b, {O}, bias);
      const bool quantized_input = c.act_int8 || cpu_;
      for (int64_t N : {1, 2, 3, 5, 17}) {
        const std::vector<float> x = normal(N * K, 100 + static_cast<uint64_t>(N), 1.0f), y0 = normal(N * O, 200 + static_cast<uint64_t>(N), 1.0f);
        const Tensor xt = upload(b, {N, K}, x), yt = upload(b, {N, O}, y0);
        b.int_linear(xt, d.codes, d.scales, d.zeros, spec, c.input_scale ? &d.input_scale : nullptr, yt, c.beta, c.bias ? &bt : nullptr);
        const std::vector<float> got = download(b, yt);
        std::vector<double> bound, unused;
        const std::vector<double> want = reference_linear(x, N, q, s, bias, y0, c.beta, quantized_input, unused);
        const std::vector<double> exact = reference_linear(x, N, q, s, bias, y0, c.beta, false, bound);
        for (int64_t i = 0; i < N * O; ++i) {
          const double tol = 2e-5 * (1.0 + std::fabs(want[static_cast<size_t>(i)]));
          ASSERT_NEAR(got[static_cast<size_t>(i)], want[static_cast<size_t>(i)], tol) << what << ", N " << N << ", element " << i;
          const double slack = quantized_input ? bound[static_cast<size_t>(i)] : 0.0;
          ASSERT_NEAR(got[static_cast<size_t>(i)], exact[static_cast<size_t>(i)], slack + tol) << what << ", N " << N << ", element " << i;
        }
        ++checked;
      }
      // int_dequantize: the host's dequantization times the input scale, bit for bit.
      const Tensor w = upload(b, {O, K}, std::vector<float>(static_cast<size_t>(O * K), NAN));
      b.int_dequantize(d.codes, d.scales, d.zeros, spec, c.input_scale ? &d.input_scale : nullptr, w);
      std::vector<float> host = int_dequantize(q);
      if (c.input_scale) {
        for (int64_t i = 0; i < O * K; ++i) host[static_cast<size_t>(i)] *= s[static_cast<size_t>(i % K)];
      }
      expect_bitwise(download(b, w), host, what + " int_dequantize");
    }
  }
  EXPECT_EQ(checked, expected);
  EXPECT_EQ(expected, 5 * (8 + 9));  // 288 columns: every case but group 128; 384: every case
}

// Compact group parameters (f16 scales, no zeros tensor for symmetric groups), as a backend with
// compact_int_weights keeps a compact checkpoint's weights: the same outputs, bit for bit, as
// the same weight widened to f32 scales and u8 zeros, in 2 bytes a group instead of 5; a zero
// point other than 2^(b - 1) in a weight stored as symmetric is refused at upload.
TEST_P(BackendIntWeightOpsTest, CompactGroupParametersGiveTheWidenedWeightsNumbersBitwise) {
  Backend& b = *backend_;
  if (!b.capabilities().compact_int_weights) GTEST_SKIP() << GetParam() << ": no compact_int_weights";
  const int64_t O = 37;
  const IntStorage compact{.f16_scales = true, .symmetric = true};
  const IntCase cases[] = {{8, 96, false, false, false, 0.0f}, {4, 32, false, true, true, 1.0f}, {4, 128, false, false, false, 0.0f},
                           {3, 96, false, false, true, 0.0f},  {8, 32, false, false, true, 1.0f}, {4, 0, false, false, false, 1.0f}};
  int checked = 0;
  for (const int64_t K : {int64_t{288}, int64_t{384}}) {
    for (const IntCase& c : cases) {
      if (c.group > 0 && K % c.group != 0) continue;
      const std::string what = std::to_string(c.bits) + " bits, group " + std::to_string(c.group) + (c.act_int8 ? " W8A8" : "") +
                               ", " + std::to_string(K) + " columns";
      const IntWeightSpec spec = int_weight_spec(c.bits, c.group, O, K, c.act_int8, "op");
      IntWeight q = rtn_quantize(normal(O * K, 21 + static_cast<uint64_t>(c.bits), 0.05f), spec, compact);
      if (c.input_scale) {
        q.input_scale = normal(K, 5, 0.3f);
        for (float& v : q.input_scale) v = std::exp(v);
      }
      const IntWeightDevice small = int_weight_to_backend(q, b, MEM_PARAMETERS);
      const IntWeightDevice wide = int_weight_to_backend(q, b, MEM_PARAMETERS, /*compact=*/false);
      ASSERT_EQ(small.scales.dtype(), DTYPE_F16) << what;
      ASSERT_FALSE(small.zeros.defined()) << what;
      EXPECT_EQ(small.bytes, q.stored_bytes()) << what;
      EXPECT_EQ(wide.bytes, q.bytes()) << what;
      EXPECT_EQ(wide.bytes - small.bytes, O * (K / spec.group) * 3) << what;
      const Tensor* in_small = c.input_scale ? &small.input_scale : nullptr;
      const Tensor* in_wide = c.input_scale ? &wide.input_scale : nullptr;
      const Tensor bt = c.bias ? upload(b, {O}, normal(O, 7, 0.1f)) : Tensor{};
      for (int64_t N : {1, 2, 5, 17}) {
        const std::vector<float> x = normal(N * K, 100 + static_cast<uint64_t>(N), 1.0f), y0 = normal(N * O, 200 + static_cast<uint64_t>(N), 1.0f);
        const Tensor xt = upload(b, {N, K}, x), ys = upload(b, {N, O}, y0), yw = upload(b, {N, O}, y0);
        b.int_linear(xt, small.codes, small.scales, small.zeros, spec, in_small, ys, c.beta, c.bias ? &bt : nullptr);
        b.int_linear(xt, wide.codes, wide.scales, wide.zeros, spec, in_wide, yw, c.beta, c.bias ? &bt : nullptr);
        expect_bitwise(download(b, ys), download(b, yw), what + ", N " + std::to_string(N));
        ++checked;
      }
      const Tensor ws = upload(b, {O, K}, std::vector<float>(static_cast<size_t>(O * K), NAN));
      const Tensor ww = upload(b, {O, K}, std::vector<float>(static_cast<size_t>(O * K), NAN));
      b.int_dequantize(small.codes, small.scales, small.zeros, spec, in_small, ws);
      b.int_dequantize(wide.codes, wide.scales, wide.zeros, spec, in_wide, ww);
      expect_bitwise(download(b, ws), download(b, ww), what + " int_dequantize");
    }
  }
  EXPECT_EQ(checked, 4 * (5 + 6));  // 288 columns: every case but group 128
  // A symmetric weight whose zero points are not 2^(b - 1), an f16-scaled one whose scale is not an f16 value.
  const IntWeightSpec spec = int_weight_spec(4, 32, 8, 64, false, "op");
  IntWeight bad = rtn_quantize(normal(8 * 64, 1, 0.1f), spec, compact);
  bad.zeros[3] = 7;
  EXPECT_NE(test::error_of([&] { int_weight_to_backend(bad, b, MEM_PARAMETERS); }).find("zero point 7"), std::string::npos);
  bad = rtn_quantize(normal(8 * 64, 1, 0.1f), spec, compact);
  bad.scales[2] = 0.1f;  // not an f16 value
  EXPECT_NE(test::error_of([&] { int_weight_to_backend(bad, b, MEM_PARAMETERS); }).find("not an f16 value"), std::string::npos);
  EXPECT_NO_THROW(int_weight_to_backend(bad, b, MEM_PARAMETERS, /*compact=*/false));  // widened: any f32 scale
}

// The integer sums stay exact at their extremes: groups whose codes are 2^b - 1 side by side and 0
// (rtn's asymmetric groups map each group's max and min there) against inputs at full scale
// (q_x = +-127: all +1, all -1, and pairs of alternating sign). An AVX2 kernel adding pairs of
// u8 x s8 products in saturating int16 (maddubs) on the codes themselves reaches 2 x 255 x 127
// at 8 bits and fails; so does one taking c - 128 as |c - 128| without the sign trick's care.
TEST_P(BackendIntWeightOpsTest, ExtremeCodesAndFullScaleInputsSumExactly) {
  Backend& b = *backend_;
  const int64_t O = 8, K = 256, N = 3;
  std::vector<float> w(static_cast<size_t>(O * K)), x(static_cast<size_t>(N * K));
  for (int64_t o = 0; o < O; ++o) {
    for (int64_t c = 0; c < K; ++c) w[static_cast<size_t>(o * K + c)] = (c % 32 == 5 || c % 7 == o % 7) ? -1.0f : 1.0f + 0.01f * o;
  }
  for (int64_t c = 0; c < K; ++c) {
    x[static_cast<size_t>(c)] = 1.0f, x[static_cast<size_t>(K + c)] = -1.0f;
    x[static_cast<size_t>(2 * K + c)] = (c / 2) % 2 == 0 ? 1.0f : -1.0f;
  }
  for (const int bits : {8, 4}) {
    for (const int64_t group : {int64_t{32}, int64_t{0}}) {
      const IntWeightSpec spec = int_weight_spec(bits, group, O, K, false, "op");
      const IntWeight q = rtn_quantize(w, spec);
      ASSERT_EQ(*std::max_element(q.codes.begin(), q.codes.end()), bits == 8 ? 255 : 0xFF);  // 4 bits: two 15s a byte
      const IntWeightDevice d = int_weight_to_backend(q, b, MEM_PARAMETERS);
      const Tensor xt = upload(b, {N, K}, x), yt = upload(b, {N, O}, std::vector<float>(static_cast<size_t>(N * O), 0.0f));
      b.int_linear(xt, d.codes, d.scales, d.zeros, spec, nullptr, yt, 0.0f, nullptr);
      std::vector<double> unused;
      const std::vector<double> want = reference_linear(x, N, q, {}, {}, std::vector<float>(static_cast<size_t>(N * O)), 0.0f,
                                                        cpu_, unused);  // the CPU quantizes the inputs
      const std::vector<float> got = download(b, yt);
      for (int64_t i = 0; i < N * O; ++i) {
        ASSERT_NEAR(got[static_cast<size_t>(i)], want[static_cast<size_t>(i)], 2e-5 * (1.0 + std::fabs(want[static_cast<size_t>(i)])))
            << bits << " bits, group " << group << ", element " << i;
      }
    }
  }
}

TEST_P(BackendIntWeightOpsTest, BadOperandsNameTheOp) {
  Backend& b = *backend_;
  Allocator& a = b.allocator();
  const IntWeightSpec spec = int_weight_spec(4, 32, 8, 64, false, "op");
  const IntWeight q = rtn_quantize(normal(8 * 64, 1, 0.1f), spec);
  const IntWeightDevice d = int_weight_to_backend(q, b, MEM_PARAMETERS);
  const Tensor x = Tensor::empty(a, {2, 64}, DTYPE_F32, MEM_WORKSPACE), y = Tensor::empty(a, {2, 8}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor y_bad = Tensor::empty(a, {2, 9}, DTYPE_F32, MEM_WORKSPACE), x_bad = Tensor::empty(a, {2, 60}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor w = Tensor::empty(a, {8, 64}, DTYPE_F32, MEM_WORKSPACE), w_bad = Tensor::empty(a, {8, 63}, DTYPE_F32, MEM_WORKSPACE);
  IntWeightSpec eight = spec;
  eight.bits = 8;
  IntWeightSpec five = spec;
  five.bits = 5;
  const std::pair<const char*, std::string> errors[] = {
      {"int_linear", test::error_of([&] { b.int_linear(x, d.codes, d.scales, d.zeros, spec, nullptr, y_bad, 0.0f, nullptr); })},
      {"int_linear", test::error_of([&] { b.int_linear(x_bad, d.codes, d.scales, d.zeros, spec, nullptr, y, 0.0f, nullptr); })},
      {"int_linear", test::error_of([&] { b.int_linear(x, d.codes, d.scales, d.zeros, eight, nullptr, y, 0.0f, nullptr); })},
      {"int_linear", test::error_of([&] { b.int_linear(x, d.codes, d.scales, d.zeros, five, nullptr, y, 0.0f, nullptr); })},
      {"int_linear", test::error_of([&] { b.int_linear(x, d.codes, d.zeros, d.scales, spec, nullptr, y, 0.0f, nullptr); })},
      {"int_linear", test::error_of([&] { b.int_linear(x, d.codes, d.scales, d.zeros, spec, &y, y, 0.0f, nullptr); })},
      {"int_dequantize", test::error_of([&] { b.int_dequantize(d.codes, d.scales, d.zeros, spec, nullptr, w_bad); })},
      {"int_dequantize", test::error_of([&] { b.int_dequantize(d.codes, d.scales, d.zeros, spec, &y, w); })},
  };
  for (const auto& [op, e] : errors) EXPECT_NE(e.find(op), std::string::npos) << op << ": " << e;
}

// ---------------------------------------------------------------- bf16 weights used in place

// y = beta y0 + x W^T + b in f64, W the bf16 bits widened.
std::vector<double> reference_bf16_linear(const std::vector<float>& x, int64_t N, const std::vector<uint16_t>& w, int64_t O,
                                          int64_t K, const std::vector<float>& b, const std::vector<float>& y0, float beta) {
  std::vector<double> y(static_cast<size_t>(N * O));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < O; ++o) {
      double acc = 0.0;
      for (int64_t c = 0; c < K; ++c) {
        acc += static_cast<double>(x[static_cast<size_t>(n * K + c)]) * bf16_to_f32(bf16{w[static_cast<size_t>(o * K + c)]});
      }
      if (!b.empty()) acc += b[static_cast<size_t>(o)];
      y[static_cast<size_t>(n * O + o)] = acc + static_cast<double>(beta) * y0[static_cast<size_t>(n * O + o)];
    }
  }
  return y;
}

// The largest |got - want| / (1 + |want|) over every case, running `linear` on backend b.
double bf16_linear_error(Backend& b, const std::function<void(const Tensor&, const Tensor&, const Tensor&, float,
                                                              const Tensor*)>& linear, int* checked) {
  double worst = 0.0;
  // The CPU's decoding kernel takes 32 columns a step, then a chunk of 16, then single columns:
  // 288 (steps only), 100 (a tail of 4), 120 (a chunk and a tail of 8), 6150 (wide, a tail of 6).
  for (const int64_t K : {288, 100, 120, 6150}) {
    const int64_t O = 37;
    std::vector<uint16_t> w(static_cast<size_t>(O * K));
    const std::vector<float> wf = normal(O * K, 31 + static_cast<uint64_t>(K), 0.05f);
    for (size_t i = 0; i < w.size(); ++i) w[i] = f32_to_bf16(wf[i]).bits;
    const Tensor wt = Tensor::empty(b.allocator(), {O, K}, DTYPE_BF16, MEM_PARAMETERS);
    b.write(wt, w.data());
    for (const bool with_bias : {false, true}) {
      const std::vector<float> bias = with_bias ? normal(O, 7, 0.1f) : std::vector<float>{};
      const Tensor bt = with_bias ? upload(b, {O}, bias) : Tensor{};
      for (int64_t N : {1, 2, 3, 5, 9, 16, 17, 40}) {
        if (K > 1000 && N > 2) continue;
        const float beta = (N + (with_bias ? 1 : 0)) % 2 == 0 ? 0.0f : 1.0f;
        const std::vector<float> x = normal(N * K, 100 + static_cast<uint64_t>(N), 1.0f);
        const std::vector<float> y0 = normal(N * O, 200 + static_cast<uint64_t>(N), 1.0f);
        const Tensor xt = upload(b, {N, K}, x), yt = upload(b, {N, O}, y0);
        linear(xt, wt, yt, beta, with_bias ? &bt : nullptr);
        const std::vector<float> got = download(b, yt);
        const std::vector<double> want = reference_bf16_linear(x, N, w, O, K, bias, y0, beta);
        for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]) / (1.0 + std::fabs(want[i])));
        ++*checked;
      }
    }
  }
  return worst;
}

class BackendBf16WeightOpsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string skip;
    backend_ = GetParam() == "cpu" ? make_cpu_backend() : test::op_test_backend(GetParam(), &BackendCapabilities::int_weights, &skip);
    if (!backend_) GTEST_SKIP() << skip;
  }
  std::unique_ptr<Backend> backend_;
};

TEST_P(BackendBf16WeightOpsTest, LinearMatchesTheWidenedWeightInF64) {
  Backend& b = *backend_;
  int checked = 0;
  const double error = bf16_linear_error(
      b, [&](const Tensor& x, const Tensor& w, const Tensor& y, float beta, const Tensor* bias) {
        b.bf16_weight_linear(x, w, y, beta, bias);
      }, &checked);
  EXPECT_EQ(checked, 52);
  EXPECT_LT(error, 2e-5) << GetParam();
  std::printf("bf16_weight_linear on %s: worst error %.2e over %d cases\n", GetParam().c_str(), error, checked);
  if (GetParam() != "cpu") return;
  // The portable default (cast into an f32 copy, then gemm), which CUDA takes above 16 rows.
  const double fallback = bf16_linear_error(
      b, [&](const Tensor& x, const Tensor& w, const Tensor& y, float beta, const Tensor* bias) {
        b.Backend::bf16_weight_linear(x, w, y, beta, bias);
      }, &checked);
  EXPECT_LT(fallback, 2e-5);
  // A broken variant: the weight rounded to f32 -> bf16 of the f32 products (not widened) misses.
  const double broken = bf16_linear_error(
      b, [&](const Tensor& x, const Tensor& w, const Tensor& y, float beta, const Tensor* bias) {
        const Tensor wide = Tensor::empty(b.allocator(), w.shape(), DTYPE_F32, MEM_WORKSPACE);
        b.cast(w, wide);
        const Tensor xb = Tensor::empty(b.allocator(), x.shape(), DTYPE_BF16, MEM_WORKSPACE);
        b.cast(x, xb);  // x rounded to bf16 as a bf16 GEMM would
        const Tensor xr = Tensor::empty(b.allocator(), x.shape(), DTYPE_F32, MEM_WORKSPACE);
        b.cast(xb, xr);
        GemmSpec spec;
        spec.trans_b = true, spec.beta = beta;
        b.gemm(xr, wide, y, spec, bias);
      }, &checked);
  EXPECT_GT(broken, 2e-5) << "an input rounded to bf16 should miss the f32 bound";
}

TEST_P(BackendBf16WeightOpsTest, BadOperandsNameTheOp) {
  Backend& b = *backend_;
  Allocator& a = b.allocator();
  const Tensor w = Tensor::empty(a, {8, 64}, DTYPE_BF16, MEM_WORKSPACE), w32 = Tensor::empty(a, {8, 64}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor x = Tensor::empty(a, {2, 64}, DTYPE_F32, MEM_WORKSPACE), y = Tensor::empty(a, {2, 8}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor y_bad = Tensor::empty(a, {2, 9}, DTYPE_F32, MEM_WORKSPACE), x_bad = Tensor::empty(a, {2, 60}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor bias_bad = Tensor::empty(a, {9}, DTYPE_F32, MEM_WORKSPACE);
  for (const std::string& e : {test::error_of([&] { b.bf16_weight_linear(x, w32, y, 0.0f, nullptr); }),
                               test::error_of([&] { b.bf16_weight_linear(x_bad, w, y, 0.0f, nullptr); }),
                               test::error_of([&] { b.bf16_weight_linear(x, w, y_bad, 0.0f, nullptr); }),
                               test::error_of([&] { b.bf16_weight_linear(x, w, y, 0.0f, &bias_bad); })}) {
    EXPECT_NE(e.find("bf16_weight_linear"), std::string::npos) << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Bf16Weights, BackendBf16WeightOpsTest,
                         ::testing::Values(std::string("cpu"), std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

INSTANTIATE_TEST_SUITE_P(IntWeights, BackendIntWeightOpsTest, ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace loom
