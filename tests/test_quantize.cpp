// The fast quantizers of precision/quantize.h against the reference codecs of formats.h, bit
// for bit: per-element fake_quant (every code, every tie, a hair either side of it, overflow,
// subnormals, specials and 200k random magnitudes), the bf16 code variant, MXFP4 / NVFP4 block
// fake quantization, DeepSeek-V3 block scaling against a naive per-block formula; bf16 rounding
// (nearest and stochastic: neighbours, unbiasedness, determinism) and amax_of. Delayed scaling
// and the precision policy: test_precision_policy.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/core/philox.h"
#include "loom/precision/formats.h"
#include "loom/precision/policy.h"
#include "loom/precision/quantize.h"

namespace loom {
namespace {

uint32_t bits_of(float x) { return std::bit_cast<uint32_t>(x); }

// Bit-identical, or both NaN (NaN payloads are not part of the contract).
bool same_bits(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b); }

std::string hex(float x) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", bits_of(x));
  return buf;
}

// Compares two arrays bit for bit; reports the first few mismatches with `what(i)` as context.
template <typename Describe>
void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want, Describe what) {
  ASSERT_EQ(got.size(), want.size());
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (same_bits(got[i], want[i])) continue;
    if (++bad <= 8) {
      ADD_FAILURE() << what(i) << ": got " << got[i] << " (" << hex(got[i]) << "), want " << want[i] << " ("
                    << hex(want[i]) << ")";
    }
  }
  EXPECT_EQ(bad, 0u) << "mismatching elements";
}

// Log-uniform magnitudes 2^lo .. 2^hi with random signs, from Philox (seed, stream).
std::vector<float> log_uniform(size_t n, uint64_t seed, uint32_t stream, float lo, float hi) {
  std::vector<float> u(2 * n);
  philox_fill_uniform(u.data(), static_cast<int64_t>(u.size()), seed, stream, 0);
  std::vector<float> x(n);
  for (size_t k = 0; k < n; ++k) x[k] = (u[2 * k + 1] < 0.5f ? -1.0f : 1.0f) * std::exp2(lo + (hi - lo) * u[2 * k]);
  return x;
}

// Every input class the per-element quantizer must get right for format f.
std::vector<float> probe_values(MiniFormat f, bool with_random = true) {
  const MiniFormatInfo& info = format_info(f);
  std::vector<float> v;
  std::vector<double> pos;  // the finite values >= 0, sorted
  for (uint32_t c = 0; c < (1u << info.bits); ++c) {
    const float d = decode(f, c);
    if (std::isnan(d) && f == FMT_E2M1) continue;  // (there are none)
    v.push_back(d);  // every code, both signs (NaN and inf codes included)
    if (std::isfinite(d) && !std::signbit(d)) pos.push_back(d);
  }
  std::sort(pos.begin(), pos.end());
  pos.erase(std::unique(pos.begin(), pos.end()), pos.end());
  auto both = [&](double a) {
    v.push_back(static_cast<float>(a));
    v.push_back(-static_cast<float>(a));
  };
  for (size_t k = 0; k + 1 < pos.size(); ++k) {
    const double mid = (pos[k] + pos[k + 1]) / 2;  // a tie
    EXPECT_EQ(static_cast<double>(static_cast<float>(mid)), mid) << "midpoint not a float";
    const float m = static_cast<float>(mid);
    both(m);
    both(std::nextafter(m, 0.0f));
    both(std::nextafter(m, INFINITY));
  }
  const double mx = info.max, ulp = pos.back() - pos[pos.size() - 2];  // spacing just below max
  EXPECT_EQ(pos.back(), mx);
  const float over = static_cast<float>(mx + ulp / 2);  // the tie above max: rounds to max (even)
  for (float a : {std::nextafter(static_cast<float>(mx), INFINITY), over, std::nextafter(over, 0.0f),
                  std::nextafter(over, INFINITY), static_cast<float>(mx + ulp), static_cast<float>(2 * mx), FLT_MAX}) {
    both(a);
  }
  // fp32 subnormals, the smallest normal, zeros, infinities, NaN.
  for (uint32_t b : {0x00000001u, 0x00000002u, 0x00012345u, 0x00400000u, 0x007FFFFFu, 0x00800000u}) both(std::bit_cast<float>(b));
  both(0.0f);
  both(INFINITY);
  // E2M1: encode() maps NaN to code 0 (the format has no NaN) while fake_quant keeps NaN a NaN,
  // a documented difference, so NaN is not probed for E2M1.
  if (f != FMT_E2M1) both(std::numeric_limits<float>::quiet_NaN());
  if (with_random) {
    const std::vector<float> r = log_uniform(200000, 91, static_cast<uint32_t>(f), -30.0f, 20.0f);
    v.insert(v.end(), r.begin(), r.end());
  }
  return v;
}

