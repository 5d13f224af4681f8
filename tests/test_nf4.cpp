// QLoRA's NF4 storage with double quantization (precision/nf4.h; Dettmers et al. 2023, sec. 3):
// the code table and its construction from the normal quantiles, the nearest-code rule and its
// ties, exact values on hand-made blocks, the error bounds of both quantization levels on normal
// weights, the storage formula for a 4096 x 4096 weight and Llama-3-8B's linear layers, an
// independent PyTorch implementation (tools/nf4_reference.py) bit for bit, and the dequantizing
// Backend op against the host reference.
#include <gtest/gtest.h>

#include <unistd.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/dtype.h"
#include "loom/core/philox.h"
#include "loom/precision/nf4.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

// As QLoRA's Appendix E (and bitsandbytes) prints them.
constexpr double kPrinted[16] = {-1.0,
                                 -0.6961928009986877,
                                 -0.5250730514526367,
                                 -0.39491748809814453,
                                 -0.28444138169288635,
                                 -0.18477343022823334,
                                 -0.09105003625154495,
                                 0.0,
                                 0.07958029955625534,
                                 0.16093020141124725,
                                 0.24611230194568634,
                                 0.33791524171829224,
                                 0.44070982933044434,
                                 0.5626170039176941,
                                 0.7229568362236023,
                                 1.0};

std::vector<float> normal_weights(int64_t n, uint64_t seed, float stddev) {
  std::vector<float> w(static_cast<size_t>(n));
  philox_fill_normal(w.data(), n, seed, 0, 0, 0.0f, stddev);
  return w;
}

std::vector<float> single_quantized(const std::vector<float>& x, std::vector<uint8_t>& codes, std::vector<float>& absmax) {
  const auto n = static_cast<int64_t>(x.size());
  codes.assign(static_cast<size_t>((n + 1) / 2), 0);
  absmax.assign(static_cast<size_t>((n + kNf4Block - 1) / kNf4Block), 0.0f);
  nf4_encode(x, codes, absmax);
  std::vector<float> out(x.size());
  nf4_decode(codes, absmax, 0, out);
  return out;
}

std::vector<float> dequantized(const Nf4Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  nf4_dequantize(t, 0, out);
  return out;
}

// Half the widest gap between neighbouring codes: the largest rounding error of a normalised value.
double half_largest_gap() {
  double gap = 0.0;
  for (size_t i = 0; i + 1 < kNf4Codes.size(); ++i) gap = std::max(gap, double{kNf4Codes[i + 1]} - double{kNf4Codes[i]});
  return gap / 2;
}

TEST(Nf4Codes, TableIsQlorasTable) {
  for (size_t i = 0; i < 16; ++i) EXPECT_EQ(static_cast<double>(kNf4Codes[i]), kPrinted[i]) << i;
  for (size_t i = 0; i + 1 < 16; ++i) EXPECT_LT(kNf4Codes[i], kNf4Codes[i + 1]);
  EXPECT_EQ(kNf4Codes[kNf4ZeroCode], 0.0f);
  EXPECT_EQ(kNf4Codes.front(), -1.0f);
  EXPECT_EQ(kNf4Codes.back(), 1.0f);
}

TEST(Nf4Codes, ConstructionFromNormalQuantilesGivesTheTable) {
  EXPECT_EQ(normal_quantile(0.5), 0.0);
  EXPECT_NEAR(normal_quantile(0.975), 1.959963984540054, 1e-14);
  EXPECT_NEAR(normal_quantile(0.025), -1.959963984540054, 1e-14);
  const std::array<float, 16> built = nf4_construct_codes();
  for (size_t i = 0; i < 16; ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(built[i]), std::bit_cast<uint32_t>(kNf4Codes[i]))
        << i << ": " << built[i] << " vs " << kNf4Codes[i];
  }
}

