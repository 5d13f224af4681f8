#include "loom/precision/ggml_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "loom/core/error.h"
#include "loom/precision/formats.h"

namespace loom {

namespace {

constexpr int64_t kQk = kGgmlBlockElements;

uint16_t fp16_bits(float x) { return static_cast<uint16_t>(encode(FMT_FP16, x, /*saturate=*/false)); }

void put_scale(uint8_t* block, float d) {
  const uint16_t bits = fp16_bits(d);
  block[0] = static_cast<uint8_t>(bits & 0xFF);  // little-endian
  block[1] = static_cast<uint8_t>(bits >> 8);
}

float get_scale(const uint8_t* block) {
  return decode(FMT_FP16, static_cast<uint32_t>(block[0]) | (static_cast<uint32_t>(block[1]) << 8));
}

void quantize_q8_0(const float* x, uint8_t* block) {
  float amax = 0.0f;
  for (int64_t j = 0; j < kQk; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  put_scale(block, d);
  for (int64_t j = 0; j < kQk; ++j) {
    const auto q = static_cast<int8_t>(std::round(x[j] * id));  // |x id| <= 127
    std::memcpy(block + 2 + j, &q, 1);
  }
}

void quantize_q4_0(const float* x, uint8_t* block) {
  float amax = 0.0f, m = 0.0f;
  for (int64_t j = 0; j < kQk; ++j) {
    if (std::fabs(x[j]) > amax) {  // strictly greater: the first of equal magnitudes wins
      amax = std::fabs(x[j]);
      m = x[j];
    }
  }
  const float d = m / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  put_scale(block, d);
  const auto nibble = [&](float v) {
    // v / d + 8.5 lies in [0, 16.5]; truncation toward zero as a C cast does, then at most 15.
    return static_cast<uint8_t>(std::min(15, static_cast<int>(static_cast<int8_t>(v * id + 8.5f))));
  };
  for (int64_t j = 0; j < kQk / 2; ++j) {
    block[2 + j] = static_cast<uint8_t>(nibble(x[j]) | (nibble(x[j + kQk / 2]) << 4));
  }
}

void dequantize_q8_0(const uint8_t* block, float* out) {
  const float d = get_scale(block);
  for (int64_t j = 0; j < kQk; ++j) {
    int8_t q = 0;
    std::memcpy(&q, block + 2 + j, 1);
    out[j] = static_cast<float>(q) * d;
  }
}

void dequantize_q4_0(const uint8_t* block, float* out) {
  const float d = get_scale(block);
  for (int64_t j = 0; j < kQk / 2; ++j) {
    out[j] = static_cast<float>((block[2 + j] & 0x0F) - 8) * d;
    out[j + kQk / 2] = static_cast<float>((block[2 + j] >> 4) - 8) * d;
  }
}

}  // namespace

size_t ggml_block_bytes(GgmlBlock type) { return type == GgmlBlock::Q8_0 ? 2 + kQk : 2 + kQk / 2; }

size_t ggml_blocks_size(GgmlBlock type, int64_t n) {
  LOOM_CHECK(n % kQk == 0, "ggml block quantization needs a multiple of ", kQk, " elements, got ", n);
  return static_cast<size_t>(n / kQk) * ggml_block_bytes(type);
}

void ggml_quantize(GgmlBlock type, std::span<const float> x, std::span<uint8_t> out) {
  const auto n = static_cast<int64_t>(x.size());
  LOOM_CHECK(out.size() == ggml_blocks_size(type, n), "ggml_quantize: ", out.size(), " output bytes for ", n,
             " elements");
  const size_t bytes = ggml_block_bytes(type);
  for (int64_t b = 0; b < n / kQk; ++b) {
    const float* src = x.data() + b * kQk;
    uint8_t* dst = out.data() + static_cast<size_t>(b) * bytes;
    if (type == GgmlBlock::Q8_0) quantize_q8_0(src, dst);
    else quantize_q4_0(src, dst);
  }
}

void ggml_dequantize(GgmlBlock type, std::span<const uint8_t> blocks, std::span<float> out) {
  const size_t bytes = ggml_block_bytes(type);
  LOOM_CHECK(blocks.size() % bytes == 0 && out.size() == blocks.size() / bytes * kQk, "ggml_dequantize: ",
             blocks.size(), " bytes for ", out.size(), " elements");
  for (size_t b = 0; b < blocks.size() / bytes; ++b) {
    const uint8_t* src = blocks.data() + b * bytes;
    float* dst = out.data() + b * kQk;
    if (type == GgmlBlock::Q8_0) dequantize_q8_0(src, dst);
    else dequantize_q4_0(src, dst);
  }
}

}  // namespace loom