constexpr MiniFormat kFormats[] = {FMT_FP16, FMT_E4M3, FMT_E5M2, FMT_E2M1};

// -------------------------------------------------------------------------------- fake_quant

TEST(QuantizeTest, FakeQuantMatchesTheCodecBitForBit) {
  for (MiniFormat f : kFormats) {
    const std::vector<float> x = probe_values(f);
    for (bool sat : {true, false}) {
      std::vector<float> got(x.size()), want(x.size());
      fake_quant(f, x.data(), static_cast<int64_t>(x.size()), 1.0f, 1.0f, sat, got.data());
      for (size_t i = 0; i < x.size(); ++i) want[i] = decode(f, encode(f, x[i], sat));
      expect_same_bits(got, want, [&](size_t i) {
        return std::string(format_info(f).name) + (sat ? " sat" : " nosat") + " x=" + std::to_string(x[i]) + " (" +
               hex(x[i]) + ")";
      });
    }
  }
}

TEST(QuantizeTest, FakeQuantSpotValues) {
  // A few hand-checked values, so the test does not only rest on the codec.
  auto q = [](MiniFormat f, float x, bool sat) {
    float out = 0.0f;
    fake_quant(f, &x, 1, 1.0f, 1.0f, sat, &out);
    return out;
  };
  EXPECT_EQ(q(FMT_E4M3, 464.0f, false), 448.0f);  // tie above max rounds to max (even)
  EXPECT_TRUE(std::isnan(q(FMT_E4M3, 465.0f, false)));
  EXPECT_EQ(q(FMT_E4M3, 465.0f, true), 448.0f);
  EXPECT_EQ(q(FMT_E4M3, -1e6f, true), -448.0f);
  EXPECT_EQ(q(FMT_E5M2, 61440.0f, false), INFINITY);  // tie above max rounds up to the odd code: inf
  EXPECT_EQ(q(FMT_E5M2, -61439.0f, false), -57344.0f);
  EXPECT_EQ(q(FMT_E2M1, 2.5f, false), 2.0f);
  EXPECT_EQ(q(FMT_E2M1, 5.0f, false), 4.0f);
  EXPECT_EQ(q(FMT_E2M1, 1e9f, false), 6.0f);  // always saturates
  EXPECT_EQ(q(FMT_E2M1, 0.25f, true), 0.0f);
  EXPECT_EQ(q(FMT_E4M3, std::ldexp(1.0f, -10), true), 0.0f);  // half the smallest subnormal: to 0
  EXPECT_EQ(q(FMT_E4M3, 1.5f * std::ldexp(1.0f, -10), true), std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::signbit(q(FMT_E5M2, -std::ldexp(1.0f, -18), true)));  // -0
  EXPECT_EQ(q(FMT_FP16, 65519.0f, false), 65504.0f);
  EXPECT_EQ(q(FMT_FP16, 65520.0f, false), INFINITY);
  EXPECT_TRUE(std::isnan(q(FMT_E2M1, NAN, true)));  // fake_quant keeps NaN (the codec gives 0)
}