// Each code maps to itself; a value at the exact midpoint of two codes goes to the lower one, the
// float just above it to the upper one (the midpoints float32 cannot hold: the floats on either side).
TEST(Nf4Codes, NearestCodeAndTiesToTheLowerCode) {
  for (int i = 0; i < 16; ++i) EXPECT_EQ(nf4_nearest_code(kNf4Codes[static_cast<size_t>(i)]), i);
  int ties = 0;
  for (int i = 0; i + 1 < 16; ++i) {
    const double mid = (double{kNf4Codes[static_cast<size_t>(i)]} + double{kNf4Codes[static_cast<size_t>(i) + 1]}) / 2;
    float below = static_cast<float>(mid), above = below;
    if (static_cast<double>(below) == mid) {
      ++ties;
      EXPECT_EQ(nf4_nearest_code(below), i) << "tie at " << mid;
      above = std::nextafter(below, 2.0f);
      below = std::nextafter(below, -2.0f);
    } else if (static_cast<double>(below) > mid) {
      below = std::nextafter(below, -2.0f);
    } else {
      above = std::nextafter(above, 2.0f);
    }
    EXPECT_EQ(nf4_nearest_code(below), i) << mid;
    EXPECT_EQ(nf4_nearest_code(above), i + 1) << mid;
  }
  EXPECT_GT(ties, 0);
  EXPECT_EQ(nf4_nearest_code(-0.0f), kNf4ZeroCode);
}

// A block whose largest element is negative (code 0, -1 exactly), zeros (the 0 code), the block's
// positive maximum (code 15) and code values times the absmax; an all-zero block; an odd tail.
TEST(Nf4Quantize, HandMadeBlocksHaveExactCodesAndValues) {
  std::vector<float> x(64 + 64 + 3, 0.0f);
  x[0] = -2.5f, x[1] = 0.0f, x[2] = 2.5f, x[3] = kNf4Codes[9] * 2.5f, x[4] = kNf4Codes[3] * 2.5f;
  x[128] = 1.0f, x[129] = -0.25f, x[130] = 0.03f;  // the tail block of 3
  std::vector<uint8_t> codes;
  std::vector<float> absmax;
  const std::vector<float> out = single_quantized(x, codes, absmax);
  ASSERT_EQ(codes.size(), 66u);
  ASSERT_EQ(absmax.size(), 3u);
  EXPECT_EQ(absmax[0], 2.5f);
  EXPECT_EQ(absmax[1], 0.0f);
  EXPECT_EQ(absmax[2], 1.0f);
  EXPECT_EQ(codes[0], 0x07);         // -1, 0
  EXPECT_EQ(codes[1], 0xF9);         // 1, code 9
  EXPECT_EQ(codes[2] >> 4, 3);       // code 3
  for (size_t i = 3; i < 64; ++i) EXPECT_EQ(codes[i], 0x77) << i;  // the zeros of blocks 0 and 1
  EXPECT_EQ(codes[64], 0xF4);        // 1 and -0.25 -> code 4 (-0.284)
  EXPECT_EQ(codes[65], 0x70);        // 0.03 -> 0 (nearer than 0.0796), then the pad nibble
  EXPECT_EQ(out[0], -2.5f);
  EXPECT_EQ(out[1], 0.0f);
  EXPECT_EQ(out[2], 2.5f);
  EXPECT_EQ(out[3], kNf4Codes[9] * 2.5f);
  for (size_t i = 64; i < 128; ++i) EXPECT_EQ(out[i], 0.0f);
  EXPECT_EQ(out[128], 1.0f);
  EXPECT_EQ(out[129], kNf4Codes[4]);
  EXPECT_EQ(out[130], 0.0f);
  // Double quantized: zeros stay exactly zero, the codes are the same.
  const Nf4Tensor t = nf4_quantize(x, 1, static_cast<int64_t>(x.size()));
  EXPECT_EQ(t.codes, codes);
  const std::vector<float> dq = dequantized(t);
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] == 0.0f) {
      EXPECT_EQ(dq[i], 0.0f) << i;
    }
  }
  EXPECT_NE(test::error_of([] {
              std::vector<float> bad(100, 1.0f);
              bad[70] = NAN;
              (void)nf4_quantize(bad, 1, 100);
            }).find("block 1"),
            std::string::npos);
}

