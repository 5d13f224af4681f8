// The low-precision ops of the Backend interface (backend.h: amax, fake_quant, quant_codes_bf16,
// fake_quant_blocks, fake_quant_mxfp4, fake_quant_nvfp4, round_bf16), in the manner of
// test_backend_compress_ops.cpp: each case builds inputs in host memory, runs the op on the CPU
// backend and on the backend under test (copies written with Backend::write, read back with
// Backend::read), and a naive reference written here from the format definitions: the exact
// per-element codecs of precision/formats.h (encode / decode: IEEE fp16, OCP FP8 E4M3 / E5M2,
// FP4 E2M1, the MX and NVFP4 block scales), bf16 rounding on the bits, Philox for stochastic
// rounding. Tolerance: bitwise against both (a NaN matches any NaN of the reference).
// Backends: "strict" (the CPU kernels on memory host code may not read, tests/strict_backend.h)
// and "cuda", skipped where the build has no CUDA backend, no GPU is visible or the backend does
// not state capabilities().low_precision (the CUDA backend's defaults throw).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/core/philox.h"
#include "loom/precision/formats.h"
#include "loom/precision/quantize.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

// The host values a case compares: an op's output tensor, as f32 or bf16 bit patterns, or its
// returned scalar.
using Bits = std::vector<uint32_t>;

Bits bits_of(const std::vector<float>& v) {
  Bits b;
  for (float x : v) b.push_back(std::bit_cast<uint32_t>(x));
  return b;
}

bool same_value(uint32_t a, uint32_t b, bool f32) {
  if (a == b) return true;
  return f32 && std::isnan(std::bit_cast<float>(a)) && std::isnan(std::bit_cast<float>(b));
}

class BackendQuantOpsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string skip;
    backend_ = test::op_test_backend(GetParam(), &BackendCapabilities::low_precision, &skip);
    if (!backend_) GTEST_SKIP() << skip;
  }

  // f32 values: uniform in [-scale, scale), with the special values `specials` at the front.
  std::vector<float> values(int64_t n, uint64_t seed, double scale, const std::vector<float>& specials = {}) {
    const Tensor t = test::random_tensor(host_, {n}, DTYPE_F32, seed, scale);
    std::vector<float> v(t.data<float>(), t.data<float>() + n);
    std::copy(specials.begin(), specials.end(), v.begin());
    return v;
  }

  // Runs op(backend, x, out) with x (shape) holding `x` and out (shape, out_dtype) NaN-filled;
  // returns out's bits (bf16: one per element), or op's returned scalar when `scalar` is set.
  Bits run(Backend& backend, const Shape& shape, const std::vector<float>& x, DType out_dtype,
           const std::function<float(Backend&, const Tensor&, const Tensor&)>& op, bool scalar = false) {
    const Tensor xt = Tensor::empty(backend.allocator(), shape, DTYPE_F32, MEM_WORKSPACE);
    backend.write(xt, x.data());
    const Tensor out = Tensor::empty(backend.allocator(), shape, out_dtype, MEM_WORKSPACE);
    std::vector<uint8_t> nan(out.nbytes(), 0xFF);
    backend.write(out, nan.data());
    const float r = op(backend, xt, out);
    if (scalar) return {std::bit_cast<uint32_t>(r)};
    std::vector<uint8_t> bytes(out.nbytes());
    backend.read(out, bytes.data());
    Bits b(static_cast<size_t>(out.numel()));
    for (size_t i = 0; i < b.size(); ++i) {
      if (out_dtype == DTYPE_BF16) b[i] = static_cast<uint32_t>(bytes[2 * i]) | static_cast<uint32_t>(bytes[2 * i + 1]) << 8;
      else std::memcpy(&b[i], bytes.data() + 4 * i, 4);
    }
    return b;
  }

  // The op on the CPU backend and on the backend under test against the reference bits.
  void check(const std::string& what, const Shape& shape, const std::vector<float>& x, DType out_dtype,
             const std::function<float(Backend&, const Tensor&, const Tensor&)>& op, const Bits& want,
             bool scalar = false) {
    const Bits cpu = run(*cpu_, shape, x, out_dtype, op, scalar), got = run(*backend_, shape, x, out_dtype, op, scalar);
    ASSERT_EQ(cpu.size(), want.size()) << what;
    ASSERT_EQ(got.size(), want.size()) << what;
    const bool f32 = out_dtype == DTYPE_F32;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_TRUE(same_value(cpu[i], want[i], f32)) << what << ": element " << i << " (x = " << x[i] << ") on the CPU "
                                                    << std::hex << "0x" << cpu[i] << ", the reference's 0x" << want[i];
      ASSERT_EQ(got[i], cpu[i]) << what << ": element " << i << " on " << GetParam() << " differs from the CPU";
    }
  }

  CpuAllocator host_;
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  std::unique_ptr<Backend> backend_;
};