TEST(QuantizeTest, FakeQuantWithScaleAndPostMatchesTheCodec) {
  struct SP {
    float s, p;
  };
  for (MiniFormat f : kFormats) {
    const std::vector<float> all = probe_values(f);
    std::vector<float> x;
    const size_t stride = all.size() / 30000 + 1;
    for (size_t i = 0; i < all.size(); i += stride) x.push_back(all[i]);
    for (const SP sp : {SP{0.3f, 1.0f}, SP{3.0f, 0.25f}, SP{1.0f / 64, 7.1f}, SP{1000.0f, 1e-3f}, SP{121.08108f, 0.0082589f}}) {
      for (bool sat : {true, false}) {
        std::vector<float> got(x.size()), want(x.size());
        fake_quant(f, x.data(), static_cast<int64_t>(x.size()), sp.s, sp.p, sat, got.data());
        for (size_t i = 0; i < x.size(); ++i) want[i] = decode(f, encode(f, x[i] * sp.s, sat)) * sp.p;
        expect_same_bits(got, want, [&](size_t i) {
          return std::string(format_info(f).name) + " s=" + std::to_string(sp.s) + " p=" + std::to_string(sp.p) +
                 (sat ? " sat" : " nosat") + " x=" + hex(x[i]);
        });
      }
    }
  }
}

TEST(QuantizeTest, FakeQuantInPlace) {
  std::vector<float> x = log_uniform(1000, 5, 0, -12.0f, 10.0f), want(x.size());
  fake_quant(FMT_E4M3, x.data(), static_cast<int64_t>(x.size()), 0.5f, 2.0f, true, want.data());
  fake_quant(FMT_E4M3, x.data(), static_cast<int64_t>(x.size()), 0.5f, 2.0f, true, x.data());  // out aliases x
  expect_same_bits(x, want, [](size_t i) { return "element " + std::to_string(i); });
}

// ------------------------------------------------------------------------- quant_codes_bf16

TEST(QuantizeTest, QuantCodesBf16AreTheExactUpperHalfOfFakeQuant) {
  for (MiniFormat f : {FMT_E4M3, FMT_E5M2, FMT_E2M1}) {
    const std::vector<float> x = probe_values(f);
    for (bool sat : {true, false}) {
      for (float scale : {1.0f, 0.3f}) {
        std::vector<float> fq(x.size());
        std::vector<uint16_t> codes(x.size());
        fake_quant(f, x.data(), static_cast<int64_t>(x.size()), scale, 1.0f, sat, fq.data());
        quant_codes_bf16(f, x.data(), static_cast<int64_t>(x.size()), scale, sat, codes.data());
        size_t bad = 0, inexact = 0;
        for (size_t i = 0; i < x.size(); ++i) {
          const float back = bf16_to_f32(bf16{codes[i]});
          if (codes[i] != static_cast<uint16_t>(bits_of(fq[i]) >> 16) && ++bad <= 5) {
            ADD_FAILURE() << format_info(f).name << " x=" << hex(x[i]) << " code " << codes[i] << " vs " << hex(fq[i]);
          }
          // exact: the code decodes to the fake-quantized value itself (a NaN stays a NaN)
          if (!same_bits(back, fq[i]) && ++inexact <= 5) {
            ADD_FAILURE() << format_info(f).name << " x=" << hex(x[i]) << " bf16 " << hex(back) << " vs " << hex(fq[i]);
          }
        }
        EXPECT_EQ(bad, 0u);
        EXPECT_EQ(inexact, 0u);
      }
    }
  }
  float x = 1.0f;
  uint16_t code = 0;
  EXPECT_THROW(quant_codes_bf16(FMT_FP16, &x, 1, 1.0f, true, &code), Error);
}

// ---------------------------------------------------------------------------------- MXFP4

