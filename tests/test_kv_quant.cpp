// KV-row quantization (KIVI, Liu et al. 2024): names parse, tiles have the stated bytes, every
// element reconstructs within half its group's step, constant groups are exact, and per-channel
// groups beat per-token groups when a few channels carry outliers.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "loom/backend/kv_quantize.h"
#include "loom/core/philox.h"
#include "loom/infer/kv_quant.h"
#include "loom/precision/formats.h"
#include "test_util.h"

namespace loom {
namespace {

std::vector<float> normal(int64_t n, uint64_t seed, float mean = 0.0f, float stddev = 1.0f) {
  std::vector<float> x(static_cast<size_t>(n));
  philox_fill_normal(x.data(), n, seed, 0, 0, mean, stddev);
  return x;
}

std::vector<float> round_trip(const KvQuantSpec& spec, const std::vector<float>& x, int64_t tokens,
                              std::vector<uint8_t>& tile) {
  tile.assign(static_cast<size_t>(kv_tile_bytes(spec, tokens)), 0);
  kv_quantize_tile(spec, x.data(), tokens, tile.data());
  std::vector<float> back(x.size());
  kv_dequantize_tile(spec, tile.data(), tokens, 0, tokens, back.data());
  return back;
}

// ||x' - x|| / ||x||
double relative_error(const std::vector<float>& x, const std::vector<float>& back) {
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    err += (static_cast<double>(back[i]) - x[i]) * (static_cast<double>(back[i]) - x[i]);
    norm += static_cast<double>(x[i]) * x[i];
  }
  return std::sqrt(err / norm);
}

TEST(KvQuantTest, NamesParseAndUnknownNamesListTheAcceptedOnes) {
  for (int f = 0; f < KV_FORMAT_COUNT; ++f) {
    EXPECT_EQ(parse_kv_format(kv_format_name(static_cast<KvFormat>(f))), f);
  }
  EXPECT_EQ(parse_kv_format("int2"), KV_INT2);
  EXPECT_EQ(parse_kv_axis("channel"), KV_PER_CHANNEL);
  const std::string message = test::error_of([] { parse_kv_format("int3"); });
  EXPECT_NE(message.find("'int3'"), std::string::npos) << message;
  EXPECT_NE(message.find("fp32, bf16, int8, int4, int2"), std::string::npos) << message;
  EXPECT_NE(test::error_of([] { parse_kv_axis("row"); }).find("token, channel"), std::string::npos);
}

TEST(KvQuantTest, TileBytesFollowTheLayout) {
  // (tokens, width) = (3, 64) and (16, 64); codes per row: 64 b / 8 bytes.
  EXPECT_EQ(kv_tile_bytes(KV_FP32, KV_PER_TOKEN, 3, 64, 0), 3 * 64 * 4);
  EXPECT_EQ(kv_tile_bytes(KV_BF16, KV_PER_CHANNEL, 3, 64, 0), 3 * 64 * 2);
  EXPECT_EQ(kv_tile_bytes(KV_INT8, KV_PER_TOKEN, 3, 64, 32), 3 * (64 + 2 * 4));
  EXPECT_EQ(kv_tile_bytes(KV_INT4, KV_PER_TOKEN, 3, 64, 16), 3 * (32 + 4 * 4));
  EXPECT_EQ(kv_tile_bytes(KV_INT2, KV_PER_TOKEN, 3, 64, 0), 3 * (16 + 4));
  EXPECT_EQ(kv_tile_bytes(KV_INT2, KV_PER_CHANNEL, 16, 64, 0), 64 * 4 + 16 * 16);
  EXPECT_EQ(kv_tile_bytes(KV_INT4, KV_PER_CHANNEL, 16, 64, 0), 64 * 4 + 16 * 32);
  // Rows of codes are padded to whole bytes: 5 int4 codes take 3 bytes, 5 int2 codes 2.
  EXPECT_EQ(kv_tile_bytes(KV_INT4, KV_PER_TOKEN, 2, 5, 0), 2 * (4 + 3));
  EXPECT_EQ(kv_tile_bytes(KV_INT2, KV_PER_CHANNEL, 4, 5, 0), 5 * 4 + 4 * 2);
  const std::string message = test::error_of([] { kv_tile_bytes(KV_INT4, KV_PER_TOKEN, 1, 64, 24); });
  EXPECT_NE(message.find("group 24 must divide the row width 64"), std::string::npos) << message;
}

TEST(KvQuantTest, EveryElementIsWithinHalfAStepOfItsGroup) {
  const int64_t tokens = 16, width = 40;
  // Offset data: the fp16 min must round down for the bound to hold at the group's minimum.
  const std::vector<float> x = normal(tokens * width, 3, 0.3f, 2.0f);
  for (KvFormat format : {KV_INT8, KV_INT4, KV_INT2}) {
    for (KvAxis axis : {KV_PER_TOKEN, KV_PER_CHANNEL}) {
      const KvQuantSpec spec{format, axis, width, 8};
      std::vector<uint8_t> tile;
      const std::vector<float> back = round_trip(spec, x, tokens, tile);
      double worst = 0.0;  // largest error in steps
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t c = 0; c < width; ++c) {
          const float v = x[t * width + c], err = std::fabs(back[t * width + c] - v);
          const KvGroupParams p = kv_group_params(spec, tile.data(), tokens, t, c);
          ASSERT_LE(err, 0.5f * p.scale + 1e-6f * (std::fabs(v) + p.scale))
              << kv_format_name(format) << " " << kv_axis_name(axis) << " (" << t << ", " << c << ")";
          worst = std::max(worst, static_cast<double>(err / p.scale));
        }
      }
      EXPECT_GT(worst, 0.3) << "the bound is tight, not vacuous";
    }
  }
}