// Normal weights, 512 x 4096: every element within half the widest code gap times its block's
// absmax (single quantization), plus the scale's error |c^ - c| (double quantization); the RMS
// errors relative to the weights' RMS are printed.
TEST(Nf4Quantize, ErrorsOnNormalWeightsAreWithinTheBounds) {
  const int64_t rows = 512, cols = 4096, n = rows * cols;
  const std::vector<float> x = normal_weights(n, 42, 0.02f);
  std::vector<uint8_t> codes;
  std::vector<float> absmax;
  const std::vector<float> single = single_quantized(x, codes, absmax);
  const Nf4Tensor t = nf4_quantize(x, rows, cols);
  const std::vector<float> dq = dequantized(t);
  const double half_gap = half_largest_gap();
  double sq = 0.0, err_single = 0.0, err_double = 0.0;
  for (int64_t e = 0; e < n; ++e) {
    const auto i = static_cast<size_t>(e);
    const double c = absmax[i / 64], c_hat = t.block_absmax(e / kNf4Block);
    const double bound = c * half_gap * (1 + 1e-6);
    ASSERT_LE(std::fabs(double{x[i]} - single[i]), bound) << e;
    ASSERT_LE(std::fabs(double{x[i]} - dq[i]), bound + std::fabs(c - c_hat) * (1 + 1e-6)) << e;
    sq += double{x[i]} * x[i];
    err_single += (double{x[i]} - single[i]) * (double{x[i]} - single[i]);
    err_double += (double{x[i]} - dq[i]) * (double{x[i]} - dq[i]);
  }
  const double rel_single = std::sqrt(err_single / sq), rel_double = std::sqrt(err_double / sq);
  std::cout << "NF4 on N(0, 0.02) weights 512x4096: RMS error / RMS weight = " << rel_single
            << " (f32 scales), " << rel_double << " (double-quantized scales); bound half gap = " << half_gap << "\n";
  EXPECT_LT(rel_single, 0.1);
  EXPECT_LT(rel_double, rel_single * 1.01);
}

// The double-quantized scales are within the 8-bit bound: |c^ - c| <= step / 2 (+ the last
// float rounding), so each dequantized element is within |code| step / 2 of the single-quantized one.
TEST(Nf4Quantize, DoubleQuantizedScalesAreWithinTheEightBitBound) {
  const int64_t rows = 300, cols = 1000, n = rows * cols;  // 4688 blocks (the last of 48), 19 groups (the last short)
  std::vector<float> x = normal_weights(n, 7, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) x[static_cast<size_t>(r * cols + c)] *= 0.5f + static_cast<float>(r % 7);
  }
  std::vector<uint8_t> codes;
  std::vector<float> absmax;
  const std::vector<float> single = single_quantized(x, codes, absmax);
  const Nf4Tensor t = nf4_quantize(x, rows, cols);
  ASSERT_EQ(t.absmax_codes.size(), absmax.size());
  ASSERT_EQ(t.absmax_steps.size(), (absmax.size() + 255) / 256);
  double sum = 0.0;
  for (const float c : absmax) sum += c;
  EXPECT_EQ(t.absmax_mean, static_cast<float>(sum / static_cast<double>(absmax.size())));
  for (size_t g = 0; g < t.absmax_steps.size(); ++g) {
    int max_q = 0;
    for (size_t b = g * 256; b < std::min(absmax.size(), g * 256 + 256); ++b) max_q = std::max(max_q, std::abs(int{t.absmax_codes[b]}));
    EXPECT_EQ(max_q, 127) << "group " << g;  // the group's largest |c - mean| takes the full range
  }
  double worst = 0.0;
  for (size_t b = 0; b < absmax.size(); ++b) {
    const double step = t.absmax_steps[b / 256], c_hat = t.block_absmax(static_cast<int64_t>(b));
    const double err = std::fabs(c_hat - absmax[b]);
    ASSERT_LE(err, step / 2 + std::ldexp(std::fabs(c_hat), -23)) << b;
    worst = std::max(worst, err / step);
  }
  std::cout << "NF4 double quantization: worst |c^ - c| = " << worst << " steps\n";
  const std::vector<float> dq = dequantized(t);
  for (int64_t e = 0; e < n; ++e) {
    const auto i = static_cast<size_t>(e);
    const double code = kNf4Codes[static_cast<size_t>(nf4_nearest_code(x[i] / absmax[i / 64]))];
    const double step = t.absmax_steps[i / 64 / 256];
    ASSERT_LE(std::fabs(double{dq[i]} - single[i]), std::fabs(code) * step / 2 + 1e-6 * std::fabs(single[i]) + 1e-30) << e;
  }
}

