// Fast quantizers over float arrays: the formats of formats.h applied to whole tensors with
// per-tensor, per-tile or per-block scales, for low-precision linear layers (nn/linear.h), which
// run them on tensors through the Backend's low-precision ops (backend.h; the same kernels).
// Each "fake quantizer" returns values on the format's grid as floats, so the GEMM that follows
// multiplies exactly the numbers the hardware would (an FP8 value times an FP8 value is exact in
// fp32). They agree bit for bit with encode()/decode() of formats.h (tests), but round in float
// arithmetic (rint on the format's quantum) instead of a per-element search, so a training step
// can afford them.
#pragma once
#include <cstdint>

#include "loom/backend/backend.h"
#include "loom/precision/formats.h"

namespace loom {

// Format f's grid for the Backend's quantizers: overflow to ±max when saturating (E2M1 always),
// else to ±inf (fp16, E5M2) or NaN (E4M3).
NumberGrid number_grid(MiniFormat f, bool saturate);

// max |x[i]|; NaN if any element is NaN. OpenMP-parallel.
float amax_of(const float* x, int64_t n);

// out[i] = Q(x[i] * scale) * post, Q = round to nearest even onto format f's grid (fp16, E4M3,
// E5M2 or E2M1). Out of range: ±max when saturating, else ±inf (fp16, E5M2) or NaN (E4M3);
// E2M1 always saturates. NaN stays NaN. out may alias x.
void fake_quant(MiniFormat f, const float* x, int64_t n, float scale, float post, bool saturate, float* out);
// The same with post = 1, written as bf16 bit patterns: every E4M3/E5M2/E2M1 value is exactly
// a bf16, so a bf16 GEMM over these codes with alpha = 1/(scale_a scale_b) is an exact FP8 GEMM.
void quant_codes_bf16(MiniFormat f, const float* x, int64_t n, float scale, bool saturate, uint16_t* out);

// Block-wise scaling (DeepSeek-V3; TransformerEngine Float8BlockScaling): x is (rows, cols)
// row-major, cut into block_rows x block_cols blocks (edge blocks smaller). Each block gets
// s = max(amax_block, 1e-4) / max(f) in fp32 and out = Q(x / s) * s (saturating). 1x128 tiles
// for activations and gradients, 128x128 blocks for weights, 128x1 for the wgrad operands.
void fake_quant_blocks(MiniFormat f, const float* x, int64_t rows, int64_t cols, int64_t block_rows,
                       int64_t block_cols, float* out);

// MXFP4 (OCP MX v1.0) fake quantization along rows: each run of 32 consecutive elements of a
// row (the last one shorter) gets X = 2^(floor(log2 amax) - 2) and out = E2M1(x / X) * X, the
// same numbers as mxfp4_quantize + mxfp4_dequantize. A block with NaN or inf gives NaN.
void fake_quant_mxfp4(const float* x, int64_t rows, int64_t cols, float* out);
// NVFP4 fake quantization along rows, 16-element blocks with an E4M3 block scale and the
// tensor's fp32 scale amax / (448 * 6): the numbers of nvfp4_quantize + nvfp4_dequantize.
void fake_quant_nvfp4(const float* x, int64_t rows, int64_t cols, float* out);

// Rounds x in place to bf16 values (kept in fp32): nearest-even, or stochastic: element i adds
// 16 random bits below bf16's last place and truncates (Philox counter (i/4, stream, draw), key
// seed), so the rounding is unbiased and a pure function of (seed, stream, draw, i).
void round_to_bf16(float* x, int64_t n, bool stochastic, uint64_t seed = 0, uint32_t stream = 0, uint32_t draw = 0);

}  // namespace loom