TEST(KvQuantTest, ConstantGroupsRoundTripExactly) {
  // Groups of 4 per token; each constant value is an fp16 number, so s = 0 and x' = min.
  const std::vector<float> x = {0.375f, 0.375f, 0.375f, 0.375f, 0.0f,     0.0f,     0.0f,     0.0f,
                                -2.5f,  -2.5f,  -2.5f,  -2.5f,  1000.5f, 1000.5f, 1000.5f, 1000.5f};
  for (KvFormat format : {KV_INT8, KV_INT4, KV_INT2}) {
    const KvQuantSpec per_token{format, KV_PER_TOKEN, 4, 0};
    std::vector<uint8_t> tile;
    EXPECT_EQ(round_trip(per_token, x, 4, tile), x) << kv_format_name(format);
    EXPECT_EQ(kv_group_params(per_token, tile.data(), 4, 2, 1).scale, 0.0f);
    // Per channel over 4 tokens: transpose so each channel is constant.
    std::vector<float> xt(16);
    for (int t = 0; t < 4; ++t) {
      for (int c = 0; c < 4; ++c) xt[t * 4 + c] = x[c * 4 + t];
    }
    EXPECT_EQ(round_trip({format, KV_PER_CHANNEL, 4, 0}, xt, 4, tile), xt) << kv_format_name(format);
  }
}

TEST(KvQuantTest, Int8RelativeErrorIsBelowOnePercent) {
  const int64_t tokens = 64, width = 128;
  const std::vector<float> x = normal(tokens * width, 5);
  std::vector<uint8_t> tile;
  for (KvAxis axis : {KV_PER_TOKEN, KV_PER_CHANNEL}) {
    const double err = relative_error(x, round_trip({KV_INT8, axis, width, 32}, x, tokens, tile));
    EXPECT_LT(err, 0.01) << kv_axis_name(axis);
    std::printf("[          ] int8 per-%s relative error %.4f\n", std::string(kv_axis_name(axis)).c_str(), err);
  }
}

TEST(KvQuantTest, Bf16RoundsEachElementToNearestEven) {
  const std::vector<float> x = normal(24, 9);
  std::vector<uint8_t> tile;
  const std::vector<float> back = round_trip({KV_BF16, KV_PER_TOKEN, 8, 0}, x, 3, tile);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(back[i], bf16_to_f32(f32_to_bf16(x[i])));
}

TEST(KvQuantTest, PerChannelBeatsPerTokenWhenChannelsCarryOutliers) {
  // KIVI's observation on keys: a few fixed channels are large. Per-token groups must span
  // them, so every channel of the group pays their range; per-channel groups isolate them.
  const int64_t tokens = 16, width = 64;
  std::vector<float> x = normal(tokens * width, 7);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c : {3, 21, 40, 58}) x[t * width + c] = x[t * width + c] + 20.0f;
  }
  for (KvFormat format : {KV_INT8, KV_INT4, KV_INT2}) {
    std::vector<uint8_t> tile;
    const double per_token = relative_error(x, round_trip({format, KV_PER_TOKEN, width, 32}, x, tokens, tile));
    const double per_channel = relative_error(x, round_trip({format, KV_PER_CHANNEL, width, 0}, x, tokens, tile));
    std::printf("[          ] %s outlier channels: per-token error %.4f, per-channel %.4f (ratio %.1f)\n",
                std::string(kv_format_name(format)).c_str(), per_token, per_channel, per_token / per_channel);
    EXPECT_GT(per_token / per_channel, 2.5) << kv_format_name(format);
  }
}

