// The fast quantizers by format name: each builds the format's grid from its table (formats.h)
// and runs the CPU backend's kernel (backend/cpu/cpu_quant_ops.cpp) on host arrays, so these and
// the Backend ops are the same arithmetic.
#include "loom/precision/quantize.h"

#include <cmath>

#include "loom/backend/cpu/cpu_quant_ops.h"
#include "loom/core/error.h"

namespace loom {

NumberGrid number_grid(MiniFormat f, bool saturate) {
  const MiniFormatInfo& i = format_info(f);
  NumberGrid g;
  g.man_bits = i.man_bits;
  g.emin = 1 - i.bias;
  g.max = static_cast<float>(i.max);
  if (saturate || f == FMT_E2M1) g.overflow = g.max;
  else g.overflow = i.has_inf ? INFINITY : NAN;
  return g;
}

float amax_of(const float* x, int64_t n) { return cpu::amax_of(x, n); }

void fake_quant(MiniFormat f, const float* x, int64_t n, float scale, float post, bool saturate, float* out) {
  cpu::fake_quant(number_grid(f, saturate), x, n, scale, post, out);
}

void quant_codes_bf16(MiniFormat f, const float* x, int64_t n, float scale, bool saturate, uint16_t* out) {
  LOOM_CHECK(f != FMT_FP16, "quant_codes_bf16: fp16 values are not bf16 values");
  cpu::quant_codes_bf16(number_grid(f, saturate), x, n, scale, out);
}

void fake_quant_blocks(MiniFormat f, const float* x, int64_t rows, int64_t cols, int64_t block_rows,
                       int64_t block_cols, float* out) {
  cpu::fake_quant_blocks(number_grid(f, true), x, rows, cols, block_rows, block_cols, out);
}

void fake_quant_mxfp4(const float* x, int64_t rows, int64_t cols, float* out) { cpu::fake_quant_mxfp4(x, rows, cols, out); }

void fake_quant_nvfp4(const float* x, int64_t rows, int64_t cols, float* out) { cpu::fake_quant_nvfp4(x, rows, cols, out); }

void round_to_bf16(float* x, int64_t n, bool stochastic, uint64_t seed, uint32_t stream, uint32_t draw) {
  cpu::round_to_bf16(x, n, stochastic, RoundingDraw{seed, stream, draw});
}

}  // namespace loom
