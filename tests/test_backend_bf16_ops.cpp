// Op tests of a device backend against the CPU backend (make_cpu_backend) for dropout, the kernel
// paths of the quantizers that test_backend_quant_ops.cpp's shapes leave out, and the bf16
// attention. Each case builds its inputs in host memory, runs the op on the CPU backend and on the
// backend under test (operands written with Backend::write, outputs NaN-filled first and read back
// with Backend::read), and compares:
//   - dropout and the quantizers: bitwise (a device Philox4x32-10 must draw the CPU's words, and
//     every element's arithmetic is the CPU's, NaN bits included);
//   - the bf16 attention, against the CPU's attention_forward_bf16 / _backward_bf16: both multiply
//     the same bf16 operands, each product exact in fp32, but sum them in another order (cuBLAS's,
//     or the simulator's k order, against oneDNN's), so S, D and P differ by fp32 rounding, and a P
//     or dS that lands at a bf16 rounding boundary may round the other way: an error of one bf16
//     ulp (2^-8 relative) of that one element in O, dQ, dK or dV. Tolerances, relative to the
//     CPU's tensor: probs max |err| / max |cpu| <= 1e-5 (measured <= 1.7e-7 on the simulator);
//     out and dqkv max <= 1e-2 (one such flip of the largest P of a row stays under ~5e-3;
//     measured <= 6.8e-5) and ||err||_2 / ||cpu||_2 <= 2e-4 (measured <= 1.7e-5). The CPU's fp32
//     attention is >= 1.4e-3 away from the bf16 one in that norm (measured), so a kernel that left
//     out a rounding fails; the test checks that it can tell them apart. Every element written.
// Backends: "strict" (the CPU kernels on memory host code may not read, tests/strict_backend.h)
// and "cuda", skipped where the build has no CUDA backend, no GPU is visible or the backend does
// not state capabilities().low_precision (dropout, quantizers) or .bf16_attention.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/error.h"
#include "loom/precision/formats.h"
#include "loom/precision/quantize.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

// The bf16 attention's tolerances (file comment): probs and out / dqkv by their max error, and
// out / dqkv by their RMS error, each relative to the CPU's.
constexpr double kProbsTol = 1e-5;
constexpr double kBf16Tol = 1e-2;
constexpr double kBf16RmsTol = 2e-4;

std::vector<float> uniform(int64_t n, uint64_t seed, double scale) {
  CpuAllocator host;
  const Tensor t = test::random_tensor(host, {n}, DTYPE_F32, seed, scale);
  return std::vector<float>(t.data<float>(), t.data<float>() + n);
}

// A backend tensor of `shape` holding `values` (NaN-filled when empty), at element `offset` of a
// larger allocation when offset > 0 (a view whose pointer is only 4-byte aligned).
Tensor upload(Backend& backend, const Shape& shape, const std::vector<float>& values, int64_t offset = 0) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const Tensor whole = Tensor::empty(backend.allocator(), {n + offset}, DTYPE_F32, MEM_WORKSPACE);
  std::vector<float> host(static_cast<size_t>(n + offset), NAN);
  std::copy(values.begin(), values.end(), host.begin() + offset);
  backend.write(whole, host.data());
  return whole.view(offset, shape);
}

std::vector<float> download(Backend& backend, const Tensor& t) {
  std::vector<float> host(static_cast<size_t>(t.numel()));
  backend.read(t, host.data());
  return host;
}

std::vector<uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<uint32_t> b;
  for (float x : v) b.push_back(std::bit_cast<uint32_t>(x));
  return b;
}

// ---------------------------------------------------------------- dropout and the quantizers

class BackendLowPrecisionTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string skip;
    backend_ = test::op_test_backend(GetParam(), &BackendCapabilities::low_precision, &skip);
    if (!backend_) GTEST_SKIP() << skip;
  }

  // op(backend, x, out) with x (shape, at `offset`) holding `x` and out NaN-filled; out's bits on
  // the CPU and on the backend under test must be equal.
  void expect_bitwise(const std::string& what, const Shape& shape, const std::vector<float>& x, int64_t offset,
                      const std::function<void(Backend&, const Tensor&, const Tensor&)>& op) {
    const auto run = [&](Backend& backend) {
      const Tensor xt = upload(backend, shape, x, offset), out = upload(backend, shape, {}, offset);
      op(backend, xt, out);
      return bits_of(download(backend, out));
    };
    const std::vector<uint32_t> want = run(*cpu_), got = run(*backend_);
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << what << ": element " << i << " (x = " << x[i] << ") on " << GetParam()
                                 << std::hex << " is 0x" << got[i] << ", the CPU's 0x" << want[i];
    }
  }

  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  std::unique_ptr<Backend> backend_;
};

// Inverted dropout with the Philox mask: p = 0 (all kept, scaled by 1), 0.1, 0.5 and 0.9 over
// n = 4099 (a partial last group of four) holding inf, NaN and signed zeros; out of place, in
// place, and on views starting one element into their allocation (unaligned for float4); two draws.
TEST_P(BackendLowPrecisionTest, DropoutIsTheCpuMaskBitwise) {
  const int64_t n = 4099;
  std::vector<float> x = uniform(n, 71, 10.0);
  const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f};
  std::copy(std::begin(specials), std::end(specials), x.begin() + 100);
  for (const RoundingDraw draw : {RoundingDraw{0x5EEDD12Bull, 5, 9}, RoundingDraw{(1ull << 40) + 3, 0, 0}}) {
    for (const float p : {0.0f, 0.1f, 0.5f, 0.9f}) {
      for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
        const std::string what = str_cat("dropout p ", p, " seed ", draw.seed, " offset ", offset);
        expect_bitwise(what, {n}, x, offset,
                       [&](Backend& b, const Tensor& t, const Tensor& out) { b.dropout(t, out, p, draw); });
        expect_bitwise(what + " in place", {n}, x, offset, [&](Backend& b, const Tensor& t, const Tensor& out) {
          b.dropout(t, t, p, draw);
          b.copy(t, out);
        });
      }
    }
  }
  const Tensor t = upload(*backend_, {8}, std::vector<float>(8, 1.0f));
  EXPECT_NE(test::error_of([&] { backend_->dropout(t, t, 1.0f, {}); }).find("dropout"), std::string::npos);
  const Tensor short_out = upload(*backend_, {7}, {});
  EXPECT_NE(test::error_of([&] { backend_->dropout(t, short_out, 0.5f, {}); }).find("dropout"), std::string::npos);
}

// Block scaling on blocks the recipe's shapes miss: 3 x 5 (several quant blocks per device tile,
// a ragged edge), 2 x 300 (wider than one tile of threads), 1 x 1 and 37 x 611 (a block taller
// than wide, with an edge), on a (37, 611) tensor whose first rows hold inf and NaN (a block
// scale of inf: x / inf and inf / inf); E4M3 saturating and E5M2 not.
TEST_P(BackendLowPrecisionTest, FakeQuantBlocksOnEveryTileShape) {
  const int64_t rows = 37, cols = 611;
  std::vector<float> x = uniform(rows * cols, 81, 50.0);
  x[3] = INFINITY;
  x[cols + 400] = NAN;
  x[2 * cols + 7] = -INFINITY;
  struct Block {
    int64_t r, c;
  };
  for (const auto& [f, saturate] : {std::pair{FMT_E4M3, true}, std::pair{FMT_E5M2, false}}) {
    const NumberGrid g = number_grid(f, saturate);
    for (const Block blk : {Block{3, 5}, Block{2, 300}, Block{1, 1}, Block{37, 611}, Block{128, 128}}) {
      expect_bitwise(str_cat("fake_quant_blocks ", format_info(f).name, " ", blk.r, "x", blk.c), {rows, cols}, x, 0,
                     [&](Backend& b, const Tensor& t, const Tensor& out) { b.fake_quant_blocks(t, out, g, blk.r, blk.c); });
    }
  }
}