void expect_mxfp4_matches_reference(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> got(x.size()), want(x.size());
  fake_quant_mxfp4(x.data(), rows, cols, got.data());
  const size_t blocks = static_cast<size_t>((cols + kMxBlock - 1) / kMxBlock);
  for (int64_t r = 0; r < rows; ++r) {  // the reference blocks a flat array: one row at a time
    std::span<const float> row(x.data() + r * cols, static_cast<size_t>(cols));
    std::vector<uint8_t> codes(static_cast<size_t>(cols)), scales(blocks);
    mxfp4_quantize(row, codes, scales);
    mxfp4_dequantize(codes, scales, std::span<float>(want.data() + r * cols, static_cast<size_t>(cols)));
  }
  expect_same_bits(got, want, [&](size_t i) {
    return "cols " + std::to_string(cols) + " row " + std::to_string(i / static_cast<size_t>(cols)) + " col " +
           std::to_string(i % static_cast<size_t>(cols)) + " x=" + hex(x[i]);
  });
}

// (rows, cols) normal values, each 32-run of a row scaled by its own power of two.
std::vector<float> varied_blocks(int64_t rows, int64_t cols, int64_t block, uint64_t seed) {
  std::vector<float> x(static_cast<size_t>(rows * cols));
  philox_fill_normal(x.data(), rows * cols, seed, 0, 0, 0.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int k = static_cast<int>((r * 7 + (c / block) * 13) % 49) - 24;
      x[static_cast<size_t>(r * cols + c)] = std::ldexp(x[static_cast<size_t>(r * cols + c)], k);
    }
  }
  return x;
}

TEST(QuantizeTest, Mxfp4MatchesTheReferenceRowByRow) {
  for (int64_t cols : {96, 50}) {
    const int64_t rows = 9;
    std::vector<float> x = varied_blocks(rows, cols, kMxBlock, 21 + static_cast<uint64_t>(cols));
    auto at = [&](int64_t r, int64_t c) -> float& { return x[static_cast<size_t>(r * cols + c)]; };
    for (int64_t c = 0; c < std::min<int64_t>(cols, 32); ++c) at(1, c) = 0.0f;  // an all-zero block
    for (int64_t c = 32; c < cols; ++c) at(2, c) *= 0x1p-130f;                 // subnormal block: X clamps to 2^-127
    const float ties[] = {4.0f, 2.5f, 5.0f, 0.25f, 0.75f, -1.25f, -3.5f, 1.75f, -0.0f, 3.0f};  // X = 1: every tie
    for (int64_t c = 0; c < 10; ++c) at(3, c) = ties[c];
    for (int64_t c = 10; c < 32; ++c) at(3, c) = std::ldexp(at(3, c), -24 - static_cast<int>(at(3, c) > 0));
    at(4, 5) = INFINITY;          // first block of row 4 is NaN; the rest of the row is not
    at(5, cols - 1) = -INFINITY;  // last (partial for 50) block of row 5
    at(6, 33) = NAN;
    at(7, 0) = FLT_MAX;           // X = 2^125
    expect_mxfp4_matches_reference(x, rows, cols);

    std::vector<float> got(x.size());
    fake_quant_mxfp4(x.data(), rows, cols, got.data());
    for (int64_t c = 0; c < cols; ++c) {
      EXPECT_EQ(std::isnan(got[static_cast<size_t>(4 * cols + c)]), c < 32) << "row with inf, col " << c;
    }
    for (int64_t c = 0; c < std::min<int64_t>(cols, 32); ++c) EXPECT_EQ(bits_of(got[static_cast<size_t>(cols + c)]), 0u);
    const float want_ties[] = {4.0f, 2.0f, 4.0f, 0.0f, 1.0f, -1.0f, -4.0f, 2.0f, -0.0f, 3.0f};
    for (int64_t c = 0; c < 10; ++c) EXPECT_EQ(bits_of(got[static_cast<size_t>(3 * cols + c)]), bits_of(want_ties[c])) << c;
  }
}

// ---------------------------------------------------------------------------------- NVFP4