// The reference: Q(v) = decode(encode(v)) of the exact codec, keeping a NaN a NaN.
float q_ref(MiniFormat f, float v, bool saturate) {
  if (std::isnan(v)) return NAN;
  return decode(f, encode(f, v, saturate));
}

// amax over an odd length and one that spans the threads: the largest |x|; NaN anywhere wins, inf counts.
TEST_P(BackendQuantOpsTest, AmaxIsTheLargestMagnitude) {
  for (const int64_t n : {int64_t{1001}, (int64_t{1} << 20) + 3}) {
    for (const std::vector<float>& specials :
         {std::vector<float>{}, std::vector<float>{-4096.5f}, std::vector<float>{1.0f, -INFINITY},
          std::vector<float>{0.5f, NAN}}) {
      const std::vector<float> x = values(n, 7, 100.0, specials);
      float want = 0.0f;
      bool nan = false;
      for (float v : x) nan = nan || std::isnan(v), want = std::max(want, std::fabs(v));
      check("amax n=" + std::to_string(n), {n}, x, DTYPE_F32,
            [](Backend& b, const Tensor& t, const Tensor&) { return b.amax(t); }, {std::bit_cast<uint32_t>(nan ? NAN : want)},
            true);
    }
  }
}

// fp16 (round_fp16: no saturation, overflow -> inf), E4M3 and E5M2 with a scale and a post factor,
// saturating and not, E2M1; values spanning the subnormals, the normals and overflow.
TEST_P(BackendQuantOpsTest, FakeQuantIsTheCodecOnTheScaledValue) {
  struct Case {
    MiniFormat f;
    bool saturate;
    float scale, post;
    double range;
  };
  const int64_t n = 4099;
  for (const Case& c : {Case{FMT_FP16, false, 1.0f, 1.0f, 70000.0}, Case{FMT_FP16, false, 1.0f, 1.0f, 1e-4},
                        Case{FMT_E4M3, true, 3.0f, 0.25f, 200.0}, Case{FMT_E4M3, false, 1.0f, 1.0f, 500.0},
                        Case{FMT_E5M2, true, 0.5f, 2.0f, 1e5}, Case{FMT_E5M2, false, 1.0f, 1.0f, 6e4},
                        Case{FMT_E4M3, true, 1.0f, 1.0f, 0.01}, Case{FMT_E2M1, true, 1.0f, 1.0f, 8.0}}) {
    const std::vector<float> x = values(n, 11, c.range, {0.0f, -0.0f, NAN, INFINITY, -INFINITY});
    std::vector<float> want;
    for (float v : x) want.push_back(q_ref(c.f, v * c.scale, c.saturate) * c.post);
    const NumberGrid g = number_grid(c.f, c.saturate);
    check(std::string("fake_quant ") + format_info(c.f).name + (c.saturate ? " sat" : ""), {n}, x, DTYPE_F32,
          [&](Backend& b, const Tensor& t, const Tensor& out) { return b.fake_quant(t, out, g, c.scale, c.post), 0.0f; },
          bits_of(want));
    // In place (out aliases x), as round_fp16 runs it.
    check("fake_quant in place", {n}, x, DTYPE_F32,
          [&](Backend& b, const Tensor& t, const Tensor& out) {
            b.fake_quant(t, t, g, c.scale, c.post);
            b.copy(t, out);
            return 0.0f;
          },
          bits_of(want));
  }
}

// The FP8 (and FP4) values as bf16 bit patterns: the upper half of Q(x scale)'s f32 bits.
TEST_P(BackendQuantOpsTest, QuantCodesBf16AreTheQuantizedValuesExactly) {
  const int64_t n = 1537;  // three 512-element chunks and a partial one
  for (const MiniFormat f : {FMT_E4M3, FMT_E5M2, FMT_E2M1}) {
    const std::vector<float> x = values(n, 21, 300.0, {0.0f, -0.0f, 1e9f, -1e9f});
    const float scale = 1.5f;
    Bits want;
    for (float v : x) {
      const uint32_t u = std::bit_cast<uint32_t>(q_ref(f, v * scale, true));
      EXPECT_EQ(u & 0xFFFFu, 0u);  // exactly a bf16
      want.push_back(u >> 16);
    }
    const NumberGrid g = number_grid(f, true);
    check(std::string("quant_codes_bf16 ") + format_info(f).name, {n}, x, DTYPE_BF16,
          [&](Backend& b, const Tensor& t, const Tensor& out) { return b.quant_codes_bf16(t, out, g, scale), 0.0f; }, want);
  }
  EXPECT_NE(test::error_of([&] {
              const Tensor x = Tensor::zeros(backend_->allocator(), {4}, DTYPE_F32, MEM_WORKSPACE);
              const Tensor out = Tensor::zeros(backend_->allocator(), {4}, DTYPE_BF16, MEM_WORKSPACE);
              backend_->quant_codes_bf16(x, out, number_grid(FMT_FP16, true), 1.0f);
            }).find("quant_codes_bf16"),
            std::string::npos);
}