// The elementwise quantizers and the block formats on views one element into their allocation
// (the kernels' element-by-element path), MXFP4 / NVFP4 with rows that are not whole blocks, and
// amax there too.
TEST_P(BackendLowPrecisionTest, QuantizersOnUnalignedViewsAndRaggedRows) {
  const int64_t rows = 9, cols = 53;
  std::vector<float> x = uniform(rows * cols, 91, 20.0);
  x[10] = NAN;
  x[11] = -INFINITY;
  const NumberGrid e4m3 = number_grid(FMT_E4M3, false);
  for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
    const std::string at = str_cat(" offset ", offset);
    expect_bitwise("fake_quant" + at, {rows, cols}, x, offset,
                   [&](Backend& b, const Tensor& t, const Tensor& out) { b.fake_quant(t, out, e4m3, 2.5f, 0.5f); });
    expect_bitwise("round_bf16 stochastic" + at, {rows, cols}, x, offset, [&](Backend& b, const Tensor& t, const Tensor& out) {
      b.round_bf16(t, true, RoundingDraw{42, 1, 2});
      b.copy(t, out);
    });
    std::vector<float> finite = x;
    finite[10] = 1.0f, finite[11] = -2.0f;
    expect_bitwise("fake_quant_mxfp4" + at, {rows, cols}, finite, offset,
                   [&](Backend& b, const Tensor& t, const Tensor& out) { b.fake_quant_mxfp4(t, out); });
    expect_bitwise("fake_quant_nvfp4" + at, {rows, cols}, finite, offset,
                   [&](Backend& b, const Tensor& t, const Tensor& out) { b.fake_quant_nvfp4(t, out); });
    const auto amax = [&](Backend& b) { return std::bit_cast<uint32_t>(b.amax(upload(b, {rows, cols}, finite, offset))); };
    EXPECT_EQ(amax(*backend_), amax(*cpu_)) << "amax" << at;
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendLowPrecisionTest,
                         ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// ---------------------------------------------------------------- bf16 attention

class BackendBf16AttentionTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string skip;
    backend_ = test::op_test_backend(GetParam(), &BackendCapabilities::bf16_attention, &skip);
    if (!backend_) GTEST_SKIP() << skip;
  }

  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  std::unique_ptr<Backend> backend_;
};

struct AttentionCase {
  int64_t B, T, H, KV, hd;
  int64_t width() const { return (H + 2 * KV) * hd; }
  std::string name() const { return str_cat("B ", B, " T ", T, " H ", H, " KV ", KV, " hd ", hd); }
};

// ||got - want||_2 / ||want||_2.
double rms_rel(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    err += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(err / std::max(norm, 1e-300));
}

// max |got - want| / max |want|, and whether every element of got is finite where want is.
double max_rel(const std::vector<float>& got, const std::vector<float>& want, bool* all_written) {
  double err = 0.0, scale = 0.0;
  *all_written = got.size() == want.size();
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    if (std::isfinite(want[i]) && !std::isfinite(got[i])) *all_written = false;
    err = std::max(err, std::fabs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
  }
  return err / std::max(scale, 1e-30);
}