void expect_nvfp4_matches_reference(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> got(x.size()), want(x.size());
  fake_quant_nvfp4(x.data(), rows, cols, got.data());
  std::vector<uint8_t> codes(x.size()), scales(x.size() / kNvBlock);
  const float global = nvfp4_quantize(x, codes, scales);
  nvfp4_dequantize(codes, scales, global, want);
  expect_same_bits(got, want, [&](size_t i) { return "element " + std::to_string(i) + " x=" + hex(x[i]); });
}

TEST(QuantizeTest, Nvfp4MatchesTheReferenceOverTheWholeTensor) {
  const int64_t rows = 6, cols = 64;
  std::vector<float> x = varied_blocks(rows, cols, kNvBlock, 33);
  for (int c = 16; c < 32; ++c) x[static_cast<size_t>(c)] = 0.0f;                // an all-zero block
  for (int c = 80; c < 96; ++c) x[static_cast<size_t>(c)] = 1e-3f * x[static_cast<size_t>(c + 16)] * 0x1p-12f;  // block scale underflows to 0
  for (int c = 96; c < 112; ++c) x[static_cast<size_t>(c)] = -x[static_cast<size_t>(c)];
  expect_nvfp4_matches_reference(x, rows, cols);

  std::vector<float> got(x.size());
  fake_quant_nvfp4(x.data(), rows, cols, got.data());
  for (int c = 80; c < 96; ++c) EXPECT_EQ(got[static_cast<size_t>(c)], 0.0f) << c;
  // a different tensor amax changes every block (the fp32 tensor scale is global)
  for (uint64_t seed : {34u, 35u}) expect_nvfp4_matches_reference(varied_blocks(4, 128, kNvBlock, seed), 4, 128);

  std::vector<float> zeros(static_cast<size_t>(rows * cols), 0.0f), out(zeros.size(), 7.0f);
  for (size_t i = 0; i < zeros.size(); i += 3) zeros[i] = -0.0f;
  fake_quant_nvfp4(zeros.data(), rows, cols, out.data());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], 0.0f) << i;
  expect_nvfp4_matches_reference(zeros, rows, cols);
}

// ------------------------------------------------------------------------ block scaling

std::vector<float> reference_blocks(MiniFormat f, const std::vector<float>& x, int64_t rows, int64_t cols, int64_t br,
                                    int64_t bc, std::vector<float>* block_scale) {
  const float fmax = static_cast<float>(format_info(f).max);
  std::vector<float> out(x.size());
  block_scale->assign(x.size(), 0.0f);
  for (int64_t r0 = 0; r0 < rows; r0 += br) {
    for (int64_t c0 = 0; c0 < cols; c0 += bc) {
      const int64_t r1 = std::min(rows, r0 + br), c1 = std::min(cols, c0 + bc);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[static_cast<size_t>(r * cols + c)]));
      }
      const float s = std::max(amax, 1e-4f) / fmax;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const size_t i = static_cast<size_t>(r * cols + c);
          out[i] = decode(f, encode(f, x[i] / s, true)) * s;
          (*block_scale)[i] = s;
        }
      }
    }
  }
  return out;
}