// Block scaling (DeepSeek-V3): s = max(amax_block, 1e-4) / max per block, out = Q(x / s) s; the
// 1 x 128, 128 x 128 and 128 x 1 blocks of the fp8-block recipe on a shape with edge blocks, one
// block of small values (the 1e-4 floor) and one of zeros.
TEST_P(BackendQuantOpsTest, FakeQuantBlocksScalesEachBlockByItsAmax) {
  const int64_t rows = 300, cols = 260;
  std::vector<float> x = values(rows * cols, 31, 10.0);
  float* xp = x.data();
  for (int64_t r = 0; r < 128; ++r) {
    for (int64_t c = 0; c < 128; ++c) xp[r * cols + c] *= 1e-6f;  // below the floor
  }
  for (int64_t c = 0; c < cols; ++c) xp[(rows - 1) * cols + c] = 0.0f;
  struct Block {
    int64_t r, c;
  };
  for (const MiniFormat f : {FMT_E4M3, FMT_E5M2}) {
    const NumberGrid g = number_grid(f, true);
    for (const Block blk : {Block{1, 128}, Block{128, 128}, Block{128, 1}}) {
      std::vector<float> want(x.size());
      float* wp = want.data();
      for (int64_t r0 = 0; r0 < rows; r0 += blk.r) {
        for (int64_t c0 = 0; c0 < cols; c0 += blk.c) {
          float amax = 0.0f;
          for (int64_t r = r0; r < std::min(rows, r0 + blk.r); ++r) {
            for (int64_t c = c0; c < std::min(cols, c0 + blk.c); ++c) amax = std::max(amax, std::fabs(xp[r * cols + c]));
          }
          const float s = std::max(amax, 1e-4f) / static_cast<float>(format_info(f).max);
          for (int64_t r = r0; r < std::min(rows, r0 + blk.r); ++r) {
            for (int64_t c = c0; c < std::min(cols, c0 + blk.c); ++c) {
              wp[r * cols + c] = q_ref(f, xp[r * cols + c] / s, true) * s;
            }
          }
        }
      }
      check("fake_quant_blocks " + std::to_string(blk.r) + "x" + std::to_string(blk.c), {rows, cols}, x, DTYPE_F32,
            [&](Backend& b, const Tensor& t, const Tensor& out) { return b.fake_quant_blocks(t, out, g, blk.r, blk.c), 0.0f; },
            bits_of(want));
    }
  }
}

// MXFP4 (OCP MX v1.0) along rows of 70 (two blocks of 32 and one of 6): the E8M0 scale
// 2^(floor(log2 amax) - 2) and saturating E2M1 elements, as mxfp4_quantize / _dequantize of each
// row; a zero block and a block holding inf give 0 and NaN.
TEST_P(BackendQuantOpsTest, FakeQuantMxfp4IsTheMxCodecPerRow) {
  const int64_t rows = 5, cols = 70;
  std::vector<float> x = values(rows * cols, 41, 3.0);
  for (int64_t c = 0; c < 32; ++c) x[static_cast<size_t>(cols + c)] = 0.0f;  // row 1, block 0: zeros
  x[static_cast<size_t>(2 * cols + 40)] = INFINITY;                          // row 2, block 1
  x[static_cast<size_t>(3 * cols + 3)] = 1e-30f;                             // tiny beside its block
  std::vector<float> want(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    const std::span<const float> row(x.data() + r * cols, static_cast<size_t>(cols));
    std::vector<uint8_t> codes(static_cast<size_t>(cols)), scales(3);
    mxfp4_quantize(row, codes, scales);
    mxfp4_dequantize(codes, scales, std::span<float>(want.data() + r * cols, static_cast<size_t>(cols)));
  }
  check("fake_quant_mxfp4", {rows, cols}, x, DTYPE_F32,
        [](Backend& b, const Tensor& t, const Tensor& out) { return b.fake_quant_mxfp4(t, out), 0.0f; }, bits_of(want));
}