// Forward, then the backward from the forward's own out and probs, against the CPU backend's run
// of both on the same inputs: MHA, GQA and MQA at T = 17 with hd = 8 and an hd of 6 (not a
// multiple of 4: the element-by-element copies); T = 70 (beyond the CPU's 64-row block, the
// softmax's 4 registers per lane); T = 1030 (the softmax that streams its row).
TEST_P(BackendBf16AttentionTest, ForwardAndBackwardMatchTheCpu) {
  for (const AttentionCase& c : {AttentionCase{2, 17, 4, 4, 8}, AttentionCase{2, 17, 6, 2, 8},
                                 AttentionCase{1, 17, 3, 1, 8}, AttentionCase{2, 17, 2, 1, 6},
                                 AttentionCase{2, 70, 4, 2, 16}, AttentionCase{1, 1030, 1, 1, 8}}) {
    const std::vector<float> qkv = uniform(c.B * c.T * c.width(), 101, 2.0);  // scaled: a peaked softmax
    const std::vector<float> dout = uniform(c.B * c.T * c.H * c.hd, 102, 1.0);
    struct Result {
      std::vector<float> out, probs, dqkv;
    };
    const auto run = [&](Backend& b, bool bf16) {
      const Tensor q = upload(b, {c.B, c.T, c.width()}, qkv), d = upload(b, {c.B, c.T, c.H * c.hd}, dout);
      const Tensor out = upload(b, {c.B, c.T, c.H * c.hd}, {}), probs = upload(b, {c.B, c.H, c.T, c.T}, {});
      const Tensor dq = upload(b, {c.B, c.T, c.width()}, {});
      if (bf16) {
        b.attention_forward_bf16(q, out, probs, c.H, c.KV);
        b.attention_backward_bf16(d, q, out, probs, dq, c.H, c.KV);
      } else {
        b.attention_forward(q, out, probs, c.H, c.KV, 0);
        b.attention_backward(d, q, out, probs, dq, c.H, c.KV, 0);
      }
      return Result{download(b, out), download(b, probs), download(b, dq)};
    };
    const Result want = run(*cpu_, true), got = run(*backend_, true), fp32 = run(*cpu_, false);
    for (const auto& [name, g, w, f, tol] : {std::tuple{"out", &got.out, &want.out, &fp32.out, kBf16Tol},
                                             std::tuple{"probs", &got.probs, &want.probs, &fp32.probs, kProbsTol},
                                             std::tuple{"dqkv", &got.dqkv, &want.dqkv, &fp32.dqkv, kBf16Tol}}) {
      bool written = false;
      const double err = max_rel(*g, *w, &written), rms = rms_rel(*g, *w), rounding = rms_rel(*f, *w);
      EXPECT_TRUE(written) << c.name() << ": " << name << " has unwritten (NaN) elements on " << GetParam();
      EXPECT_LE(err, tol) << c.name() << ": " << name << " on " << GetParam();
      EXPECT_LE(rms, kBf16RmsTol) << c.name() << ": " << name << " on " << GetParam();
      // The bf16 rounding itself is what the CPU's fp32 attention lacks: the test can see it.
      EXPECT_GT(rounding, 4 * kBf16RmsTol) << c.name() << ": " << name << ": the fp32 attention is too close";
    }
  }
}