TEST(QuantizeTest, BlockScalingMatchesTheNaiveFormula) {
  const int64_t rows = 200, cols = 300;
  std::vector<float> x(static_cast<size_t>(rows * cols));
  philox_fill_normal(x.data(), rows * cols, 55, 0, 0, 0.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float& v = x[static_cast<size_t>(r * cols + c)];
      v = std::ldexp(v, static_cast<int>(r % 11) - 5 + static_cast<int>(c % 7) - 3);
      if ((r * cols + c) % 97 == 0) v *= 300.0f;  // outliers
      if (r >= 128 && c >= 256) v *= 1e-11f;       // the corner block: amax below the 1e-4 floor
      if (r >= 160 && c >= 280) v = 0.0f;          // and a zero region inside it
    }
  }
  for (MiniFormat f : {FMT_E4M3, FMT_E5M2}) {
    const float fmax = static_cast<float>(format_info(f).max);
    struct B {
      int64_t r, c;
    };
    for (const B b : {B{1, 128}, B{128, 1}, B{128, 128}}) {
      std::vector<float> got(x.size()), scale;
      fake_quant_blocks(f, x.data(), rows, cols, b.r, b.c, got.data());
      const std::vector<float> want = reference_blocks(f, x, rows, cols, b.r, b.c, &scale);
      expect_same_bits(got, want, [&](size_t i) {
        return std::string(format_info(f).name) + " block " + std::to_string(b.r) + "x" + std::to_string(b.c) + " at (" +
               std::to_string(i / cols) + "," + std::to_string(i % cols) + ") x=" + hex(x[i]);
      });
      // The block's amax lands exactly on the format max (when above the 1e-4 floor).
      int checked = 0, floored = 0;
      for (int64_t r0 = 0; r0 < rows; r0 += b.r) {
        for (int64_t c0 = 0; c0 < cols; c0 += b.c) {
          float amax = 0.0f, omax = 0.0f;
          for (int64_t r = r0; r < std::min(rows, r0 + b.r); ++r) {
            for (int64_t c = c0; c < std::min(cols, c0 + b.c); ++c) {
              amax = std::max(amax, std::fabs(x[static_cast<size_t>(r * cols + c)]));
              omax = std::max(omax, std::fabs(got[static_cast<size_t>(r * cols + c)]));
            }
          }
          const float s = scale[static_cast<size_t>(r0 * cols + c0)];
          if (amax >= 1e-4f) {
            EXPECT_EQ(omax, fmax * s) << format_info(f).name << " block at " << r0 << "," << c0;
            ++checked;
          } else {
            EXPECT_LE(omax, fmax * s);
            ++floored;
          }
        }
      }
      EXPECT_GT(checked, 0);
      EXPECT_GT(floored, 0);  // the floor path is exercised too
    }
  }
}

// Random data almost never lands on a tie of x / s; these tiles are built so it does: each row
// (one 1x128 tile) holds its amax M, so s = M / max(f), and values x with x / s (in fp32) equal
// to a midpoint of the format's grid or one float either side of it.
TEST(QuantizeTest, BlockScalingRoundsTiesOfXOverSLikeTheFormula) {
  for (MiniFormat f : {FMT_E4M3, FMT_E5M2}) {
    const float fmax = static_cast<float>(format_info(f).max);
    std::vector<double> grid;
    for (uint32_t c = 0; c < 128; ++c) {
      const float d = decode(f, c);
      if (std::isfinite(d)) grid.push_back(d);
    }
    std::sort(grid.begin(), grid.end());
    const int64_t rows = 24, cols = 128;
    std::vector<float> x(static_cast<size_t>(rows * cols), 0.0f);
    size_t exact_ties = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const float m = std::ldexp(1.0f + 0.0371f * static_cast<float>(r), static_cast<int>(r % 7) - 3);
      const float s = m / fmax;
      std::vector<float> cand;
      for (size_t k = 0; k + 1 < grid.size(); ++k) {
        const float t = static_cast<float>((grid[k] + grid[k + 1]) / 2);
        float v = std::nextafter(t * s, 0.0f);
        for (int step = 0; step < 6; ++step, v = std::nextafter(v, INFINITY)) {
          const float q = v / s;
          if (q == t || q == std::nextafter(t, 0.0f) || q == std::nextafter(t, INFINITY)) cand.push_back(v);
          exact_ties += q == t;
        }
      }
      ASSERT_GT(cand.size(), 127u);
      x[static_cast<size_t>(r * cols)] = r % 2 ? -m : m;
      for (int64_t c = 1; c < cols; ++c) {
        const float v = cand[(static_cast<size_t>(r) * 127 + static_cast<size_t>(c) * 5) % cand.size()];
        x[static_cast<size_t>(r * cols + c)] = c % 3 ? v : -v;
      }
    }
    EXPECT_GT(exact_ties, 1000u);  // most ties are hit exactly
    std::vector<float> got(x.size()), scale;
    fake_quant_blocks(f, x.data(), rows, cols, 1, cols, got.data());
    const std::vector<float> want = reference_blocks(f, x, rows, cols, 1, cols, &scale);
    expect_same_bits(got, want, [&](size_t i) {
      return std::string(format_info(f).name) + " row " + std::to_string(i / 128) + " x=" + hex(x[i]) +
             " x/s=" + std::to_string(x[i] / scale[i]);
    });
  }
}

