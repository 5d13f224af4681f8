// Number-format codecs (exhaustive over every code of the 8-bit and 4-bit formats and of fp16,
// against the CPU's own F16C conversion for fp16), rounding ties, saturation, NaN, subnormals,
// stochastic rounding's bias, MXFP4/NVFP4 block quantization against the formula, and the
// dynamic loss scaler's exact trajectory (torch.amp.GradScaler's rule).
#include <gtest/gtest.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/philox.h"
#include "loom/precision/formats.h"
#include "loom/precision/loss_scaler.h"

namespace loom {
namespace {

// An independent decode: sign, exponent and mantissa fields to a value by integer arithmetic.
double reference_decode(int exp_bits, int man_bits, int bias, uint32_t code) {
  const int bits = 1 + exp_bits + man_bits;
  const double sign = (code >> (bits - 1)) & 1 ? -1.0 : 1.0;
  const int e = static_cast<int>((code >> man_bits) & ((1u << exp_bits) - 1));
  const int m = static_cast<int>(code & ((1u << man_bits) - 1));
  if (e == 0) return sign * m * std::pow(2.0, 1 - bias - man_bits);
  return sign * (1.0 + m / std::pow(2.0, man_bits)) * std::pow(2.0, e - bias);
}

TEST(FormatsTest, E4M3EveryCodeDecodesAndRoundTrips) {
  int nans = 0;
  for (uint32_t c = 0; c < 256; ++c) {
    const float v = decode(FMT_E4M3, c);
    if ((c & 0x7F) == 0x7F) {  // S.1111.111 is the only NaN; E4M3fn has no infinity
      EXPECT_TRUE(std::isnan(v)) << c;
      ++nans;
      continue;
    }
    EXPECT_EQ(v, reference_decode(4, 3, 7, c)) << c;
    EXPECT_EQ(encode(FMT_E4M3, v), c) << c << " " << v;  // -0 keeps its sign
  }
  EXPECT_EQ(nans, 2);
  EXPECT_EQ(decode(FMT_E4M3, 0x7E), 448.0f);
  EXPECT_EQ(decode(FMT_E4M3, 0x08), std::ldexp(1.0f, -6));  // min normal
  EXPECT_EQ(decode(FMT_E4M3, 0x01), std::ldexp(1.0f, -9));  // min subnormal
}

TEST(FormatsTest, E5M2EveryCodeDecodesAndRoundTrips) {
  int nans = 0, infs = 0;
  for (uint32_t c = 0; c < 256; ++c) {
    const float v = decode(FMT_E5M2, c);
    if (((c >> 2) & 0x1F) == 0x1F) {
      if ((c & 3) == 0) {
        EXPECT_TRUE(std::isinf(v)) << c;
        EXPECT_EQ(encode(FMT_E5M2, v, false), c);
        ++infs;
      } else {
        EXPECT_TRUE(std::isnan(v)) << c;
        ++nans;
      }
      continue;
    }
    EXPECT_EQ(v, reference_decode(5, 2, 15, c)) << c;
    EXPECT_EQ(encode(FMT_E5M2, v), c) << c;
  }
  EXPECT_EQ(nans, 6);
  EXPECT_EQ(infs, 2);
  EXPECT_EQ(decode(FMT_E5M2, 0x7B), 57344.0f);
  EXPECT_EQ(decode(FMT_E5M2, 0x04), std::ldexp(1.0f, -14));
  EXPECT_EQ(decode(FMT_E5M2, 0x01), std::ldexp(1.0f, -16));
}

TEST(FormatsTest, E2M1HasExactlyTheSixteenFp4Values) {
  const float expected[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (uint32_t c = 0; c < 16; ++c) {
    const float v = decode(FMT_E2M1, c);
    EXPECT_EQ(v, (c & 8 ? -1.0f : 1.0f) * expected[c & 7]) << c;
    EXPECT_EQ(encode(FMT_E2M1, v), c) << c;
  }
  EXPECT_EQ(encode(FMT_E2M1, 100.0f, false), 0x7u);  // no inf or NaN in E2M1: always saturates
  EXPECT_EQ(encode(FMT_E2M1, -INFINITY, false), 0xFu);
  EXPECT_EQ(encode(FMT_E2M1, 2.5f), 0x4u);   // tie between 2 (even) and 3
  EXPECT_EQ(encode(FMT_E2M1, 5.0f), 0x6u);   // tie between 4 (even) and 6
  EXPECT_EQ(encode(FMT_E2M1, 0.25f), 0x0u);  // tie between 0 (even) and 0.5
}

// Between every pair of neighbouring values: the midpoint goes to the even code, a hair either
// side goes to the nearer one.
void expect_ties_to_even(MiniFormat f, uint32_t codes) {
  std::vector<std::pair<double, uint32_t>> positive;
  for (uint32_t c = 0; c < codes / 2; ++c) {
    const float v = decode(f, c);
    if (std::isfinite(v)) positive.emplace_back(v, c);
  }
  std::sort(positive.begin(), positive.end());
  for (size_t k = 0; k + 1 < positive.size(); ++k) {
    const auto [a, ca] = positive[k];
    const auto [b, cb] = positive[k + 1];
    const double mid = (a + b) / 2;
    ASSERT_EQ(static_cast<double>(static_cast<float>(mid)), mid);
    EXPECT_EQ(encode(f, static_cast<float>(mid)), (ca % 2 == 0) ? ca : cb) << format_info(f).name << " " << mid;
    EXPECT_EQ(encode(f, std::nextafter(static_cast<float>(mid), 0.0f)), ca);
    EXPECT_EQ(encode(f, std::nextafter(static_cast<float>(mid), INFINITY)), cb);
    EXPECT_EQ(encode(f, -static_cast<float>(mid)), ((ca % 2 == 0) ? ca : cb) | (codes / 2)) << "negative";
  }
}

TEST(FormatsTest, RoundToNearestEvenAtEveryMidpoint) {
  expect_ties_to_even(FMT_E4M3, 256);
  expect_ties_to_even(FMT_E5M2, 256);
  expect_ties_to_even(FMT_E2M1, 16);
}

TEST(FormatsTest, SaturationAndNonSaturatingOverflow) {
  EXPECT_EQ(encode(FMT_E4M3, 1e6f), 0x7Eu);
  EXPECT_EQ(encode(FMT_E4M3, -1e6f), 0xFEu);
  EXPECT_EQ(encode(FMT_E4M3, 1e6f, false), 0x7Fu);  // no inf: NaN
  EXPECT_EQ(encode(FMT_E4M3, 464.0f, false), 0x7Eu);  // the tie above max rounds to max (even)
  EXPECT_EQ(encode(FMT_E4M3, 465.0f, false), 0x7Fu);
  EXPECT_EQ(encode(FMT_E4M3, INFINITY), 0x7Eu);
  EXPECT_EQ(encode(FMT_E5M2, 1e6f), 0x7Bu);
  EXPECT_EQ(encode(FMT_E5M2, 1e6f, false), 0x7Cu);  // inf
  EXPECT_EQ(encode(FMT_E5M2, -INFINITY, false), 0xFCu);
  EXPECT_TRUE(std::isnan(decode(FMT_E4M3, encode(FMT_E4M3, NAN))));
  EXPECT_TRUE(std::isnan(decode(FMT_E5M2, encode(FMT_E5M2, NAN))));
  // Subnormals and underflow: half the smallest subnormal ties to 0 (even), more rounds up.
  EXPECT_EQ(encode(FMT_E4M3, std::ldexp(1.0f, -10)), 0x00u);
  EXPECT_EQ(encode(FMT_E4M3, 1.5f * std::ldexp(1.0f, -10)), 0x01u);
  EXPECT_EQ(encode(FMT_E5M2, -std::ldexp(1.0f, -18)), 0x80u);  // -0
}

TEST(FormatsTest, Fp16MatchesTheCpuF16cConversionOnEveryCodeAndRandomFloats) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float hw = _cvtsh_ss(static_cast<unsigned short>(c));
    const float v = decode(FMT_FP16, c);
    if (std::isnan(hw)) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    ASSERT_EQ(v, hw) << c;
    ASSERT_EQ(encode(FMT_FP16, v, false), c) << c;
  }
  std::vector<float> u(200000);
  philox_fill_uniform(u.data(), static_cast<int64_t>(u.size()), 7, 0, 0);
  for (size_t k = 0; k < u.size(); k += 2) {
    // log-uniform magnitudes from 2^-30 (below fp16's subnormals) to 2^18 (past its max)
    const float x = (u[k + 1] < 0.5f ? -1.0f : 1.0f) * std::exp2(-30.0f + 48.0f * u[k]);
    const uint32_t hw = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    ASSERT_EQ(encode(FMT_FP16, x, false), hw) << x;
  }
}

TEST(FormatsTest, StochasticRoundingIsUnbiasedOverAMillionDraws) {
  struct Case {
    MiniFormat f;
    float x;
  };
  for (const Case c : {Case{FMT_E4M3, 1.03f}, Case{FMT_E5M2, -0.2f}, Case{FMT_E2M1, 2.3f}, Case{FMT_E4M3, 0.0041f}}) {
    const int n = 1000000;
    double sum = 0.0;
    uint32_t lo_code = encode(c.f, c.x), seen_other = 0;
    for (int i = 0; i < n; i += 4) {
      const PhiloxCounter r = philox4x32_10({static_cast<uint32_t>(i), 0, 0, 0}, {11, static_cast<uint32_t>(c.f)});
      for (uint32_t bits : r) {
        const uint32_t code = encode(c.f, c.x, true, ROUND_STOCHASTIC, bits);
        seen_other += code != lo_code;
        sum += decode(c.f, code);
      }
    }
    const double mean = sum / n;
    // The two neighbours are at most one spacing q apart; the mean's standard error is <= q/(2 sqrt(n)).
    const double q = std::fabs(decode(c.f, lo_code ^ 1u) - decode(c.f, lo_code)) * 2;
    EXPECT_NEAR(mean, c.x, 4.0 * q / (2.0 * std::sqrt(static_cast<double>(n)))) << format_info(c.f).name << " " << c.x;
    EXPECT_GT(seen_other, 0u);  // both neighbours drawn
  }
}

TEST(FormatsTest, E8M0IsAPowerOfTwoScale) {
  for (int c = 0; c < 255; ++c) EXPECT_EQ(decode_e8m0(static_cast<uint8_t>(c)), std::ldexp(1.0, c - 127)) << c;
  EXPECT_TRUE(std::isnan(decode_e8m0(0xFF)));
  EXPECT_EQ(encode_e8m0(3.0f), 128);  // 2^floor(log2 3) = 2
  EXPECT_EQ(encode_e8m0(1.0f), 127);
  EXPECT_EQ(encode_e8m0(0.0f), 0xFF);
  EXPECT_EQ(encode_e8m0(-1.0f), 0xFF);
}

std::vector<float> test_values(size_t n, uint64_t seed) {
  std::vector<float> x(n);
  philox_fill_normal(x.data(), static_cast<int64_t>(n), seed, 0, 0, 0.0f, 1.0f);
  for (size_t i = 0; i < n; i += 37) x[i] *= 50.0f;  // outliers, so blocks differ in scale
  std::fill(x.begin() + 64, x.begin() + 96, 0.0f);  // an all-zero block
  return x;
}

TEST(FormatsTest, Mxfp4MatchesTheOcpFormulaBitForBit) {
  const std::vector<float> x = test_values(32 * 7 + 5, 3);  // a partial last block
  std::vector<uint8_t> codes(x.size()), scales((x.size() + 31) / 32);
  mxfp4_quantize(x, codes, scales);
  std::vector<float> back(x.size());
  mxfp4_dequantize(codes, scales, back);
  for (size_t b = 0; b < scales.size(); ++b) {
    float amax = 0.0f;
    for (size_t k = b * 32; k < std::min(x.size(), b * 32 + 32); ++k) amax = std::max(amax, std::fabs(x[k]));
    const double X = amax > 0 ? std::pow(2.0, std::floor(std::log2(amax)) - 2) : std::pow(2.0, -127);
    for (size_t k = b * 32; k < std::min(x.size(), b * 32 + 32); ++k) {
      // nearest of the E2M1 grid to x/X (saturating at 6), ties to the even code
      const double v = std::clamp(x[k] / X, -6.0, 6.0);
      double best = 0.0;
      for (float g : {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f}) {
        if (std::fabs(std::fabs(v) - g) < std::fabs(std::fabs(v) - best)) best = g;
      }
      EXPECT_EQ(static_cast<double>(back[k]), std::copysign(best, v) * X) << k;  // no ties in these random values
    }
  }
  EXPECT_EQ((32 * 4 + 8) / 32.0, 4.25);  // bits per element
}

TEST(FormatsTest, Nvfp4MatchesTheTwoLevelScaleFormula) {
  const std::vector<float> x = test_values(16 * 9, 4);
  std::vector<uint8_t> codes(x.size()), scales(9);
  const float global = nvfp4_quantize(x, codes, scales);
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  EXPECT_EQ(global, amax / (448.0f * 6.0f));
  std::vector<float> back(x.size());
  nvfp4_dequantize(codes, scales, global, back);
  for (size_t b = 0; b < 9; ++b) {
    float bmax = 0.0f;
    for (size_t k = b * 16; k < b * 16 + 16; ++k) bmax = std::max(bmax, std::fabs(x[k]));
    const float s = decode(FMT_E4M3, encode(FMT_E4M3, (bmax / 6.0f) / global)) * global;
    for (size_t k = b * 16; k < b * 16 + 16; ++k) {
      const float expected = s == 0.0f ? 0.0f : decode(FMT_E2M1, encode(FMT_E2M1, x[k] / s)) * s;
      EXPECT_EQ(back[k], expected) << k;
      if (s > 0.0f) {
        EXPECT_LE(std::fabs(back[k] - x[k]), 1.0f * s + 1e-6f) << k;  // half of E2M1's widest gap (2)
      }
    }
  }
}

// bf16 GEMM (oneDNN, AVX-512 BF16): products of the bf16-rounded inputs, accumulated in fp32,
// against a float64 reference on those same rounded inputs; every transpose combination,
// a batch, beta accumulation and a bias, on odd shapes.
TEST(Bf16GemmTest, MatchesFloat64OnTheRoundedInputs) {
  auto backend = make_cpu_backend();
  Allocator& alloc = backend->allocator();
  const int64_t batch = 2, m = 37, n = 29, k = 301;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      std::vector<float> a32(batch * m * k), b32(batch * k * n), bias(n), c0(batch * m * n);
      philox_fill_normal(a32.data(), static_cast<int64_t>(a32.size()), 1, 0, 0, 0.0f, 1.0f);
      philox_fill_normal(b32.data(), static_cast<int64_t>(b32.size()), 2, 0, 0, 0.0f, 1.0f);
      philox_fill_normal(bias.data(), n, 3, 0, 0, 0.0f, 1.0f);
      philox_fill_normal(c0.data(), static_cast<int64_t>(c0.size()), 4, 0, 0, 0.0f, 1.0f);
      const Shape sa = ta ? Shape{batch * k, m} : Shape{batch * m, k}, sb = tb ? Shape{batch * n, k} : Shape{batch * k, n};
      Tensor a = Tensor::empty(alloc, sa, DTYPE_BF16, MEM_WORKSPACE), b = Tensor::empty(alloc, sb, DTYPE_BF16, MEM_WORKSPACE);
      Tensor c = Tensor::empty(alloc, {batch * m, n}, DTYPE_F32, MEM_WORKSPACE), tbias = Tensor::empty(alloc, {n}, DTYPE_F32, MEM_WORKSPACE);
      for (size_t i = 0; i < a32.size(); ++i) a.data<bf16>()[i] = f32_to_bf16(a32[i]);
      for (size_t i = 0; i < b32.size(); ++i) b.data<bf16>()[i] = f32_to_bf16(b32[i]);
      std::copy(bias.begin(), bias.end(), tbias.data<float>());
      std::copy(c0.begin(), c0.end(), c.data<float>());
      GemmSpec spec;
      spec.trans_a = ta, spec.trans_b = tb, spec.alpha = 0.5f, spec.beta = 1.0f, spec.batch = batch;
      backend->gemm(a, b, c, spec, &tbias);
      double err = 0.0, scale = 0.0;
      for (int64_t p = 0; p < batch; ++p) {
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            double acc = 0.0;
            for (int64_t q = 0; q < k; ++q) {
              const int64_t ia = p * m * k + (ta ? q * m + i : i * k + q), ib = p * k * n + (tb ? j * k + q : q * n + j);
              acc += static_cast<double>(bf16_to_f32(a.data<bf16>()[ia])) * bf16_to_f32(b.data<bf16>()[ib]);
            }
            const double ref = 0.5 * acc + c0[static_cast<size_t>(p * m * n + i * n + j)] + bias[static_cast<size_t>(j)];
            err = std::max(err, std::fabs(ref - c.data<float>()[p * m * n + i * n + j]));
            scale = std::max(scale, std::fabs(ref));
          }
        }
      }
      EXPECT_LT(err / scale, 2e-6) << "trans_a " << ta << " trans_b " << tb;  // fp32 accumulation, K = 301
    }
  }
}