// The flash attention in bf16 (flash_attention_forward_bf16 / _backward_bf16) against the CPU
// backend's (Backend's default: qkv and dout rounded to bf16, then the fp32 flash kernels). The
// CUDA backend runs head_dim 64 and 128 on tensor cores (cuda_flash_mma.cu), which also round
// the unnormalized P and dS to bf16 for their products: one bf16 rounding (2^-8 relative) more
// per product than the CPU, so out and dqkv agree within 2e-2 of the largest element and 5e-3
// in RMS (the kernel's exactness is tested against double attention in test_cuda_sim_mma.cpp);
// lse within 1e-2. hd 8 takes the default path on every backend.
TEST_P(BackendBf16AttentionTest, FlashForwardAndBackwardMatchTheCpu) {
  for (const AttentionCase& c : {AttentionCase{2, 70, 4, 2, 64}, AttentionCase{1, 40, 2, 1, 128},
                                 AttentionCase{2, 17, 4, 2, 8}}) {
    const std::vector<float> qkv = uniform(c.B * c.T * c.width(), 201, 1.0);
    const std::vector<float> dout = uniform(c.B * c.T * c.H * c.hd, 202, 1.0);
    struct Result {
      std::vector<float> out, lse, dqkv;
    };
    const auto run = [&](Backend& b) {
      const Tensor q = upload(b, {c.B, c.T, c.width()}, qkv), d = upload(b, {c.B, c.T, c.H * c.hd}, dout);
      const Tensor out = upload(b, {c.B, c.T, c.H * c.hd}, {}), lse = upload(b, {c.B, c.H, c.T}, {});
      const Tensor dq = upload(b, {c.B, c.T, c.width()}, {});
      b.flash_attention_forward_bf16(q, out, lse, c.H, c.KV);
      b.flash_attention_backward_bf16(d, q, out, lse, dq, c.H, c.KV);
      return Result{download(b, out), download(b, lse), download(b, dq)};
    };
    const Result want = run(*cpu_), got = run(*backend_);
    for (const auto& [name, g, w] : {std::tuple{"out", &got.out, &want.out}, std::tuple{"dqkv", &got.dqkv, &want.dqkv}}) {
      bool written = false;
      const double err = max_rel(*g, *w, &written), rms = rms_rel(*g, *w);
      EXPECT_TRUE(written) << c.name() << ": " << name << " has unwritten (NaN) elements on " << GetParam();
      EXPECT_LE(err, 2e-2) << c.name() << ": " << name << " on " << GetParam();
      EXPECT_LE(rms, 5e-3) << c.name() << ": " << name << " on " << GetParam();
      std::printf("[ flash16  ] %s %s on %s: max %.2e, rms %.2e\n", c.name().c_str(), name, GetParam().c_str(), err, rms);
    }
    double lse_err = 0.0;
    for (size_t i = 0; i < want.lse.size(); ++i) lse_err = std::max(lse_err, std::fabs(double(got.lse[i]) - want.lse[i]));
    EXPECT_LE(lse_err, 1e-2) << c.name() << ": lse on " << GetParam();
  }
}