// --------------------------------------------------------------------------- round_to_bf16

TEST(QuantizeTest, RoundToBf16NearestIsF32ToBf16) {
  std::vector<float> x = log_uniform(50000, 71, 0, -140.0f, 127.0f);
  for (uint32_t b : {0x3F808000u, 0x3F818000u, 0x3F807FFFu, 0x7F7FFFFFu, 0x00008000u, 0x80018000u, 0x7FC00001u,
                     0xFF800000u, 0x7F800000u, 0x80000000u, 0x7F800001u}) {
    x.push_back(std::bit_cast<float>(b));  // ties (even and odd), rounding up to inf, subnormals, specials
  }
  std::vector<float> want(x.size()), got = x;
  for (size_t i = 0; i < x.size(); ++i) want[i] = bf16_to_f32(f32_to_bf16(x[i]));
  round_to_bf16(got.data(), static_cast<int64_t>(got.size()), false);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bits_of(got[i]), bits_of(want[i])) << hex(x[i]);
  EXPECT_EQ(bits_of(want[x.size() - 11]), 0x3F800000u);  // tie to even: down
  EXPECT_EQ(bits_of(want[x.size() - 10]), 0x3F820000u);  // tie to even: up
}

TEST(QuantizeTest, RoundToBf16StochasticPicksANeighbourAndFollowsPhilox) {
  std::vector<float> x = log_uniform(40001, 72, 0, -130.0f, 120.0f);
  for (size_t i = 0; i < x.size(); i += 10) x[i] = bf16_to_f32(f32_to_bf16(x[i]));  // exact bf16 values
  x[3] = INFINITY;
  x[7] = -INFINITY;
  x[11] = NAN;
  x[13] = 0.0f;
  x[17] = -0.0f;
  const uint64_t seed = 0x123456789ABCDEFull;
  const uint32_t stream = 9, draw = 4;
  std::vector<float> y = x;
  round_to_bf16(y.data(), static_cast<int64_t>(y.size()), true, seed, stream, draw);
  size_t ups = 0, downs = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i])) {
      EXPECT_TRUE(std::isnan(y[i]));
      continue;
    }
    if (std::isinf(x[i])) {
      EXPECT_EQ(bits_of(y[i]), bits_of(x[i]));
      continue;
    }
    const uint32_t lo = bits_of(x[i]) & 0xFFFF0000u, hi = lo + 0x10000u;  // toward zero / away from zero
    ASSERT_EQ(bits_of(y[i]) & 0xFFFFu, 0u) << hex(y[i]);
    if ((bits_of(x[i]) & 0xFFFFu) == 0) {
      ASSERT_EQ(bits_of(y[i]), bits_of(x[i])) << "exact bf16 changed: " << hex(x[i]);
      continue;
    }
    ASSERT_TRUE(bits_of(y[i]) == lo || bits_of(y[i]) == hi) << hex(x[i]) << " -> " << hex(y[i]);
    (bits_of(y[i]) == hi ? ups : downs)++;
    // The documented draw: 16 random bits of Philox (i/4, 0, stream, draw), key seed, added below bf16's last place.
    const PhiloxCounter r = philox4x32_10({static_cast<uint32_t>(i / 4), 0, stream, draw},
                                          {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
    ASSERT_EQ(bits_of(y[i]), (bits_of(x[i]) + (r[i % 4] >> 16)) & 0xFFFF0000u) << i;
  }
  EXPECT_GT(ups, 1000u);
  EXPECT_GT(downs, 1000u);

  // A pure function of (seed, stream, draw): the same call again is identical, another draw,
  // stream or seed is not.
  std::vector<float> again = x;
  round_to_bf16(again.data(), static_cast<int64_t>(again.size()), true, seed, stream, draw);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_TRUE(same_bits(again[i], y[i])) << i;
  struct Args {
    uint64_t seed;
    uint32_t stream, draw;
  };
  for (const Args a : {Args{seed, stream, draw + 1}, Args{seed, stream + 1, draw}, Args{seed + 1, stream, draw}}) {
    std::vector<float> z = x;
    round_to_bf16(z.data(), static_cast<int64_t>(z.size()), true, a.seed, a.stream, a.draw);
    size_t differ = 0;
    for (size_t i = 0; i < x.size(); ++i) differ += !same_bits(z[i], y[i]);
    EXPECT_GT(differ, x.size() / 10) << a.seed << " " << a.stream << " " << a.draw;
  }
}