// Rows [r0, r0 + k) dequantized on their own are the whole tensor's rows, also where a row starts
// inside a block and in the middle of a byte (an odd number of columns).
TEST(Nf4Quantize, RowRangesAreTheWholeTensorsRows) {
  const int64_t rows = 37, cols = 131;
  const std::vector<float> x = normal_weights(rows * cols, 3, 1.0f);
  const Nf4Tensor t = nf4_quantize(x, rows, cols);
  const std::vector<float> whole = dequantized(t);
  for (const int64_t r0 : {0, 1, 5, 36}) {
    const int64_t k = std::min<int64_t>(4, rows - r0);
    std::vector<float> part(static_cast<size_t>(k * cols));
    nf4_dequantize(t, r0 * cols, part);
    for (int64_t i = 0; i < k * cols; ++i) ASSERT_EQ(part[static_cast<size_t>(i)], whole[static_cast<size_t>(r0 * cols + i)]);
  }
  std::vector<float> past(2);
  EXPECT_NE(test::error_of([&] { nf4_dequantize(t, rows * cols - 1, past); }).find("nf4_dequantize"), std::string::npos);
}

// Bytes: ceil(n/2) codes + B int8 scale codes + 4 ceil(B/256) + 4; for n a multiple of 64 x 256
// bits per parameter = 4 + 8/64 + 32/(64 256) + 32/n (every term a binary fraction: exact).
TEST(Nf4Bytes, BytesAndBitsPerParameterAreTheFormula) {
  const auto formula_bits = [](double n) { return 4.0 + 8.0 / 64 + 32.0 / (64 * 256) + 32.0 / n; };
  {
    const int64_t n = 4096 * 4096;
    const Nf4Tensor t = nf4_quantize(normal_weights(n, 1, 0.02f), 4096, 4096);
    EXPECT_EQ(t.bytes(), static_cast<size_t>(n / 2 + n / 64 + 4 * (n / 64 / 256) + 4));
    EXPECT_EQ(t.bytes(), nf4_bytes(n));
    EXPECT_EQ(t.bits_per_parameter(), formula_bits(static_cast<double>(n)));
    std::cout << "NF4 4096x4096: " << t.bytes() << " bytes, " << std::setprecision(12) << t.bits_per_parameter()
              << " bits/param (f32 scales: " << 4.0 + 32.0 / 64 << ")\n";
  }
  // Llama-3-8B's linear layers (out, in): 32 x (q, k, v, o, gate, up, down); the embeddings and
  // the head stay in bf16 in QLoRA.
  struct Matrix {
    int64_t out, in;
  };
  const Matrix layer[] = {{4096, 4096}, {1024, 4096}, {1024, 4096}, {4096, 4096},
                          {14336, 4096}, {14336, 4096}, {4096, 14336}};
  size_t bytes = 0;
  int64_t params = 0, matrices = 0;
  for (int l = 0; l < 32; ++l) {
    for (const Matrix& m : layer) {
      const int64_t n = m.out * m.in;
      ASSERT_EQ(n % (64 * 256), 0);
      EXPECT_EQ(8.0 * static_cast<double>(nf4_bytes(n)) / static_cast<double>(n), formula_bits(static_cast<double>(n)));
      bytes += nf4_bytes(n), params += n, ++matrices;
    }
  }
  EXPECT_EQ(params, 6979321856);
  const double bits = 8.0 * static_cast<double>(bytes) / static_cast<double>(params);
  EXPECT_EQ(bytes, static_cast<size_t>(params / 2 + params / 64 + params / 4096 + 4 * matrices));
  EXPECT_NEAR(bits, 4.0 + 8.0 / 64 + 32.0 / (64 * 256) + 32.0 * static_cast<double>(matrices) / static_cast<double>(params), 1e-15);
  std::cout << "NF4 Llama-3-8B linear layers: " << params << " parameters, " << bytes << " bytes, "
            << std::setprecision(12) << bits << " bits/param\n";
  // Shapes with a tail block and an odd count: the stored bytes are the formula's too.
  for (const Matrix m : {Matrix{37, 131}, Matrix{1, 1}, Matrix{3, 64}, Matrix{257, 64}}) {
    const Nf4Tensor t = nf4_quantize(normal_weights(m.out * m.in, 5, 1.0f), m.out, m.in);
    EXPECT_EQ(t.bytes(), nf4_bytes(m.out * m.in)) << m.out << "x" << m.in;
  }
}