// O kept in bf16 (precision.activations = bf16 with flash attention in bf16): on each backend the
// bf16 out holds the bits of its f32 out rounded by cast(), lse is the same, and the backward's
// dqkv is bitwise the one computed from the f32 O widened from those bf16 bits (D = rowsum(dO o O)
// of the bf16 O). A backward given the unrounded O instead gives other bits: the test can tell.
// A bf16 dqkv is the f32 one rounded, with either O.
TEST_P(BackendBf16AttentionTest, FlashWithABf16OutputIsTheF32OutputRounded) {
  for (const AttentionCase& c : {AttentionCase{2, 70, 4, 2, 64}, AttentionCase{1, 40, 2, 1, 128},
                                 AttentionCase{2, 17, 4, 2, 8}}) {
    Backend& b = *backend_;
    const int64_t n_out = c.B * c.T * c.H * c.hd;
    const Tensor q = upload(b, {c.B, c.T, c.width()}, uniform(c.B * c.T * c.width(), 301, 1.0));
    const Tensor d = upload(b, {c.B, c.T, c.H * c.hd}, uniform(n_out, 302, 1.0));
    const Tensor out = upload(b, {c.B, c.T, c.H * c.hd}, {}), lse = upload(b, {c.B, c.H, c.T}, {});
    const Tensor out16 = Tensor::empty(b.allocator(), out.shape(), DTYPE_BF16, MEM_WORKSPACE);
    const Tensor rounded = Tensor::empty(b.allocator(), out.shape(), DTYPE_BF16, MEM_WORKSPACE);
    const Tensor lse16 = upload(b, {c.B, c.H, c.T}, {});
    b.flash_attention_forward_bf16(q, out, lse, c.H, c.KV);
    b.flash_attention_forward_bf16(q, out16, lse16, c.H, c.KV);
    b.cast(out, rounded);
    std::vector<uint16_t> got16(static_cast<size_t>(n_out)), want16(static_cast<size_t>(n_out));
    b.read(out16, got16.data());
    b.read(rounded, want16.data());
    EXPECT_TRUE(got16 == want16) << c.name() << ": the bf16 O is not the f32 O rounded on " << GetParam();
    EXPECT_TRUE(bits_of(download(b, lse16)) == bits_of(download(b, lse))) << c.name() << ": lse on " << GetParam();

    const Tensor widened = upload(b, out.shape(), {});
    b.cast(out16, widened);
    const Tensor dq16 = upload(b, {c.B, c.T, c.width()}, {}), dq_wide = upload(b, {c.B, c.T, c.width()}, {});
    const Tensor dq32 = upload(b, {c.B, c.T, c.width()}, {});
    b.flash_attention_backward_bf16(d, q, out16, lse, dq16, c.H, c.KV);
    b.flash_attention_backward_bf16(d, q, widened, lse, dq_wide, c.H, c.KV);
    b.flash_attention_backward_bf16(d, q, out, lse, dq32, c.H, c.KV);
    EXPECT_TRUE(bits_of(download(b, dq16)) == bits_of(download(b, dq_wide)))
        << c.name() << ": dqkv from the bf16 O is not the one from its widened values on " << GetParam();
    EXPECT_FALSE(bits_of(download(b, dq16)) == bits_of(download(b, dq32)))
        << c.name() << ": dqkv does not depend on O's rounding (D read from the unrounded O?) on " << GetParam();
    // dqkv wanted in bf16 (LayerPlan::qkv_dy_bf16), with O in bf16 and in f32: the f32 dqkv rounded.
    for (const Tensor& o : {out16, out}) {
      const Tensor g16 = Tensor::empty(b.allocator(), {c.B, c.T, c.width()}, DTYPE_BF16, MEM_WORKSPACE);
      const Tensor g_rounded = Tensor::empty(b.allocator(), {c.B, c.T, c.width()}, DTYPE_BF16, MEM_WORKSPACE);
      const Tensor g32 = upload(b, {c.B, c.T, c.width()}, {});
      b.flash_attention_backward_bf16(d, q, o, lse, g16, c.H, c.KV);
      b.flash_attention_backward_bf16(d, q, o, lse, g32, c.H, c.KV);
      b.cast(g32, g_rounded);
      std::vector<uint16_t> got(static_cast<size_t>(g16.numel())), want(static_cast<size_t>(g16.numel()));
      b.read(g16, got.data());
      b.read(g_rounded, want.data());
      EXPECT_TRUE(got == want) << c.name() << ": a bf16 dqkv is not the f32 one rounded (O in "
                               << dtype_name(o.dtype()) << ") on " << GetParam();
    }
  }
  // A bf16 out for an f64 qkv is refused naming the op.
  Allocator& a = backend_->allocator();
  const Tensor qkv64 = Tensor::zeros(a, {1, 4, 24}, DTYPE_F64, MEM_WORKSPACE);
  const Tensor o16 = Tensor::zeros(a, {1, 4, 8}, DTYPE_BF16, MEM_WORKSPACE);
  const Tensor lse64 = Tensor::zeros(a, {1, 1, 4}, DTYPE_F64, MEM_WORKSPACE);
  EXPECT_NE(test::error_of([&] { backend_->flash_attention_forward_bf16(qkv64, o16, lse64, 1, 1); })
                .find("flash_attention_forward_bf16: out"),
            std::string::npos);
}