TEST(KvQuantTest, StoredScalesDecodeLikeTheFp16Codec) {
  // A per-channel tile whose channel c carries fp16 code c as both scale and min: every code.
  const int64_t width = 65536;
  const KvQuantSpec spec{KV_INT8, KV_PER_CHANNEL, width, 0};
  std::vector<uint8_t> tile(static_cast<size_t>(kv_tile_bytes(spec, 1)), 0);
  for (int64_t c = 0; c < width; ++c) {
    const uint16_t code = static_cast<uint16_t>(c);
    std::memcpy(tile.data() + 4 * c, &code, 2);
    std::memcpy(tile.data() + 4 * c + 2, &code, 2);
  }
  for (int64_t c = 0; c < width; ++c) {
    const float want = decode(FMT_FP16, static_cast<uint32_t>(c));
    const KvGroupParams p = kv_group_params(spec, tile.data(), 1, 0, c);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(p.scale) && std::isnan(p.min)) << c;
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(p.scale), std::bit_cast<uint32_t>(want)) << c;
      ASSERT_EQ(std::bit_cast<uint32_t>(p.min), std::bit_cast<uint32_t>(want)) << c;
    }
  }
}

// backend/kv_quantize.h rounds to fp16 downwards and upwards by truncating the magnitude (host
// and device code alike). The reference: precision/formats.h's codec rounds to nearest, then one
// code toward the bound where that overshot (-0 and +0 step to the smallest subnormal of the
// right sign). Every exponent of fp16's range and beyond, subnormals, the boundaries and signs.
TEST(KvQuantTest, DirectedFp16RoundingMatchesTheCodec) {
  const auto next_down = [](uint32_t c) { return c == 0x0000u ? 0x8001u : (c & 0x8000u) ? c + 1 : c - 1; };
  const auto next_up = [](uint32_t c) { return c == 0x8000u ? 0x0001u : (c & 0x8000u) ? c - 1 : c + 1; };
  const auto floor_ref = [&](float x) {
    const uint32_t c = encode(FMT_FP16, x);
    return decode(FMT_FP16, c) > x ? next_down(c) : c;
  };
  const auto ceil_ref = [&](float x) {
    const uint32_t c = encode(FMT_FP16, x);
    return decode(FMT_FP16, c) < x ? next_up(c) : c;
  };
  std::vector<float> xs = {0.0f, -0.0f, 65504.0f, 65519.0f, 65520.0f, 65536.0f, 1e6f, 1e30f, 0x1p-24f, 0x1p-25f,
                           0x1p-14f, 0x1.ffcp-15f, 1.0f, 1.0009765625f, 3e-8f, 6e-5f};
  std::vector<float> u(4000);
  philox_fill_uniform(u.data(), static_cast<int64_t>(u.size()), 77, 0, 0);
  for (size_t i = 0; i < u.size(); ++i) xs.push_back(std::ldexp(1.0f + u[i], static_cast<int>(i % 50) - 30));
  int64_t checked = 0;
  for (const float m : xs) {
    for (const float x : {m, -m}) {
      ASSERT_EQ(kvq::f16_floor(x), floor_ref(x)) << x;
      ASSERT_EQ(kvq::f16_ceil(x), ceil_ref(x)) << x;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2 * 4016);
}

TEST(KvQuantTest, ValuesBeyondFp16RangeAreRefused) {
  const std::vector<float> x = {1.0f, -1e6f};  // the fp16 min would be -inf
  std::vector<uint8_t> tile(16);
  const std::string message =
      test::error_of([&] { kv_quantize_tile({KV_INT8, KV_PER_TOKEN, 2, 0}, x.data(), 1, tile.data()); });
  EXPECT_NE(message.find("65504"), std::string::npos) << message;
  const std::vector<float> bad = {1.0f, NAN};
  EXPECT_NE(test::error_of([&] { kv_quantize_tile({KV_INT4, KV_PER_TOKEN, 2, 0}, bad.data(), 1, tile.data()); })
                .find("non-finite"),
            std::string::npos);
}

}  // namespace
}  // namespace loom