// ---------------------------------------------------------------- PyTorch, bit for bit

// tools/nf4_reference.py's fixture: $LOOM_FIXTURE_DIR/nf4.safetensors (ctest's make_nf4_fixture
// writes it), else written here into a temporary folder.
class Nf4Reference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { path_ = test::python_fixture("nf4_reference.py", "nf4.safetensors", temp_); }
  static void TearDownTestSuite() {
    if (!temp_.empty()) fs::remove_all(temp_);
  }
  void SetUp() override {
    ASSERT_TRUE(!path_.empty() && fs::exists(path_)) << "tools/nf4_reference.py failed (Debian's python3-torch)";
  }

  template <typename T>
  static std::vector<T> read(const SafetensorsFile& f, const std::string& name) {
    return test::entry_values<T>(f, name);
  }

  static inline fs::path path_, temp_;
};

template <typename T>
void expect_bitwise(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(T)), 0) << what << " element " << i << ": " << +got[i] << " vs " << +want[i];
  }
}

TEST_F(Nf4Reference, CodesScalesAndValuesMatchPyTorchBitForBit) {
  const SafetensorsFile f = SafetensorsFile::read(path_.string());
  expect_bitwise(read<float>(f, "table"), std::vector<float>(kNf4Codes.begin(), kNf4Codes.end()), "table");
  int cases = 0;
  for (const char* name : {"normal", "tail", "scaled", "tiny"}) {
    const std::string c = name;
    const Shape& shape = f.shape(c + ".weight");
    const std::vector<float> w = read<float>(f, c + ".weight");
    std::vector<uint8_t> codes;
    std::vector<float> absmax;
    (void)single_quantized(w, codes, absmax);
    expect_bitwise(absmax, read<float>(f, c + ".absmax"), c + ".absmax");
    const Nf4Tensor t = nf4_quantize(w, shape[0], shape[1]);
    expect_bitwise(t.codes, read<uint8_t>(f, c + ".codes"), c + ".codes");
    std::vector<uint8_t> scale_codes(t.absmax_codes.size());
    std::memcpy(scale_codes.data(), t.absmax_codes.data(), scale_codes.size());
    expect_bitwise(scale_codes, read<uint8_t>(f, c + ".absmax_codes"), c + ".absmax_codes");
    expect_bitwise(t.absmax_steps, read<float>(f, c + ".absmax_steps"), c + ".absmax_steps");
    expect_bitwise(std::vector<float>{t.absmax_mean}, read<float>(f, c + ".absmax_mean"), c + ".absmax_mean");
    expect_bitwise(dequantized(t), read<float>(f, c + ".dequantized"), c + ".dequantized");
    ++cases;
  }
  EXPECT_EQ(cases, 4);
}

// ---------------------------------------------------------------- the Backend op