TEST(QuantizeTest, RoundToBf16StochasticIsUnbiased) {
  const int64_t n = 1000000;
  for (uint32_t b : {0x3F804CCDu, 0xC2F7F123u, 0x3A830100u}) {  // p = 0.30, 0.94, 0.004 (low 16 bits / 2^16)
    const float x = std::bit_cast<float>(b);
    std::vector<float> y(static_cast<size_t>(n), x);
    round_to_bf16(y.data(), n, true, 2024, 1, 0);
    const double lo = std::bit_cast<float>(b & 0xFFFF0000u), hi = std::bit_cast<float>((b & 0xFFFF0000u) + 0x10000u);
    const double ulp = std::fabs(hi - lo), p = (b & 0xFFFFu) / 65536.0;
    double sum = 0.0;
    int64_t ups = 0;
    for (float v : y) {
      ASSERT_TRUE(v == lo || v == hi) << v;
      sum += v;
      ups += v == hi;
    }
    const double se = std::sqrt(p * (1 - p) / static_cast<double>(n)) * ulp;
    EXPECT_NEAR(sum / static_cast<double>(n), static_cast<double>(x), 4.0 * se) << hex(x);
    EXPECT_NEAR(static_cast<double>(ups) / static_cast<double>(n), p, 4.0 * std::sqrt(p * (1 - p) / static_cast<double>(n)));
  }
}

// --------------------------------------------------------------------------------- amax_of

TEST(QuantizeTest, AmaxOf) {
  std::vector<float> x = log_uniform(100003, 81, 0, -20.0f, 10.0f);
  float naive = 0.0f;
  for (float v : x) naive = std::max(naive, std::fabs(v));
  EXPECT_EQ(amax_of(x.data(), static_cast<int64_t>(x.size())), naive);
  x[54321] = -4096.5f;  // the largest magnitude, negative
  EXPECT_EQ(amax_of(x.data(), static_cast<int64_t>(x.size())), 4096.5f);
  x[99999] = -INFINITY;
  EXPECT_EQ(amax_of(x.data(), static_cast<int64_t>(x.size())), INFINITY);
  for (size_t pos : {size_t{0}, size_t{77777}, x.size() - 1}) {
    std::vector<float> y = x;
    y[pos] = NAN;
    EXPECT_TRUE(std::isnan(amax_of(y.data(), static_cast<int64_t>(y.size())))) << pos;
  }
  const float one_nan = NAN;
  EXPECT_TRUE(std::isnan(amax_of(&one_nan, 1)));
  EXPECT_EQ(amax_of(x.data(), 0), 0.0f);
  EXPECT_EQ(amax_of(nullptr, 0), 0.0f);
  const float negzero[3] = {-0.0f, 0.0f, -0.0f};
  EXPECT_EQ(bits_of(amax_of(negzero, 3)), 0u);
}

}  // namespace
}  // namespace loom