// ------------------------------------------------------------------ dynamic loss scaling

TEST(LossScalerTest, GrowsAfter2000CleanStepsAndBacksOffOnOverflow) {
  DynamicLossScaler s{LossScalerConfig{}};
  EXPECT_EQ(s.scale(), 65536.0f);
  for (int i = 0; i < 1999; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 65536.0f);
  s.update(false);
  EXPECT_EQ(s.scale(), 131072.0f);  // 2000 clean steps
  for (int i = 0; i < 1998; ++i) s.update(false);
  s.update(true);  // an overflow at the 1999th step: back off, counter reset
  EXPECT_EQ(s.scale(), 65536.0f);
  EXPECT_EQ(s.state().growth_tracker, 0);
  for (int i = 0; i < 1999; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 65536.0f);
  s.update(false);
  EXPECT_EQ(s.scale(), 131072.0f);
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.scale(), 32768.0f);
}

TEST(LossScalerTest, AnOverflowAtStep1999GivesHalfTheScaleAndResetsTheCounter) {
  DynamicLossScaler s{LossScalerConfig{}};
  for (int i = 0; i < 1998; ++i) s.update(false);
  s.update(true);
  EXPECT_EQ(s.scale(), 32768.0f);
  for (int i = 0; i < 1999; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 32768.0f);  // the counter restarted at the overflow
  s.update(false);
  EXPECT_EQ(s.scale(), 65536.0f);
}