// NVFP4: the tensor scale amax / (448 * 6), E4M3 block scales per 16 along rows of 48 (the rows'
// blocks are then the flat blocks of nvfp4_quantize), E2M1 elements; an all-zero tensor stays
// zero and a tensor holding NaN is NaN everywhere.
TEST_P(BackendQuantOpsTest, FakeQuantNvfp4IsTheNvfp4CodecPerBlock) {
  const int64_t rows = 7, cols = 48;
  std::vector<float> x = values(rows * cols, 51, 50.0);
  for (int64_t c = 0; c < 16; ++c) x[static_cast<size_t>(2 * cols + c)] *= 1e-5f;  // a block of small values
  std::vector<uint8_t> codes(x.size()), scales(x.size() / kNvBlock);
  const float global = nvfp4_quantize(x, codes, scales);
  std::vector<float> want(x.size());
  nvfp4_dequantize(codes, scales, global, want);
  const auto op = [](Backend& b, const Tensor& t, const Tensor& out) { return b.fake_quant_nvfp4(t, out), 0.0f; };
  check("fake_quant_nvfp4", {rows, cols}, x, DTYPE_F32, op, bits_of(want));
  const std::vector<float> zeros(x.size(), 0.0f);
  check("fake_quant_nvfp4 zeros", {rows, cols}, zeros, DTYPE_F32, op, bits_of(zeros));
  std::vector<float> with_nan = x;
  with_nan[100] = NAN;
  check("fake_quant_nvfp4 NaN", {rows, cols}, with_nan, DTYPE_F32, op, bits_of(std::vector<float>(x.size(), NAN)));
}

// bf16 rounding in place: to nearest even on the bits (u + 0x7FFF + the kept lsb, truncated), and
// stochastic with Philox lane i % 4 of counter (i / 4, stream, draw): u + (r >> 16), truncated;
// inf and NaN stay. n = 4099: a partial last group of four.
TEST_P(BackendQuantOpsTest, RoundBf16NearestAndStochastic) {
  const int64_t n = 4099;
  const std::vector<float> x = values(n, 61, 1000.0, {INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 3.4e38f});
  const auto truncate = [](uint32_t u) { return std::bit_cast<float>(u & 0xFFFF0000u); };
  std::vector<float> nearest, stochastic;
  const RoundingDraw draw{0x5EEDB16Full, 3, 17};
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[static_cast<size_t>(i)];
    const uint32_t u = std::bit_cast<uint32_t>(v);
    if (!std::isfinite(v)) {
      nearest.push_back(v), stochastic.push_back(v);
      continue;
    }
    nearest.push_back(truncate(u + 0x7FFFu + ((u >> 16) & 1u)));
    const PhiloxCounter r = philox4x32_10({static_cast<uint32_t>(i / 4), 0, draw.stream, draw.draw},
                                          {static_cast<uint32_t>(draw.seed), static_cast<uint32_t>(draw.seed >> 32)});
    stochastic.push_back(truncate(u + (r[static_cast<size_t>(i % 4)] >> 16)));
  }
  for (const bool sr : {false, true}) {
    check(sr ? "round_bf16 stochastic" : "round_bf16 nearest", {n}, x, DTYPE_F32,
          [&](Backend& b, const Tensor& t, const Tensor& out) {
            b.round_bf16(t, sr, draw);
            b.copy(t, out);
            return 0.0f;
          },
          bits_of(sr ? stochastic : nearest));
  }
}

// Operands of the wrong dtype or size fail naming the op.
TEST_P(BackendQuantOpsTest, BadOperandsAreOneLineErrorsNamingTheOp) {
  Allocator& a = backend_->allocator();
  const Tensor x = Tensor::zeros(a, {8}, DTYPE_F32, MEM_WORKSPACE), short_out = Tensor::zeros(a, {7}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor x64 = Tensor::zeros(a, {8}, DTYPE_F64, MEM_WORKSPACE);
  EXPECT_NE(test::error_of([&] { backend_->fake_quant(x, short_out, number_grid(FMT_E4M3, true), 1, 1); }).find("fake_quant"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { backend_->fake_quant_mxfp4(x, short_out); }).find("fake_quant_mxfp4"), std::string::npos);
  EXPECT_NE(test::error_of([&] { (void)backend_->amax(x64); }).find("amax"), std::string::npos);
  EXPECT_NE(test::error_of([&] { backend_->round_bf16(x64, false, {}); }).find("round_bf16"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendQuantOpsTest, ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace loom