// Backend::nf4_dequantize on the CPU backend and on the backend under test ("strict": the CPU
// kernels on memory host code may not read; "cuda" where built, visible and stating
// nf4) against nf4_dequantize: whole tensors and row ranges, f32 bitwise and bf16 as
// the f32 values rounded to nearest even.
class Nf4BackendOp : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string skip;
    backend_ = test::op_test_backend(GetParam(), &BackendCapabilities::nf4, &skip);
    if (!backend_) GTEST_SKIP() << skip;
  }

  // Elements [first, first + count) through the op, as f32 bit patterns (bf16: widened).
  static std::vector<uint32_t> run(Backend& backend, const Nf4Tensor& t, int64_t first, int64_t count, DType dtype) {
    const Nf4Device d = nf4_to_backend(t, backend, MEM_PARAMETERS);
    const Tensor out = Tensor::empty(backend.allocator(), {count}, dtype, MEM_WORKSPACE);
    backend.nf4_dequantize(d.codes, d.absmax_codes, d.absmax_steps, d.spec, first, out);
    std::vector<uint32_t> bits(static_cast<size_t>(count));
    if (dtype == DTYPE_F32) {
      backend.read(out, bits.data());
      return bits;
    }
    std::vector<uint16_t> half(static_cast<size_t>(count));
    backend.read(out, half.data());
    for (size_t i = 0; i < half.size(); ++i) bits[i] = static_cast<uint32_t>(half[i]) << 16;
    return bits;
  }

  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  std::unique_ptr<Backend> backend_;
};

TEST_P(Nf4BackendOp, DequantizesAsTheHostReference) {
  struct Case {
    int64_t rows, cols;
  };
  for (const Case s : {Case{96, 200}, Case{37, 131}, Case{300, 1000}}) {
    const std::vector<float> x = normal_weights(s.rows * s.cols, 11, 0.05f);
    const Nf4Tensor t = nf4_quantize(x, s.rows, s.cols);
    const std::vector<float> want = dequantized(t);
    struct Range {
      int64_t first, count;
    };
    const int64_t n = t.numel();
    for (const Range r : {Range{0, n}, Range{s.cols, 3 * s.cols}, Range{n - s.cols, s.cols}, Range{65, 130}, Range{1, 1}}) {
      for (const DType dtype : {DTYPE_F32, DTYPE_BF16}) {
        const std::string what = std::to_string(s.rows) + "x" + std::to_string(s.cols) + " [" + std::to_string(r.first) +
                                 ", +" + std::to_string(r.count) + ") " + std::string(dtype_name(dtype));
        const std::vector<uint32_t> cpu = run(*cpu_, t, r.first, r.count, dtype);
        const std::vector<uint32_t> got = run(*backend_, t, r.first, r.count, dtype);
        for (int64_t i = 0; i < r.count; ++i) {
          const float v = want[static_cast<size_t>(r.first + i)];
          const uint32_t expect = dtype == DTYPE_F32 ? std::bit_cast<uint32_t>(v)
                                                     : static_cast<uint32_t>(f32_to_bf16(v).bits) << 16;
          ASSERT_EQ(cpu[static_cast<size_t>(i)], expect) << what << " element " << i;
          ASSERT_EQ(got[static_cast<size_t>(i)], expect) << what << " element " << i << " on " << GetParam();
        }
      }
    }
  }
}

TEST_P(Nf4BackendOp, BadOperandsNameTheOp) {
  const Nf4Tensor t = nf4_quantize(normal_weights(256, 1, 1.0f), 2, 128);
  const Nf4Device d = nf4_to_backend(t, *backend_, MEM_PARAMETERS);
  Allocator& a = backend_->allocator();
  const Tensor out = Tensor::empty(a, {256}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor too_long = Tensor::empty(a, {257}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor f64 = Tensor::empty(a, {256}, DTYPE_F64, MEM_WORKSPACE);
  for (const std::string& e : {test::error_of([&] { backend_->nf4_dequantize(d.codes, d.absmax_codes, d.absmax_steps, d.spec, 0, too_long); }),
                               test::error_of([&] { backend_->nf4_dequantize(d.codes, d.absmax_codes, d.absmax_steps, d.spec, 0, f64); }),
                               test::error_of([&] { backend_->nf4_dequantize(d.absmax_steps, d.absmax_codes, d.absmax_steps, d.spec, 0, out); })}) {
    EXPECT_NE(e.find("nf4_dequantize"), std::string::npos) << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Nf4, Nf4BackendOp, ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace loom
