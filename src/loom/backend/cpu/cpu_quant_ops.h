// The CPU kernels of the low-precision ops (Backend::amax ... round_bf16; the contracts are in
// backend.h): the quantizers of the fp16 / fp8 recipes and QAT, over float arrays, and the
// Tensor ops that validate their operands and call them. precision/quantize.h applies the same
// kernels to host arrays by format name. Static OpenMP schedules; every element's result is a
// function of its own block, so results do not depend on the thread count.
#pragma once
#include <cstdint>

#include "loom/backend/backend.h"

namespace loom::cpu {

// The array kernels (n elements; x (rows, cols) row-major where a shape is given).
float amax_of(const float* x, int64_t n);
void fake_quant(const NumberGrid& g, const float* x, int64_t n, float scale, float post, float* out);
void quant_codes_bf16(const NumberGrid& g, const float* x, int64_t n, float scale, uint16_t* out);
void fake_quant_blocks(const NumberGrid& g, const float* x, int64_t rows, int64_t cols, int64_t block_rows,
                       int64_t block_cols, float* out);
void fake_quant_mxfp4(const float* x, int64_t rows, int64_t cols, float* out);
void fake_quant_nvfp4(const float* x, int64_t rows, int64_t cols, float* out);
void round_to_bf16(float* x, int64_t n, bool stochastic, const RoundingDraw& draw);
// NF4 elements [first, first + n) (backend.h nf4_dequantize) into out (float or bf16).
template <typename T>
void nf4_dequantize(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_steps, const Nf4Spec& spec,
                    int64_t first, int64_t n, T* out);

// The Backend ops on f32 tensors (out: x's numel; quant_codes_bf16's out bf16).
float amax(const Tensor& x);
void fake_quant(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale, float post);
void quant_codes_bf16(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale);
void fake_quant_blocks(const Tensor& x, const Tensor& out, const NumberGrid& grid, int64_t block_rows,
                       int64_t block_cols);
void fake_quant_mxfp4(const Tensor& x, const Tensor& out);
void fake_quant_nvfp4(const Tensor& x, const Tensor& out);
void round_bf16(const Tensor& x, bool stochastic, const RoundingDraw& draw);
void dropout(const Tensor& x, const Tensor& out, float p, const RoundingDraw& draw);
void row_norms(const Tensor& x, const Tensor& norms);
void dora_weight(const Tensor& merged, const Tensor& base, const Tensor& magnitude, const Tensor& norms,
                 const Tensor& out);
void dora_backward(const Tensor& grad, const Tensor& merged, const Tensor& magnitude, const Tensor& norms,
                   const Tensor& dmagnitude);
void nf4_dequantize(const Tensor& codes, const Tensor& absmax_codes, const Tensor& absmax_steps, const Nf4Spec& spec,
                    int64_t first, const Tensor& out);
// The soft-target loss and its gradient (cpu_soft_target.cpp).
void soft_target_loss(const Tensor& logits, const Tensor& teacher, float temperature, float grad_scale, const Tensor& losses,
                      const Tensor& grad);
// Post-training-quantized weights (cpu_int_linear.cpp): every format multiplies with the input
// quantized to int8 per row and group (the whole row for W8A8).
void int_linear(const Tensor& x, const Tensor& codes, const Tensor& scales, const Tensor& zeros, const IntWeightSpec& spec,
                const Tensor* input_scale, const Tensor& y, float beta, const Tensor* bias);
void int_dequantize(const Tensor& codes, const Tensor& scales, const Tensor& zeros, const IntWeightSpec& spec,
                    const Tensor* input_scale, const Tensor& out);
// bf16 weights used where they lie (cpu_bf16_linear.cpp): Backend::bf16_weight_linear.
void bf16_weight_linear(const Tensor& x, const Tensor& w, const Tensor& y, float beta, const Tensor* bias);

}  // namespace loom::cpu