TEST(LossScalerTest, NeverGrowsToInfinity) {
  LossScalerConfig c;
  c.init_scale = std::ldexp(1.0, 127);
  c.growth_interval = 1;
  DynamicLossScaler s(c);
  for (int i = 0; i < 5; ++i) s.update(false);
  EXPECT_EQ(s.scale(), std::ldexp(1.0f, 127));
}

TEST(LossScalerTest, HysteresisWaitsForConsecutiveOverflows) {
  LossScalerConfig c;
  c.hysteresis = 2;
  DynamicLossScaler s(c);
  s.update(true);
  EXPECT_EQ(s.scale(), 65536.0f);  // one overflow tolerated
  s.update(false);                 // not consecutive: the tolerance comes back
  s.update(true);
  EXPECT_EQ(s.scale(), 65536.0f);
  s.update(true);
  EXPECT_EQ(s.scale(), 32768.0f);
}

TEST(LossScalerTest, UnscaleMultipliesByTheFp32InverseAndFindsNonFinite) {
  LossScalerConfig c;
  c.init_scale = 3.0;  // 1/3 is not exact: inv = float32(1/float64(3))
  DynamicLossScaler s(c);
  auto backend = make_cpu_backend();
  auto tensor = [&](std::vector<float> v) {
    Tensor t = Tensor::empty(backend->allocator(), {static_cast<int64_t>(v.size())}, DTYPE_F32, MEM_GRADIENTS);
    backend->write(t, v.data());
    return t;
  };
  const Tensor g = tensor({3.0f, -6.0f, 1.0f});
  EXPECT_FALSE(s.unscale(*backend, g));
  const float inv = static_cast<float>(1.0 / 3.0);
  EXPECT_EQ(g.data<float>()[0], 3.0f * inv);
  EXPECT_EQ(g.data<float>()[2], inv);
  EXPECT_TRUE(s.unscale(*backend, tensor({1.0f, INFINITY, 2.0f})));
  EXPECT_TRUE(s.unscale(*backend, tensor({NAN})));
}

}  // namespace
}  // namespace loom