// qkv and dout as a bf16 GEMM writes them (precision.outputs = bf16): on each backend a bf16
// input gives the bits of its f32 source (both round it to those bf16 values), dout's through D
// too: the backward from a bf16 dout is bitwise the one from its widened values (on CUDA not the
// one from the unrounded f32 dout, whose D the kernels sum unrounded: the test can tell). Mixed inputs (one bf16,
// one f32) and f32 views only 4-byte aligned (read from bf16 copies on CUDA, so D from the rounded
// dout, as the CPU's default always computes it) give the same bits.
TEST_P(BackendBf16AttentionTest, FlashWithBf16InputsIsTheF32InputsRounded) {
  for (const AttentionCase& c : {AttentionCase{2, 70, 4, 2, 64}, AttentionCase{1, 40, 2, 1, 128},
                                 AttentionCase{2, 17, 4, 2, 8}}) {
    Backend& b = *backend_;
    const int64_t n_out = c.B * c.T * c.H * c.hd;
    const Shape qkv_shape{c.B, c.T, c.width()}, out_shape{c.B, c.T, c.H * c.hd}, lse_shape{c.B, c.H, c.T};
    const std::vector<float> qkv = uniform(c.B * c.T * c.width(), 401, 1.0), dout = uniform(n_out, 402, 1.0);
    const Tensor q = upload(b, qkv_shape, qkv), d = upload(b, out_shape, dout);
    const Tensor q_view = upload(b, qkv_shape, qkv, 1), d_view = upload(b, out_shape, dout, 1);
    const auto bf16_of = [&](const Tensor& x) {
      const Tensor y = Tensor::empty(b.allocator(), x.shape(), DTYPE_BF16, MEM_WORKSPACE);
      b.cast(x, y);
      return y;
    };
    const Tensor q16 = bf16_of(q), d16 = bf16_of(d);
    const Tensor d_rounded = upload(b, out_shape, {});
    b.cast(d16, d_rounded);
    struct Result {
      std::vector<float> out, lse, dqkv;
    };
    const auto run = [&](const Tensor& qq, const Tensor& dd) {
      const Tensor out = upload(b, out_shape, {}), lse = upload(b, lse_shape, {}), dq = upload(b, qkv_shape, {});
      b.flash_attention_forward_bf16(qq, out, lse, c.H, c.KV);
      b.flash_attention_backward_bf16(dd, qq, out, lse, dq, c.H, c.KV);
      return Result{download(b, out), download(b, lse), download(b, dq)};
    };
    const Result want = run(q, d_rounded);
    for (const auto& [what, got] : {std::pair{"bf16 qkv and dout", run(q16, d16)}, std::pair{"bf16 dout", run(q, d16)},
                                    std::pair{"bf16 qkv", run(q16, d_rounded)},
                                    std::pair{"a 4-byte aligned qkv", run(q_view, d_rounded)},
                                    std::pair{"a 4-byte aligned dout (read rounded)", run(q, d_view)}}) {
      EXPECT_TRUE(bits_of(got.out) == bits_of(want.out)) << c.name() << ": out with " << what << " on " << GetParam();
      EXPECT_TRUE(bits_of(got.lse) == bits_of(want.lse)) << c.name() << ": lse with " << what << " on " << GetParam();
      EXPECT_TRUE(bits_of(got.dqkv) == bits_of(want.dqkv))
          << c.name() << ": dqkv with " << what << " on " << GetParam();
    }
    // CUDA's kernels take an aligned f32 dout's D from its unrounded values (the CPU's default
    // rounds dout first): other bits, which the comparisons above would see.
    if (GetParam() == "cuda" && c.hd != 8) {
      EXPECT_FALSE(bits_of(run(q, d).dqkv) == bits_of(want.dqkv)) << c.name() << ": D from the unrounded dout";
    }
  }
}

// Operands of the wrong dtype or shape fail naming the op.
TEST_P(BackendBf16AttentionTest, BadOperandsAreOneLineErrorsNamingTheOp) {
  Allocator& a = backend_->allocator();
  const Tensor qkv = Tensor::zeros(a, {1, 4, 24}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor out = Tensor::zeros(a, {1, 4, 8}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor probs = Tensor::zeros(a, {1, 1, 4, 4}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor bad_probs = Tensor::zeros(a, {1, 1, 4, 3}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor qkv64 = Tensor::zeros(a, {1, 4, 24}, DTYPE_F64, MEM_WORKSPACE);
  EXPECT_NE(test::error_of([&] { backend_->attention_forward_bf16(qkv, out, bad_probs, 1, 1); }).find("attention_forward_bf16"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { backend_->attention_forward_bf16(qkv64, out, probs, 1, 1); }).find("attention_forward_bf16"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { backend_->attention_backward_bf16(out, qkv, out, bad_probs, qkv, 1, 1); })
                .find("attention_backward_bf16"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendBf16AttentionTest,
                         ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace loom
